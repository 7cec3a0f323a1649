"""--sync auto: exact or HALO sync from the agents' measured links (scheduler/sync_choice.py), said and applied."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from halo.cli.master import build_parser, check_model_and_cluster
from halo.errors import ConfigError
from halo.scheduler.profiles import Cluster, DeviceProfile
from halo.scheduler.sync_choice import choose_sync


def cluster(plr: float, one_way_ms: float, agents: int = 3) -> Cluster:
    devices = [DeviceProfile("master", 4e9, 20e9, is_master=True)]
    devices += [DeviceProfile(f"pi-{i}", 2e9, 5e9, plr=plr, latency_s=one_way_ms / 1e3) for i in range(1, agents + 1)]
    return Cluster(tuple(devices), context=256, weights="Q4_0")


@pytest.mark.parametrize("plr, one_way_ms, copies, said", [
    (0.0, 0.1, 1, "recovering a loss costs little"),  # wired (the ethernet profile)
    (0.05, 0.04, 1, "recovering a loss costs little"),  # the plain bed at 5 %
    (0.0, 5.0, 1, "recovering a loss costs little"),  # slow but clean
    (0.01, 1.0, 1, "or is rare"),  # wifi-good: 1 % lost, ~2 ms: two copies within the noise
    (0.05, 2.5, 2, "3 of 3 links"),  # wifi-busy
    (0.10, 5.0, 2, "goes out 2 times"),  # wifi-bad
])
def test_exact_is_picked_and_the_copies_follow_the_links(plr, one_way_ms, copies, said):
    """Exact everywhere: on the radio profiles HALO's deadlines dropped enough partials to change most answers for a
    few percent of speed (eval/results/sweep_wifi_busy*.md); two copies where links lose in bursts over radio round
    trips."""
    choice = choose_sync(cluster(plr, one_way_ms))
    assert (choice.mode, choice.copies) == ("exact", copies) and said in choice.reason, choice
    assert choice.to_json()["copies"] == copies
    if copies > 1:
        assert "not HALO" in choice.reason


def test_one_lossy_radio_link_is_enough_and_the_reason_names_it():
    mixed = cluster(0.0, 0.1)
    devices = list(mixed.devices)
    devices[2] = DeviceProfile("pi-kitchen", 2e9, 5e9, plr=0.03, latency_s=3e-3)
    choice = choose_sync(Cluster(tuple(devices), context=256, weights="Q4_0"))
    assert choice.copies == 2 and "1 of 3 links" in choice.reason and "pi-kitchen" in choice.reason
    assert choose_sync(cluster(0.05, 3.0, agents=0)).mode == "exact"


def test_auto_needs_the_measured_plan():
    for extra in (["--local-agents", "2", "--plan", "even"], ["--cluster", "x.toml"]):
        args = build_parser().parse_args(["generate", "--sync", "auto", *extra])
        with pytest.raises(ConfigError, match="--sync auto picks the mode from the agents' measured links"):
            check_model_and_cluster(args)


def test_auto_over_loopback_agents_picks_exact_says_why_and_gives_one_devices_tokens():
    def run(*extra) -> dict:
        out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--max-new-tokens", "8", "--json", *extra],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    alone = run()
    auto = run("--local-agents", "2", "--sync", "auto")
    assert auto["planning"]["sync_auto"]["mode"] == "exact"
    assert "recovering a loss costs little" in auto["planning"]["sync_auto"]["reason"]
    assert auto["sync"]["settings"]["mode"] == "exact"
    assert auto["token_ids"] == alone["token_ids"]


@pytest.mark.parametrize("given, applied", [(0, 2), (1, 1), (3, 3)])
def test_auto_applies_its_copies_unless_copies_were_given(monkeypatch, tmp_path, given, applied):
    """The pick's copies reach the master's sync settings (and every re-plan's: settings["sync"]); a --copies given
    is the user's and is kept, --copies 1 too (0: not given)."""
    import importlib

    from halo.scheduler.sync_choice import SyncChoice
    from halo.sync import SyncSettings

    connect = importlib.import_module("halo.distributed.connect")  # the module (the package exports its function)
    monkeypatch.setattr(connect, "measure_cluster", lambda *a, **k: cluster(0.05, 2.5))
    monkeypatch.setattr("halo.scheduler.sync_choice.choose_sync", lambda c: SyncChoice("halo", "radio", 2))
    monkeypatch.setattr(connect, "plan_measured", lambda weights, layout, settings, c, select: ("plan", {}))

    class Weights:
        source = "/nowhere/model.gguf"

    monkeypatch.setattr("halo.compute.linear.resolve_format", lambda fmt, weights: "native")
    monkeypatch.setattr("halo.predictors.store.predictors_path", lambda model, given: tmp_path)
    settings = dict(context=64, slots=1, timeout_s=1.0, sync=SyncSettings(copies=given), predictors=None, threads=1,
                    fmt="native", insecure=True)
    _, chosen, _ = connect.auto_plan(Weights(), None, [], None, True, True, settings)
    assert settings["sync"].mode == "halo" and settings["sync"].copies == applied
    # the report says the copies in use (it said auto's 2 where --copies 3 was applied), and why
    assert chosen.copies == applied and (given in (0, 2)) == ("as given" not in chosen.reason)


def test_copies_on_the_command_line_reach_the_sync_settings():
    from halo.cli.master import sync_settings

    assert sync_settings(build_parser().parse_args(["generate", "--copies", "2"])).copies == 2
    assert sync_settings(build_parser().parse_args(["generate", "--copies", "1"])).copies == 1
    unset = sync_settings(build_parser().parse_args(["generate"]))
    assert unset.copies == 0 and unset.copies_sent == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--copies", "9"])
