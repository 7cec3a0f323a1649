"""Plans from measured profiles: loss in the objective, Algorithm 3 from measured PLR, heads by importance,
memory refusal with the numbers, the cost model's arithmetic, and the kernel benchmark's fit and cache."""

import itertools
import json
import math

import numpy as np
import pytest

from halo.compute.shares import place_by_rank, shares_from_plan
from halo.errors import ConfigError
from halo.runtime.measure import fit_kernels
from halo.scheduler.cost import Outcome, estimate, expected_max, p_needs_nack, parity_datagrams
from halo.scheduler.importance import head_order, mean_head_scores
from halo.scheduler.plan import TensorParallelPlan
from halo.scheduler.profiles import Cluster, DeviceProfile, measured_device, model_profile, named_config
from halo.scheduler.ratios import InsufficientMemory
from halo.scheduler.tp_plan import build_plan, plan_tp
from halo.sync import SyncSettings

TINY = model_profile(named_config("tinyllama-1.1b"), "int8", "tinyllama", mlp_group_size=512)


def measured(gflops: float, memory_gb: float = 4.0, message_ms: float = 0.2) -> dict:
    """What halo/runtime/measure.py reports for a device."""
    return {"compute_flops": gflops * 1e9, "overhead_s": [1e-4, 5e-5, 5e-5], "message_s": message_ms / 1e3,
            "memory_available_bytes": memory_gb * 1e9}


def link(plr: float, rtt_ms: float = 0.4, mbps: float = 500.0) -> dict:
    """What transport/probe.py reports for a link."""
    return {"plr": plr, "rtt_ms_p50": rtt_ms * 1.5, "rtt_ms_min": rtt_ms, "bandwidth_bps": mbps * 1e6}


def cluster_of(plrs: list[float], gflops: list[float] | None = None, memory_gb: float = 4.0) -> Cluster:
    gflops = gflops or [4.0] * (len(plrs) + 1)
    devices = [measured_device("master", measured(gflops[0], memory_gb), None, is_master=True)]
    devices += [measured_device(f"agent-{i}", measured(g, memory_gb), link(p), f"tcp://10.0.0.{i}:7070")
                for i, (p, g) in enumerate(zip(plrs, gflops[1:]), start=1)]
    return Cluster(tuple(devices), context=512, weights="int8")


def test_a_five_percent_link_holds_no_top_ranked_groups():
    cluster = cluster_of([0.0, 0.05, 0.0])
    sync = SyncSettings(mode="halo")
    plan = plan_tp(cluster, TINY, mode="halo", sync=sync)
    lossy = cluster.devices.index(next(d for d in cluster.devices if d.plr == 0.05))
    assert lossy in plan.devices  # fast enough to be worth it: it takes part, so the check below says something
    j = plan.devices.index(lossy)
    assert plan.reliability_order()[-1] == j  # Algorithm 3: the least reliable link is ranked last
    for kind in ("attention", "mlp"):
        ranks = plan.priority_ranks(kind)[j]
        cut = int(np.ceil(sync.critical_fraction * getattr(TINY, kind).count))
        held = ranks[:, 1] > ranks[:, 0]
        assert held.any() and (ranks[held, 0] >= cut).all(), f"{kind}: the lossy device holds top-ranked groups"


def test_over_tcp_a_lossy_link_is_left_out_and_the_blind_plan_keeps_it():
    cluster = cluster_of([0.05, 0.0], gflops=[4.0, 4.0, 2.0])
    aware = plan_tp(cluster, TINY, mode="tcp")
    clean = Cluster(tuple(DeviceProfile(**{**vars(d), "plr": 0.0}) for d in cluster.devices), 512, "int8")
    blind = plan_tp(clean, TINY, mode="tcp")
    assert 1 not in aware.devices and 1 in blind.devices
    blind_here = TensorParallelPlan(cluster, TINY, blind.algorithm, blind.devices, blind.counts)
    assert estimate(aware, "tcp").total_s < estimate(blind_here, "tcp").total_s


def test_the_master_ranks_first_even_when_its_link_is_lossy():
    devices = (DeviceProfile("m", 4e9, 4e9, plr=0.02, is_master=True), DeviceProfile("a", 4e9, 4e9),
               DeviceProfile("b", 4e9, 4e9, plr=0.01))
    plan = build_plan(Cluster(devices, 512, "int8"), TINY, "minmax")
    assert plan.reliability_order() == [0, 1, 2]  # master, then by PLR: a (0 %), b (1 %)
    assert plan.priority_ranks("mlp")[0, :, 0].max() == 0


