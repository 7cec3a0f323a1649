"""Cluster files and versioned JSON plans: round trips and clear errors."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from halo.errors import ConfigError
from halo.scheduler import plan_io
from halo.scheduler.pipeline import plan_pipeline
from halo.scheduler.profiles import load_cluster, model_profile, named_config
from halo.scheduler.tp_plan import plan_tp

EXAMPLE = Path(__file__).resolve().parents[1] / "rpi" / "examples" / "home-cluster.toml"
MODEL = model_profile(named_config("llama-3.1-8b"), "int4", "llama-3.1-8b")


def test_example_cluster_file_loads():
    cluster = load_cluster(EXAMPLE)
    assert [d.name for d in cluster.devices][:2] == ["minipc", "laptop"] and cluster.master == 0
    assert cluster.devices[3].plr == 0.10 and cluster.weights == "int4"


@pytest.mark.parametrize("text, message", [
    ("[[device]]\nname='a'\nmemory_mb=1\n", "lacks the required key compute_gflops"),
    ("[[device]]\nname='a'\nmemory_mb=1\ncompute_gflops=1\nspeed=3\n", "unknown keys"),
    ("[[device]\n", "not valid TOML"),
    ("[cluster]\ncontext=4\n", "no \\[\\[device\\]\\] tables"),
    ("[[device]]\nname='a'\nmemory_mb=1\ncompute_gflops=1\nplr=1.5\n", "plr is a loss rate"),
    ("[[device]]\nname='a'\nmemory_mb=1\ncompute_gflops=1\nmaster=true\n[[device]]\nname='b'\nmemory_mb=1\n"
     "compute_gflops=1\nmaster=true\n", "more than one device says master"),
    # a typo planned for the defaults without a word; one agent given twice became a busy refusal or the master alone
    ("[cluster]\ncontxt=100\n[[device]]\nname='a'\nmemory_mb=1\ncompute_gflops=1\n",
     r"\[cluster\] has unknown keys \['contxt'\]; allowed: context, weights"),
    ("[clustre]\ncontext=100\n[[device]]\nname='a'\nmemory_mb=1\ncompute_gflops=1\n", r"unknown keys \['clustre'\]"),
    ("[[device]]\nname='m'\nmemory_mb=1\ncompute_gflops=1\n[[device]]\nname='a'\naddress='10.0.0.2:7070'\n"
     "memory_mb=1\ncompute_gflops=1\n[[device]]\nname='b'\naddress='10.0.0.2:7070'\nmemory_mb=1\ncompute_gflops=1\n",
     "10.0.0.2:7070 is given to more than one device"),
])
def test_bad_cluster_files(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_cluster(path)


def test_tp_plan_round_trip(tmp_path):
    plan = plan_tp(load_cluster(EXAMPLE), MODEL)
    plan_io.save(plan_io.tp_plan_json(plan), tmp_path / "p.json")
    back = plan_io.load(tmp_path / "p.json")
    assert back.devices == plan.devices
    for kind in plan.counts:
        np.testing.assert_array_equal(back.counts[kind], plan.counts[kind])


def test_pipeline_plan_round_trip(tmp_path):
    cluster = load_cluster(EXAMPLE)
    plan = plan_pipeline(cluster, MODEL)
    plan_io.save(plan_io.pipeline_plan_json(plan, cluster, MODEL), tmp_path / "p.json")
    back, _, _ = plan_io.load(tmp_path / "p.json")
    assert back.stages == plan.stages and back.complete


def edited(tmp_path, document, edit) -> Path:
    document = json.loads(json.dumps(document))
    edit(document)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(document))
    return path


def test_bad_plans_are_refused_with_the_field(tmp_path):
    cluster = load_cluster(EXAMPLE)
    tp = plan_io.tp_plan_json(plan_tp(cluster, MODEL))
    pipe = plan_io.pipeline_plan_json(plan_pipeline(cluster, MODEL), cluster, MODEL)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        plan_io.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="plan version 2 is not supported"):
        plan_io.load(edited(tmp_path, tp, lambda d: d.update(version=2)))

    def break_sum(d):
        d["counts"]["attention"][0][0] += 1
    with pytest.raises(ConfigError, match="counts.attention do not sum"):
        plan_io.load(edited(tmp_path, tp, break_sum))

    def overlap(d):
        d["priority"]["mlp"][0][0] = [0, 40]
    with pytest.raises(ConfigError, match="priority.mlp ranges"):
        plan_io.load(edited(tmp_path, tp, overlap))

    def overlap_stage(d):
        d["stages"].append({"worker": "laptop", "start": 3, "stop": 5})
    with pytest.raises(ConfigError, match="overlaps or leaves a gap"):
        plan_io.load(edited(tmp_path, pipe, overlap_stage))


def test_plan_command_prints_and_writes(tmp_path):
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "plan", "--cluster", str(EXAMPLE), "--model-config",
                          "llama-3.1-8b", "--out", str(tmp_path / "plan.json")], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "minipc" in out.stdout and "ms/token" in out.stdout
    assert plan_io.load(tmp_path / "plan.json").n >= 1
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "plan", "--cluster", str(tmp_path / "none.toml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no such cluster file" in out.stderr


def test_a_plan_made_for_another_model_is_refused_naming_what_differs(tmp_path):
    """`generate --plan p.json` on a model other than the plan's: a ConfigError that says so (it was an IndexError
    deep in the shares, or in the worker)."""
    from halo.compute.neuron_groups import GroupLayout
    from halo.scheduler.profiles import check_plan_fits

    config = named_config("llama-2-7b")
    plan = plan_tp(load_cluster(EXAMPLE), model_profile(config, "int4"))
    plan_io.save(plan_io.tp_plan_json(plan), tmp_path / "p.json")
    back = plan_io.load(tmp_path / "p.json")
    check_plan_fits(back.model, config, GroupLayout.for_model(config))  # its own model: nothing to say
    other = named_config("llama-3.1-8b")
    with pytest.raises(ConfigError, match=r"made for another model .*MLP groups 43 \(this model: 56\)") as e:
        check_plan_fits(back.model, other, GroupLayout.for_model(other))
    assert "halo-master plan --model" in str(e.value) and "layers" not in str(e.value)  # both have 32 layers


def test_a_cluster_file_names_browser_tabs_and_the_local_master_as_the_pipeline_docs_say(tmp_path):
    """address = "browser" (docs/pipeline.md) and "local" were refused as "not HOST:PORT"."""
    path = tmp_path / "c.toml"
    path.write_text("[[device]]\nname='me'\naddress='local'\nmaster=true\nmemory_mb=100\ncompute_gflops=1\n"
                    "[[device]]\nname='tab'\naddress='browser'\nmemory_mb=100\ncompute_gflops=1\n"
                    "[[device]]\nname='tab2'\naddress='browser'\nmemory_mb=100\ncompute_gflops=1\n")
    assert [d.address for d in load_cluster(path).devices] == ["local", "browser", "browser"]


def test_device_overheads_must_be_finite_numbers():
    """A hand-edited plan's "overhead_s": "abc" was a ValueError traceback; [Infinity, ...] was planned with."""
    from halo.scheduler.profiles import DeviceProfile

    for bad in ("abc", [float("inf")] * 3, [0.1, -1, 0]):
        with pytest.raises(ConfigError, match="overhead"):
            DeviceProfile("d", 1e6, 1e9, overhead_s=bad)


