"""The prefill benchmark times prompts of real text in worker processes, side by side with a baseline interpreter
(here the same one), and its table reads the runs."""

from __future__ import annotations

import json
import sys

import pytest

from halo.eval import bench_prefill
from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf

SMALL = {**TINYLLAMA_1_1B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 258, "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill") / "small.gguf"
    write_random_gguf(path, SMALL, "Q4_0")
    return path


def test_prompts_are_timed_in_workers_beside_the_baseline(small_gguf, tmp_path, monkeypatch):
    monkeypatch.chdir(small_gguf.parent)  # a relative --model: the workers run in a directory of their own
    argv = ["--model", small_gguf.name, "--text", "", "--lengths", "3,70", "--runs", "1", "--baseline-python",
            sys.executable, "--out", str(tmp_path), "--name", "prefill"]
    assert bench_prefill.main(argv) == 0
    result = json.loads((tmp_path / "prefill.json").read_text())
    assert result["setups"] == ["this", "baseline"]
    for runs in result["runs_by_setup"].values():
        assert len(runs) == 1 and set(runs[0]) == {"3", "70"} and all(s > 0 for s in runs[0].values())
    table = (tmp_path / "prefill.md").read_text()
    assert "| 70 |" in table and "baseline / this" in table
    assert "Both ran the same halo: this compares nothing" in table  # the same interpreter on both sides


def test_a_text_shorter_than_the_longest_prompt_is_refused(small_gguf, tmp_path):
    from halo.model.loader import load_tokenizer, load_weights

    text = tmp_path / "short.txt"
    text.write_text("a b c")
    n = len(load_tokenizer(load_weights(small_gguf)).encode(text.read_text()))
    with pytest.raises(SystemExit, match="fewer than the longest prompt"):
        bench_prefill.main(["--model", str(small_gguf), "--text", str(text), "--lengths", str(n + 1),
                            "--out", str(tmp_path)])


def test_a_failing_worker_says_so(small_gguf, tmp_path):
    with pytest.raises(SystemExit, match="worker"):
        bench_prefill.main(["--model", str(small_gguf), "--text", "", "--lengths", "4000", "--runs", "1",
                            "--out", str(tmp_path)])  # beyond the model's context: the worker fails