def test_measured_memory_that_cannot_hold_the_model_is_refused_with_the_numbers():
    cluster = cluster_of([0.0, 0.0], memory_gb=0.2)
    with pytest.raises(InsufficientMemory, match=r"can hold \d+\.\d MB but the model needs \d+\.\d MB \(short by"):
        plan_tp(cluster, TINY, mode="exact")


def test_measured_plan_names_every_device_s_measured_memory(monkeypatch):
    import importlib

    from halo.compute.neuron_groups import GroupLayout
    from halo.distributed.session import MasterSettings
    from halo.model.loader import load_weights

    connect = importlib.import_module("halo.distributed.connect")  # the module (the package exports a function)
    weights = load_weights()
    small = Cluster((DeviceProfile("master", 0.3e6, 1e9, is_master=True), DeviceProfile("pi", 0.2e6, 1e9)), 512, "fp32")
    monkeypatch.setattr(connect, "measure_cluster", lambda *a, **k: small)
    with pytest.raises(InsufficientMemory, match=r"short by .*measured for the plan: master 0.3 MB, pi 0.2 MB"):
        connect.measured_plan(weights, GroupLayout.for_model(weights.config), MasterSettings(), ["tcp://x:1"], None,
                              True)


def test_plan_s_algorithm_reaches_a_measured_plan(monkeypatch):
    """`plan --local-agents/--agents --algorithm X` planned with minmax whatever X was (and printed minmax)."""
    import importlib

    from halo.cli import master as cli
    from halo.compute.neuron_groups import GroupLayout
    from halo.distributed.session import MasterSettings
    from halo.model.loader import load_weights

    connect = importlib.import_module("halo.distributed.connect")  # the module (the package exports a function)
    weights = load_weights()
    layout = GroupLayout.for_model(weights.config)
    cluster = cluster_of([0.0, 0.0])
    for algorithm in ("galaxy", "vanilla", "exact"):
        plan, _ = connect.plan_measured(weights, layout, MasterSettings(), cluster, True, algorithm)
        assert plan.algorithm == algorithm
    seen = []

    def plan_measured(*args):
        seen.append(args[-1])
        raise ConfigError("stop here")

    monkeypatch.setattr(connect, "measure_cluster", lambda *a, **k: cluster)
    monkeypatch.setattr(connect, "plan_measured", plan_measured)
    assert cli.main(["plan", "--agents", "10.0.0.1:7070,10.0.0.2:7070", "--insecure", "--insecure-lan",
                     "--algorithm", "greedy"]) == 2
    assert seen == ["greedy"]


def test_an_agent_s_memory_budget_caps_what_a_measured_plan_gives_it():
    """halo-agent --memory-budget was enforced by the agent but never reported: a plan from its free memory gave it a
    share it then refused ("share needs 0.3 MB ... budget 0.1 MB")."""
    from halo.compute.neuron_groups import GroupLayout
    from halo.distributed.connect import measure_cluster
    from halo.distributed.session import MasterSettings
    from halo.model.loader import load_weights
    from halo.runtime.local import LocalCluster

    weights = load_weights()
    with LocalCluster(1, extra_args=["--memory-budget", "0.25"]) as cluster:
        planned = measure_cluster(weights, GroupLayout.for_model(weights.config), MasterSettings(), cluster.endpoints,
                                  cluster.key, same_machine=True)
    assert planned.devices[1].memory_bytes == 0.25e6 < planned.devices[0].memory_bytes
    assert measured_device("pi", {**measured(1.0), "memory_budget_bytes": None}).memory_bytes == 4e9 * 0.85


def test_a_profile_without_a_probe_answer_is_refused():
    with pytest.raises(ConfigError, match="no probe of its link came back"):
        measured_device("pi", measured(1.0), {"plr": 1.0, "rtt_ms_p50": float("inf"), "rtt_ms_min": float("inf"),
                                              "bandwidth_bps": 0.0})
    with pytest.raises(ConfigError, match="malformed profile"):
        measured_device("pi", {"compute_flops": "fast"})


