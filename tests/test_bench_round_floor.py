"""The round-floor benchmark's minimal TP decode: raw datagrams between forked agents give the single process's
tokens (its rows are only worth reading if its arithmetic is halo's), and the report reads its results."""

from __future__ import annotations

import json

import pytest

from halo.eval import bench_round_floor
from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf

# TinyLlama's vocabulary (the benchmark's prompt uses it), the rest small
SMALL = {**TINYLLAMA_1_1B, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("floor") / "small-Q4_0.gguf"
    write_random_gguf(path, SMALL, "Q4_0")
    return path


def test_minimal_tp_generates_the_single_process_tokens_and_the_report_reads_them(small_gguf, tmp_path):
    argv = ["--model", str(small_gguf), "--agents", "1,3", "--tokens", "8", "--runs", "1", "--seconds", "0.05",
            "--out", str(tmp_path), "--name", "floor"]
    assert bench_round_floor.main(argv) == 0  # it exits with an error where any row's tokens differ
    result = json.loads((tmp_path / "floor.json").read_text())
    compiled = ["compiled minimal, master + 1", "compiled minimal, master + 3"] if result["compiled"] == "built" else []
    assert [r["sync"] for r in result["rows"]] == ["halo single process", "minimal, one process",
                                                   "minimal, master + 1", "minimal, master + 3", *compiled,
                                                   "halo exact, master + 3"]
    assert all(r["tokens"] == 8 and r["ms_mean"] > 0 for r in result["rows"])
    assert all(len(b["alone_us"]) == 2 and len(b["together_us"]) == 2 for b in result["bandwidth"])
    table = (tmp_path / "floor.md").read_text()
    assert "| minimal, master + 3 |" in table and "Two cores stream" in table


def test_the_compiled_rounds_give_the_single_process_tokens(small_gguf, tmp_path):
    """eval/round_floor.c built here (a checkout with a C compiler, as CI is): its rounds are the same arithmetic."""
    from halo.compute.transformer import Transformer
    from halo.eval.bench_halo_speed import decode
    from halo.model.loader import load_weights

    floor = bench_round_floor.build_compiled_floor(tmp_path)  # a failed build raises: the test fails
    if isinstance(floor, str):
        pytest.skip(f"the compiled floor cannot be built here: {floor}")
    weights = load_weights(small_gguf)
    single = decode(Transformer(weights, fmt="native", max_seq_len=bench_round_floor.CONTEXT), 8, 60)["tokens"]
    for agents in (1, 3):
        with bench_round_floor.CompiledTensorParallel(weights, agents, floor) as model:
            assert decode(model, 8, 60)["tokens"] == single


def test_a_compiled_floor_that_cannot_be_built_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc -pthread")
    assert "no C compiler (no-such-cc)" in bench_round_floor.build_compiled_floor(tmp_path)


def test_a_compiled_floor_that_fails_to_build_raises_with_the_compiler_output(tmp_path, monkeypatch):
    """Not a skip: round_floor.c uses the kernel's internals, and a change there must show as a failure."""
    import shutil

    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("CC", "cc -DPyInit__round_floor=(")  # a definition that breaks the build
    with pytest.raises(RuntimeError, match="building .*round_floor.c failed"):
        bench_round_floor.build_compiled_floor(tmp_path)


def test_a_wrong_partial_is_caught_as_other_tokens(small_gguf, tmp_path, monkeypatch):
    """The check has teeth: an agent whose partial is lost (zeros) changes the tokens, and the run fails."""
    monkeypatch.setattr(bench_round_floor.MinimalTensorParallel, "_mlp",
                        lambda self, l, x: self.mlp[l].step(x, self.weights.layers[l].mlp_norm, self.config.norm_eps))
    argv = ["--model", str(small_gguf), "--agents", "1", "--tokens", "8", "--runs", "1", "--seconds", "0.05",
            "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="other tokens"):
        bench_round_floor.main(argv)


@pytest.mark.parametrize("argv, message", [(["--agents", "0"], "--agents"), (["--tokens", "4"], "--tokens"),
                                           (["--tokens", "250"], "--tokens"), (["--runs", "0"], "--runs")])
def test_arguments_are_refused_before_anything_loads(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench_round_floor.main(argv + ["--model", "/nonexistent"])


def test_agents_do_not_outlive_a_master_that_fails_to_build(small_gguf, monkeypatch):
    from halo.compute import neuron_groups
    from halo.model.loader import load_weights

    forked, fork = [], bench_round_floor.os.fork

    def recording_fork():
        pid = fork()
        if pid:
            forked.append(pid)
        return pid

    def failing_lm_head(*_args, **_kwargs):
        raise MemoryError("no room for the LM head")

    monkeypatch.setattr(bench_round_floor.os, "fork", recording_fork)
    monkeypatch.setattr(neuron_groups, "LmHeadShard", failing_lm_head)
    with pytest.raises(MemoryError):
        bench_round_floor.MinimalTensorParallel(load_weights(small_gguf), 2)
    assert len(forked) == 2
    for pid in forked:  # told to stop and reaped by the failing constructor
        with pytest.raises(ChildProcessError):
            bench_round_floor.os.waitpid(pid, bench_round_floor.os.WNOHANG)


def test_a_bandwidth_loop_whose_second_process_fails_is_reported_not_awaited(small_gguf, monkeypatch):
    from halo.compute import neuron_groups
    from halo.model.loader import load_weights

    parent, shard = bench_round_floor.os.getpid(), neuron_groups.MlpShard

    def fails_in_the_child(*args, **kwargs):
        if bench_round_floor.os.getpid() != parent:
            raise MemoryError("the second process ran out of memory")
        return shard(*args, **kwargs)

    monkeypatch.setattr(neuron_groups, "MlpShard", fails_in_the_child)
    with pytest.raises(SystemExit, match="second process failed"):
        bench_round_floor.mlp_half_us(load_weights(small_gguf), 0.05, together=True)
