"""The prefetch benchmark sweeps the kernel's distance per format, then decodes a model at the old fixed distance and
at the CPU's own (the same tokens at both: the distance only asks the memory earlier), and puts the setting back."""

from __future__ import annotations

import json

import pytest

from halo.compute import linear
from halo.eval import bench_kernel_prefetch
from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf

SMALL = {**TINYLLAMA_1_1B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 18000, "max_position_embeddings": 128}
# (the vocabulary holds bench_halo_speed.PROMPT, which the decodes start from)


@pytest.mark.skipif(linear.projection_kernel() != "halo._nbits", reason="halo._nbits not built here: nothing to sweep")
def test_the_sweep_covers_every_format_and_distance_and_the_decodes_agree(tmp_path):
    model = tmp_path / "small.gguf"
    write_random_gguf(model, SMALL, "Q4_0")
    chosen = linear._nbits.prefetch_units()
    bench_kernel_prefetch.main(["--megabytes", "1", "--repeats", "1", "--copy-megabytes", "8", "--model", str(model),
                                "--runs", "2", "--tokens", "3", "--out", str(tmp_path), "--name", "kp"])
    assert linear._nbits.prefetch_units() == chosen  # the sweep's settings undone
    result = json.loads((tmp_path / "kp.json").read_text())
    assert result["default_units"] == chosen
    distances = sorted({*bench_kernel_prefetch.DISTANCES, chosen})
    for fmt in bench_kernel_prefetch.FORMATS:
        rows = [r for r in result["rows"] if r["format"] == fmt]
        assert [r["ahead_units"] for r in rows] == distances and all(r["gb_per_s"] > 0 for r in rows)
    decoded = {bench_kernel_prefetch.FIXED, chosen}  # one distance where the CPU's own is the old one (off Intel)
    assert sorted(r["ahead_units"] for r in result["decode"]) == sorted(list(decoded) * 2)
    assert all(r["ms_per_token"] > 0 for r in result["decode"])
    assert f"| {chosen} (default) |" in (tmp_path / "kp.md").read_text()