def test_loss_costs_time_in_proportion_to_what_the_mode_recovers():
    clean, lossy = cluster_of([0.0, 0.0]), cluster_of([0.05, 0.05])
    plan = build_plan(lossy, TINY, "minmax")
    same = TensorParallelPlan(clean, TINY, plan.algorithm, plan.devices, plan.counts)
    for mode in ("exact", "halo", "tcp", "lossy", "halo-tcp"):
        assert estimate(same, mode).loss_s == 0.0
        assert estimate(plan, mode).loss_s > 0.0
        assert estimate(plan, mode).compute_s == estimate(same, mode).compute_s
    assert estimate(plan, "tcp").loss_s > 20 * estimate(plan, "exact").loss_s  # a 200 ms RTO vs a NACK


def test_expected_max_is_exact():
    rng = np.random.default_rng(0)
    arrivals = [(float(rng.uniform(0, 3)), Outcome.maybe(float(rng.uniform(0, 0.5)), float(rng.uniform(0, 4))).plus(
        Outcome.maybe(0.1, 1.0))) for _ in range(3)]
    brute = 0.0
    for picks in itertools.product(*(range(len(o.values)) for _, o in arrivals)):
        p = np.prod([o.probs[k] for (_, o), k in zip(arrivals, picks)])
        brute += p * max(1.5, *(base + o.values[k] for (base, o), k in zip(arrivals, picks)))
    assert expected_max(1.5, arrivals) == pytest.approx(brute, rel=1e-12)


def test_parity_repairs_as_many_losses_per_group_as_it_has_parity_chunks():
    assert p_needs_nack(0.0, 6, 4) == 0.0
    assert p_needs_nack(0.05, 1, 4, 1) == pytest.approx(0.05 ** 2)  # the lone chunk and its parity copy both lost
    assert p_needs_nack(0.05, 1, 4, 2) == pytest.approx(0.05 ** 2)  # a lone chunk (below Q_FROM) gets P alone
    assert p_needs_nack(0.05, 2, 8, 2) == pytest.approx(1 - sum(math.comb(4, k) * 0.05 ** k * 0.95 ** (4 - k)
                                                               for k in range(3)))  # 2 + P + Q: three of 4 lost
    assert p_needs_nack(0.05, 6, 0) == pytest.approx(1 - 0.95 ** 6)  # no parity: any loss needs a NACK
    # 6 chunks + P + Q: three of the 8 datagrams lost
    assert p_needs_nack(0.05, 6, 8, 2) == pytest.approx(1 - sum(math.comb(8, k) * 0.05 ** k * 0.95 ** (8 - k)
                                                               for k in range(3)))
    assert p_needs_nack(0.05, 6, 8, 2) < p_needs_nack(0.05, 6, 4, 1) < p_needs_nack(0.05, 6, 0)
    assert parity_datagrams(6, 8, 2) == 2 and parity_datagrams(2, 8, 2) == 2 and parity_datagrams(1, 8, 2) == 1
    assert parity_datagrams(11, 8, 2) == 4 and parity_datagrams(9, 8, 2) == 3 and parity_datagrams(6, 0, 2) == 0


def test_kernel_fit_recovers_overheads_and_speed():
    truth = (2e-4, 5e-5, 1e-5)
    samples = [{"kind": kind, "groups": g, "flops": f * g, "seconds": truth[k] + f * g / 3e9}
               for k, (kind, f) in enumerate((("attention", 4e6), ("mlp", 1e7), ("lm_head", 2e6))) for g in (1, 5)]
    overheads, compute = fit_kernels(samples)
    assert compute == pytest.approx(3e9, rel=1e-6)
    assert overheads == pytest.approx(truth, abs=1e-9)
    flat = [{**s, "seconds": 1e-4} for s in samples]  # a tiny model: size makes no difference
    overheads, compute = fit_kernels(flat)
    assert compute == pytest.approx(5e7 / 1e-4)  # the best speed any point showed: a finite lower bound
    assert all(0 <= o < 1e-4 for o in overheads)


def test_device_benchmark_is_cached_per_quota_and_format(tmp_path, monkeypatch, stories_weights):
    from halo.compute.neuron_groups import GroupLayout
    from halo.runtime import measure

    monkeypatch.setenv("HALO_DEVICE_CACHE_DIR", str(tmp_path))
    layout = GroupLayout.for_model(stories_weights.config)
    first = measure.measure_device(stories_weights, layout, "fp32", name="pi")
    assert first["compute_flops"] > 0 and len(first["overhead_s"]) == 3 and first["memory_available_bytes"] > 0
    assert first["benchmark_s"] < 10
    again = measure.measure_device(stories_weights, layout, "fp32", name="pi")
    assert again["samples"] == first["samples"]  # from the cache: not timed again
    monkeypatch.setattr(measure, "cpu_limit", lambda: 0.25)  # another quota: measured anew
    assert measure.measure_device(stories_weights, layout, "fp32", name="pi")["samples"] != first["samples"]
    assert len(list(tmp_path.glob("device-*.json"))) == 2


