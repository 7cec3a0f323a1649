"""The attention-step benchmark times the C decode step of every layer, and against a baseline build reports the
largest difference of their outputs (here the build against itself: none)."""

from __future__ import annotations

import json
import shutil

import pytest

from halo.compute import linear
from halo.eval import bench_attention_step
from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf

SMALL = {**TINYLLAMA_1_1B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 128}


@pytest.mark.skipif(linear.projection_kernel() != "halo._nbits", reason="halo._nbits not built here: no decode step")
def test_the_benchmark_times_both_builds_and_reports_their_difference(tmp_path):
    from halo import _nbits

    model, baseline = tmp_path / "small.gguf", tmp_path / "baseline_nbits.so"
    write_random_gguf(model, SMALL, "Q4_0")
    shutil.copy(_nbits.__file__, baseline)  # another file of the same build: the same bits, a module of its own
    loaded = bench_attention_step.load_build(str(baseline))
    assert loaded is not _nbits and loaded.__file__ == str(baseline)
    argv = ["--model", str(model), "--positions", "5,70", "--baseline", str(baseline), "--runs", "2",
            "--repeats", "1", "--out", str(tmp_path), "--name", "att"]
    assert bench_attention_step.main(argv) == 0
    result = json.loads((tmp_path / "att.json").read_text())
    assert [r["position"] for r in result["rows"]] == [5, 70]
    for row in result["rows"]:
        assert len(row["this build ms"]) == len(row["baseline ms"]) == 2 and min(row["this build ms"]) > 0
        assert row["max_abs_diff"] == 0.0 and row["max_abs_output"] > 0  # the same build: the same bits
    assert "| 70 |" in (tmp_path / "att.md").read_text()


def test_bad_positions_are_refused():
    with pytest.raises(SystemExit, match="--positions"):
        bench_attention_step.main(["--positions", "-1"])