@pytest.mark.parametrize("cluster, extra, said", [
    ('weights = "int8"\ncontext = 64\n', [], "the plan budgets memory for int8 weights and this run computes in fp32"),
    ('weights = "fp32"\ncontext = 64\n', ["--context", "128"], "budgets a KV cache of 64 tokens and this run needs 128"),
])
def test_a_run_that_needs_more_than_its_cluster_file_budgets_is_refused(tmp_path, cluster, extra, said):
    """The file's weights and context were ignored: a plan budgeted for int8 ran fp32 (an agent then refused its share
    for memory), a longer --context ran past what each device was given."""
    import subprocess
    import sys

    path = tmp_path / "c.toml"
    path.write_text(f"[cluster]\n{cluster}[[device]]\nname='m'\nmaster=true\nmemory_mb=1000\ncompute_gflops=10\n"
                    "[[device]]\nname='a'\naddress='127.0.0.1:17999'\nmemory_mb=1000\ncompute_gflops=10\n")
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--cluster", str(path), "--insecure",
                          "--max-new-tokens", "2", *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and said in out.stderr, out.stderr[-1500:]


def test_the_run_context_is_as_asked_else_the_default_or_a_plans_budget():
    """A --context above 2048 was cut to 2048 for every distributed run (the plan-less fallback was the default)."""
    from types import SimpleNamespace

    from halo.distributed.connect import run_context

    weights = SimpleNamespace(config=SimpleNamespace(max_seq_len=8192))
    plan = SimpleNamespace(cluster=SimpleNamespace(context=1024))
    assert run_context(weights, 4096, None, 1) == 4096 and run_context(weights, 4096, plan, 1) == 4096
    assert run_context(weights, None, None, 1) == 2048 and run_context(weights, None, plan, 2) == 512
    assert run_context(weights, 100_000, None, 1) == 8192


def test_a_plan_written_from_a_cluster_file_without_weights_runs_with_the_default_weights(tmp_path):
    """plan --out planned int8 for a file without [cluster] weights while generate --cluster planned the run's own
    format: the saved plan was then refused for the default fp32 run, advising a --weights that does not exist."""
    import subprocess
    import sys

    from halo.model.loader import load_weights
    from halo.scheduler.profiles import check_plan_budget

    cluster = tmp_path / "c.toml"
    cluster.write_text("[[device]]\nname='m'\nmaster=true\nmemory_mb=1000\ncompute_gflops=10\n"
                       "[[device]]\nname='a'\naddress='127.0.0.1:17999'\nmemory_mb=1000\ncompute_gflops=10\n")
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "plan", "--cluster", str(cluster), "--out",
                          str(tmp_path / "p.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = plan_io.load(tmp_path / "p.json")
    weights = load_weights(None)
    check_plan_budget(plan.cluster, weights, "native", 64)  # the bundled model's fp32: no refusal
    int4 = type(plan.cluster)(plan.cluster.devices, 64, "int4")
    with pytest.raises(ConfigError, match=r"computes in fp32 \(--weights native\): set weights") as refused:
        check_plan_budget(int4, weights, "native", 64)
    assert "pass --weights" not in str(refused.value)  # no format of this run fits int4
