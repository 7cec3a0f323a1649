"""Planner edge cases a property search found: a device too small for its predictors, a plan over budget saved and
run, numbers beyond a float, a pipeline plan that depended on the clock, a context that could not be saved."""

import json

import numpy as np
import pytest

from halo.errors import ConfigError
from halo.model.config import ModelConfig
from halo.scheduler import plan_io
from halo.scheduler.pipeline import plan_pipeline
from halo.scheduler.profiles import Cluster, DeviceProfile, load_cluster, model_profile, named_config
from halo.scheduler.tp_plan import build_plan, plan_tp


def test_a_device_without_room_for_its_predictors_takes_no_part():
    """It was charged for its predictors while holding nothing; the repair had nothing to move and every algorithm
    and sync mode refused a cluster whose master alone holds the model 500 times over."""
    model = model_profile(named_config("stories260k"), "fp32", "s", predictor_hidden=64)
    cluster = Cluster((DeviceProfile("big", 1e9, 1e9, is_master=True), DeviceProfile("tiny", 1e4, 1e9)), 512, "fp32")
    assert plan_tp(cluster, model, mode="exact").devices == [0]
    for algorithm in ("minmax", "greedy", "galaxy", "memory"):
        assert build_plan(cluster, model, algorithm).devices == [0]


def test_a_plan_over_its_devices_budgets_loads_as_such_and_is_not_run(tmp_path, stories_weights):
    """--algorithm vanilla (the paper's baseline) ignores memory: its plan file loaded as an ordinary plan."""
    from halo.compute.neuron_groups import GroupLayout
    from halo.distributed.connect import _load_plan
    from halo.sync import SyncSettings

    cluster = Cluster((DeviceProfile("big", 4e9, 1e9), DeviceProfile("small", 0.2e9, 1e9)), 512, "int4")
    plan = build_plan(cluster, model_profile(named_config("tinyllama-1.1b"), "int4", "t"), "vanilla")
    path = tmp_path / "plan.json"
    plan_io.save(plan_io.tp_plan_json(plan), path)
    assert plan.oom == plan_io.load(path).oom == ["small"]
    small = build_plan(Cluster((DeviceProfile("big", 1e9, 1e9), DeviceProfile("small", 1e3, 1e9)), 512, "fp32"),
                       model_profile(stories_weights.config, "fp32", "stories260K"), "vanilla")
    plan_io.save(plan_io.tp_plan_json(small), path)
    with pytest.raises(ConfigError, match=r"gives small more than its memory budget .*--algorithm minmax"):
        _load_plan(stories_weights, GroupLayout.for_model(stories_weights.config), str(path), None, SyncSettings())


def test_numbers_beyond_a_float_in_a_cluster_or_plan_file_are_refused_by_name(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[[device]]\nmemory_mb = 1" + "0" * 400 + "\ncompute_gflops = 10\n")
    with pytest.raises(ConfigError, match="memory_mb must be a finite number"):
        load_cluster(path)
    plan = plan_tp(Cluster((DeviceProfile("a", 1e9, 1e9),), 64, "fp32"), model_profile(named_config("stories260k"),
                                                                                        "fp32", "s"))
    doc = plan_io.tp_plan_json(plan)
    doc["cluster"]["devices"][0]["memory_bytes"] = 10 ** 400
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="must be a finite number"):
        plan_io.load(tmp_path / "p.json")


def test_a_big_pipeline_plan_does_not_depend_on_the_clock(monkeypatch):
    """Above annealing's size the planner tried random orders until a wall-clock deadline: a busy CPU gave another
    plan (and a clock that had run out, none at all)."""
    import itertools

    from halo.scheduler import pipeline

    config = ModelConfig(dim=512, hidden_dim=1376, n_layers=100, n_heads=8, n_kv_heads=8, vocab_size=32000,
                         max_seq_len=4096)
    model = model_profile(config, "int8", "deep")
    rng = np.random.default_rng(0)
    devices = tuple(DeviceProfile(f"d{i}", float(model.total_bytes(512) * rng.uniform(0.11, 0.2)),
                                  float(1e9 * 10 ** rng.uniform(0, 2)), bandwidth_bps=float(10 ** rng.uniform(6, 9)),
                                  latency_s=float(10 ** rng.uniform(-4, -2))) for i in range(8))
    cluster = Cluster(devices, 512, "int8")
    first = plan_pipeline(cluster, model)
    ticks = itertools.count(step=1000.0)  # every look at the clock: 1000 s later
    monkeypatch.setattr(pipeline.time, "perf_counter", lambda: next(ticks))
    assert plan_pipeline(cluster, model).stages == first.stages and first.complete


def test_a_cluster_s_context_is_a_whole_number_of_tokens():
    devices = (DeviceProfile("a", 1e9, 1e9),)
    with pytest.raises(ConfigError, match="the cluster's context must be an integer, got 512.5"):
        Cluster(devices, 512.5, "fp32")
    assert type(Cluster(devices, np.int64(512), "fp32").context) is int