@pytest.mark.parametrize("damage", ["{}", "[]", '{"compute_flops": NaN}', "DAMAGED-FIELDS"])
def test_a_damaged_cached_benchmark_is_measured_again(tmp_path, monkeypatch, stories_weights, damage):
    """Any JSON was trusted for a day: {} was a KeyError in planning, [] a TypeError, a string field an agent
    "reporting a malformed profile" (with advice to upgrade), a NaN in the master's file blamed on an agent."""
    import json

    from halo.compute.neuron_groups import GroupLayout
    from halo.runtime import measure

    monkeypatch.setenv("HALO_DEVICE_CACHE_DIR", str(tmp_path))
    layout = GroupLayout.for_model(stories_weights.config)
    first = measure.measure_device(stories_weights, layout, "fp32", name="pi")
    [cached] = tmp_path.glob("device-*.json")
    if damage == "DAMAGED-FIELDS":
        damage = json.dumps({**json.loads(cached.read_text()), "overhead_s": ["a", "b", "c"]})
    cached.write_text(damage)
    again = measure.measure_device(stories_weights, layout, "fp32", name="pi")
    assert again["samples"] != first["samples"] and measure.usable_benchmark(json.loads(cached.read_text()), "fp32", 1)


def test_device_cache_lives_apart_and_its_pruning_removes_only_stale_benchmarks(tmp_path, monkeypatch,
                                                                                   stories_weights):
    import os

    from halo.compute.neuron_groups import GroupLayout
    from halo.host.cache import device_cache_dir, remove_files
    from halo.model import catalog as models
    from halo.runtime import measure

    monkeypatch.delenv("HALO_CACHE_DIR", raising=False)
    monkeypatch.delenv("HALO_DEVICE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = tmp_path / "halo"
    assert models.cache_dir() == root / "models" and device_cache_dir() == root / "devices"
    model = root / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF weights")
    devices = root / "devices"
    (devices / "device-dir.json").mkdir(parents=True)  # a directory with a matching name: not a file of ours
    (devices / "device-dir.json" / "inside").write_text("keep")
    stale, fresh, notes, legacy = (devices / "device-stale.json", devices / "device-fresh.json", devices / "notes.txt",
                                   root / "device-legacy.json")
    for path in (stale, fresh, notes, legacy):
        path.write_text("{}")
    (devices / "device-link.json").symlink_to(model)
    old = measure.CACHE_MAX_AGE_S + 3600
    for path in (stale, notes, legacy, devices / "device-dir.json", devices / "device-dir.json" / "inside"):
        os.utime(path, (os.path.getmtime(path) - old,) * 2)
    os.utime(devices / "device-link.json", (os.path.getmtime(model) - old,) * 2, follow_symlinks=False)

    layout = GroupLayout.for_model(stories_weights.config)
    measure.measure_device(stories_weights, layout, "fp32", name="pi")  # writes its entry, then prunes
    assert not stale.exists() and fresh.exists() and notes.exists() and legacy.exists()
    assert (devices / "device-dir.json" / "inside").read_text() == "keep"
    assert (devices / "device-link.json").is_symlink() and model.read_bytes() == b"GGUF weights"
    assert len(list(devices.glob("device-*pi*.json"))) == 1
    for misplaced in (root, root / "models", tmp_path):  # the variable pointed at a shared directory
        monkeypatch.setenv("HALO_DEVICE_CACHE_DIR", str(misplaced))
        measure.prune_cache()
        assert model.read_bytes() == b"GGUF weights" and (root / "models").is_dir()
    assert not legacy.exists()  # a stale device-*.json in a directory it was pointed at: that one is its own
    with pytest.raises(ValueError, match="file-name pattern"):
        remove_files(root, "*/*")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_native_gguf_weights_plan_as_their_block_type(tmp_path, qtype, stories_weights):
    from gguf_models import tiny_gguf

    from halo.compute.neuron_groups import GroupLayout
    from halo.compute.shares import BYTES_PER_WEIGHT, planning_format
    from halo.model.loader import load_weights
    from halo.runtime import measure

    weights = load_weights(str(tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype)))
    assert planning_format("native", weights) == qtype and planning_format("int8", weights) == "int8"
    assert planning_format("native", stories_weights) == "fp32"  # no compact blocks
    compact, fp32 = (model_profile(weights.config, f, mlp_group_size=22) for f in (qtype, "fp32"))
    assert compact.mlp.bytes == pytest.approx(fp32.mlp.bytes * BYTES_PER_WEIGHT[qtype] / 4)
    samples = measure.kernel_samples(weights, GroupLayout.for_model(weights.config), "native", seconds=0.003)
    assert {s["kind"] for s in samples} == set(measure.KERNEL_KINDS) and all(s["seconds"] > 0 for s in samples)


