"""The scaling benchmark: nodes pinned to cores of their own, run as a user runs them (halo-agent, halo-master
generate --json), their tokens checked against one node's; the report's ratios read from its rows."""

from __future__ import annotations

import json
import os

import pytest

from halo.eval import bench_scaling
from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf

SMALL = {**TINYLLAMA_1_1B, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": 512}
two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two nodes need two cores of their own")


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("scaling") / "small-Q4_0.gguf"
    write_random_gguf(path, SMALL, "Q4_0")
    return path


@two_cores
def test_two_pinned_nodes_give_one_nodes_tokens_and_the_report_reads_them(small_gguf, tmp_path):
    argv = ["--model", str(small_gguf), "--nodes", "1,2", "--tokens", "8", "--runs", "1", "--plans", "even",
            "--busy-poll", "off", "--out", str(tmp_path), "--name", "scaling"]
    assert bench_scaling.main(argv) == 0
    result = json.loads((tmp_path / "scaling.json").read_text())
    assert result["host"]["cores"] == os.cpu_count() and result["host"]["cpu"]
    setups = [(r["nodes"], r["setup"]) for r in result["rows"]]
    assert setups == [(1, "one node"), (2, "one process, 2 threads"), (2, "ceiling"), (2, "halo even, busy poll off")]
    cluster = result["rows"][-1]
    assert cluster["same_tokens"] is True and len(cluster["tokens"]) == 8
    assert cluster["round_overhead_ms"]["p50"] > 0 and cluster["sync_rounds_per_token"] == 5  # 2 x 2 layers + head
    assert len(result["rows"][2]["ms_each"]) == 2
    table = (tmp_path / "scaling.md").read_text()
    assert "| 2 | 0 % | halo even, busy poll off |" in table and "| yes |" in table
    assert (tmp_path / "scaling.png").stat().st_size > 0


def row(nodes, setup, ms, **extra):
    return {"run": 0, "nodes": nodes, "plr": 0.0, "setup": setup, "ms_mean": ms, **extra}


def test_ratios_divide_the_same_runs_one_node_and_the_ceiling_counts_every_core():
    result = {"command": "c", "model": "m.gguf", "host": {"cpu": "cpu", "cores": 2}, "threads_per_node": 1,
              "tokens": 8, "runs": 2, "bed": False,
              "rows": [row(1, "one node", 20.0), row(1, "one node", 22.0, run=1),
                       row(2, "ceiling", 25.0, ms_each=[24.0, 26.0]), row(2, "ceiling", 22.0, ms_each=[22.0, 22.0], run=1),
                       row(2, "halo even, busy poll on", 12.5, same_tokens=True, round_overhead_ms={"p50": 0.1}),
                       row(2, "halo even, busy poll on", 13.0, same_tokens=False, run=1)]}
    lines = "\n".join(bench_scaling.render(result))
    assert "| 1 | 0 % | one node | 20.00 | 1.00x (1.00, 1.00) |" in lines
    assert "| 2 | 0 % | ceiling | each 22.0, 22.0 | 1.80x (1.60, 2.00) |" in lines  # 2 x 20 / 25 and 2 x 22 / 22
    # 20 / 12.5 and 22 / 13, each over its own run's ceiling; any run with other tokens: no
    assert "| halo even, busy poll on | 12.50 | 1.65x (1.60, 1.69) | 0.92 | 100 us | **no** |" in lines


def test_arguments_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(SystemExit, match="need 64 cores"):
        bench_scaling.main(["--nodes", "1,64", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="only with --bed"):
        bench_scaling.main(["--nodes", "1", "--plr", "0.05", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--plans"):
        bench_scaling.main(["--nodes", "1", "--plans", "evenly", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--profile: radio links are the test bed's"):  # (ran on loopback, said wifi)
        bench_scaling.main(["--nodes", "1", "--profile", "wifi-busy", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="not an executable"):
        bench_scaling.main(["--nodes", "1", "--dllama", str(tmp_path / "dllama"), "--out", str(tmp_path)])
