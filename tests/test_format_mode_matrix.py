"""Every weight format `generate` takes runs in both cluster modes on a 4-bit GGUF: tensor-parallel agents and
pipeline stage workers (which refused "native", the default, at their hello: "unknown weight format 'native'"),
each giving one device's tokens in its format."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf

SMALL = {**TINYLLAMA_1_1B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": 512}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("matrix") / "small-Q4_0.gguf"
    write_random_gguf(path, SMALL, "Q4_0")
    return path


def tokens(gguf, *extra) -> list[int]:
    out = subprocess.run([sys.executable, "-m", "halo.cli", "generate", "--model", str(gguf), "--max-new-tokens", "6",
                          "--json", *extra], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)["token_ids"]


@pytest.mark.parametrize("weights", ["native", "fp32", "int8"])
def test_every_format_runs_in_both_modes_with_one_devices_tokens(gguf, weights):
    alone = tokens(gguf, "--weights", weights)
    assert tokens(gguf, "--weights", weights, "--mode", "pipeline", "--local-agents", "2") == alone
    assert tokens(gguf, "--weights", weights, "--local-agents", "2", "--plan", "even") == alone