def test_place_by_rank_maps_ranks_to_the_most_important_groups():
    ranges = np.array([[[0, 2], [0, 1]], [[2, 3], [1, 3]]])  # 2 devices, 2 layers
    order = [[2, 0, 1], [1, 2, 0]]
    assert place_by_rank(ranges, order) == [[[0, 2], [1]], [[1], [0, 2]]]
    assert place_by_rank(ranges) == [[[0, 1], [0]], [[2], [1, 2]]]
    with pytest.raises(ConfigError, match="permutation"):
        place_by_rank(ranges, [[0, 0, 1], [1, 2, 0]])


def test_heads_that_matter_most_go_to_the_master_and_the_reliable_links():
    cluster = cluster_of([0.05, 0.0])
    model = model_profile(named_config("stories260k"), "fp32", "stories", mlp_group_size=22, vocab_group_size=256)
    plan = build_plan(cluster, model, "vanilla")
    scores = np.tile(np.arange(8.0), (5, 1))  # head 7 matters most in every layer, head 0 least
    shares = shares_from_plan(plan, 5, head_order(scores))
    lossy = plan.devices.index(1)
    for layer in range(1, 5):
        assert 7 in shares[0].attention[layer]  # the master holds the top head
        assert 0 in shares[lossy].attention[layer]  # the lossy link the least important
        assert sorted(h for s in shares for h in s.attention[layer]) == list(range(8))


def test_head_scores_average_the_predictors_over_the_calibration_text():
    class Predictors:
        sessions = {1: None, 2: None}

        def scores(self, layer, hidden):
            return np.concatenate([hidden[:, :3] * layer, np.zeros((len(hidden), 4))], axis=1)

    entering = [np.array([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])] * 3
    scores = mean_head_scores(Predictors(), entering, 3, 3)
    assert scores.tolist() == [[0, 0, 0], [2, 1, 0], [4, 2, 0]]  # layer 0: no predictor, index order
    assert head_order(scores)[1].tolist() == [0, 1, 2] and head_order(scores)[0].tolist() == [0, 1, 2]


def test_plan_summary_says_why(tmp_path):
    from halo.scheduler.plan_io import plan_summary

    cluster = cluster_of([0.0, 0.0], gflops=[8.0, 8.0, 0.01])
    plan = plan_tp(cluster, TINY, mode="exact")
    summary = plan_summary(plan, "exact")
    json.dumps(summary)
    rows = {d["name"]: d for d in summary["devices"]}
    assert not rows["agent-2"]["participant"] and rows["agent-2"]["with_it"]["minmax_ms"] >= summary["estimate"]["ms_per_token"]
    assert rows["master"]["attention"]["ranks"][0] == 0


def test_memory_available_is_what_the_process_cgroup_limit_leaves(tmp_path):
    """An agent in a memory cgroup (a systemd MemoryMax, the test bed's per-agent limit) budgets from its own cgroup's
    limit, not the machine's free memory (the root cgroup's files said unlimited)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0 or not (root / "cgroup.procs").exists():
        pytest.skip("needs root and the cgroup-v1 memory controller to make a cgroup")
    group = root / f"halo-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(400 << 20))
        code = ("import os; open(os.environ['PROCS'], 'w').write(str(os.getpid()));"
                "from halo.host.memory import memory_limit; from halo.runtime.measure import memory_available;"
                "print(memory_available(), *memory_limit())")
        out = subprocess.run([sys.executable, "-P", "-c", code], env={**os.environ, "PROCS": str(group / "cgroup.procs")},
                             capture_output=True, text=True, timeout=60)
        available, limit, usage = map(int, out.stdout.split())
        assert limit == 400 << 20 and 0 < usage < limit and available == limit - usage
    finally:
        group.rmdir()
