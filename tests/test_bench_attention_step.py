"""The attention-step benchmark times the C decode step of every layer, and against a baseline build reports the
largest difference of their outputs (here the build against itself: none)."""

from __future__ import annotations

import json

import pytest

from halo import linear
from halo.eval import bench_attention_step
from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf

SMALL = {**TINYLLAMA_1_1B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 128}


@pytest.mark.skipif(linear.projection_kernel() != "halo._nbits", reason="halo._nbits not built here: no decode step")
def test_the_benchmark_times_both_builds_and_reports_their_difference(tmp_path):
    from halo import _nbits

    model = tmp_path / "small.gguf"
    write_random_gguf(model, SMALL, "Q4_0")
    argv = ["--model", str(model), "--positions", "5,70", "--baseline", _nbits.__file__, "--runs", "2",
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
