"""Deployment files: the systemd unit, the install script and the example agent config."""

import configparser
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from halo.transport.reliable import generate_key

RPI = Path(__file__).resolve().parents[1] / "rpi"


def test_unit_restarts_runs_unprivileged_and_reads_etc_halo():
    unit = configparser.ConfigParser(strict=False)
    unit.read(RPI / "halo-agent.service")
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    assert service["User"] not in ("root", "") and service["KillSignal"] == "SIGTERM"
    assert "/etc/halo/agent.toml" in service["ExecStart"]


def test_install_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(RPI / "install-agent.sh")]).returncode == 0


def test_example_config_starts_an_agent(tmp_path):
    config = tomllib.loads((RPI / "agent.example.toml").read_text())
    assert set(config) == {"listen", "key", "model", "name", "threads"}  # (busy_poll, weights: commented out)
    generate_key(tmp_path / "cluster.key")
    mine = tmp_path / "agent.toml"
    mine.write_text(f'listen = "tcp://127.0.0.1:0"\nkey = "{tmp_path / "cluster.key"}"\nname = "t"\n')
    process = subprocess.Popen([sys.executable, "-m", "halo.edge_agent", "--config", str(mine)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("LISTENING tcp://127.0.0.1:")
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0  # SIGTERM drains and exits cleanly


def test_the_unit_keeps_its_caches_and_is_hardened():
    """Under ProtectSystem=strict HOME was read-only (every start re-hashed the model); systemd rated the unit 8.5
    EXPOSED."""
    import re
    import shutil

    text = (RPI / "halo-agent.service").read_text()
    assert "CacheDirectory=halo" in text and "Environment=XDG_CACHE_HOME=%C" in text  # halo/host/cache.py's root
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed: the exposure score cannot be measured here")
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(RPI / "halo-agent.service")],
                         capture_output=True, text=True, timeout=60)
    score = re.search(r"Overall exposure level for halo-agent\.service: ([0-9.]+)", out.stdout)
    if out.returncode != 0 or score is None:
        pytest.skip(f"this systemd-analyze cannot rate a unit file offline: {(out.stderr or out.stdout)[-200:]}")
    assert float(score.group(1)) <= 3.0, out.stdout


@pytest.mark.parametrize("argument, hash_env, said", [
    (None, None, "give the wheel to install"),
    ("halo-edge", None, "neither a wheel file nor an exact version"),
    ("halo-edge>=0.1", None, "neither a wheel file nor an exact version"),
    ("WHEEL", "0" * 64, "refusing to install it"),
])
def test_the_installer_installs_only_what_is_named_exactly(tmp_path, argument, hash_env, said):
    """It ran `pip install halo-edge` as root, unpinned and unchecked, when given no argument. Refused here before
    anything is installed (these checks come before the root check)."""
    import os

    wheel = tmp_path / "halo_edge-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"not really a wheel")
    args = [] if argument is None else [str(wheel) if argument == "WHEEL" else argument]
    env = {**os.environ, **({"HALO_WHEEL_SHA256": hash_env} if hash_env else {})}
    out = subprocess.run(["bash", str(RPI / "install-agent.sh"), *args], capture_output=True, text=True, timeout=30,
                         env=env)
    assert out.returncode == 2 and said in out.stderr, out.stderr


def test_a_cpu_quota_the_kernel_would_refuse_is_refused_at_once():
    """cgroup v1 takes no cfs quota under 1000 us: the toggle thread's write failed with EINVAL and it returned, so
    a throttle of 0.005 cores throttled nothing, without a word."""
    from halo.rpi.throttle import CpuThrottle

    with pytest.raises(ValueError, match="under the kernel's 1000 us"):
        CpuThrottle(1, quota=0.005, period_s=0.2)
    assert CpuThrottle(1, quota=0.005, period_s=0.2, cfs_period_us=1_000_000).quota == 0.005


def test_throttle_settings_the_kernel_or_the_toggle_cannot_take_are_refused():
    """cfs_period_us past the kernel's range failed in __enter__ and left the cgroup behind; period_s 0 toggled the
    quota in a loop, a whole core."""
    from halo.rpi.throttle import CpuThrottle

    with pytest.raises(ValueError, match="cfs_period_us"):
        CpuThrottle(1, quota=0.5, cfs_period_us=2_000_000)
    with pytest.raises(ValueError, match="period_s"):
        CpuThrottle(1, quota=0.5, period_s=0)
