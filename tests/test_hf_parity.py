"""halo's logits equal transformers' LlamaForCausalLM on random checkpoints (prefill + 16 decode steps)."""

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from halo.compute.transformer import Transformer
from halo.errors import ModelFormatError
from halo.model.loader import load_tokenizer, load_weights

from hf_models import make_checkpoint, reference_logits

CONFIGS = {
    "mha-untied": dict(num_key_value_heads=4),
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "gqa-1kv-head": dict(num_key_value_heads=1, num_attention_heads=8),
    "rope-theta": dict(rope_theta=500000.0),
    "llama3-rope-scaling": dict(rope_theta=500000.0, max_position_embeddings=256,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "explicit-head-dim": dict(head_dim=32, num_attention_heads=4, num_key_value_heads=2),
    "sharded": dict(max_shard_size="40KB"),
}


def check_parity(directory, reference, fmt="fp32"):
    weights = load_weights(directory)
    model = Transformer(weights, fmt=fmt)
    tokens = [0, 5, 17, 99, 3, 250, 42, 7]
    prefill, steps, decoded = reference_logits(reference, tokens, n_decode=16)
    ours = model.forward(tokens, all_logits=True)
    errors = [np.abs(ours - prefill).max()]
    for token, expected in zip(decoded, steps):
        errors.append(np.abs(model.forward([token]) - expected).max())
    return max(errors)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers_in_fp32(tmp_path, name):
    overrides = dict(CONFIGS[name])
    shard = overrides.pop("max_shard_size", None)
    reference = make_checkpoint(tmp_path, seed=len(name), max_shard_size=shard, **overrides)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    assert check_parity(tmp_path, reference) <= 1e-4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints_load_exactly(tmp_path, dtype):
    # transformers reads the same rounded values back in fp32, so the match stays at fp32 precision
    reference = make_checkpoint(tmp_path, seed=3, dtype=dtype)
    assert check_parity(tmp_path, reference) <= 1e-4


def test_hf_tokenizer_round_trip(tmp_path):
    make_checkpoint(tmp_path)
    tokenizer = load_tokenizer(load_weights(tmp_path))
    ids = tokenizer.encode("Once upon a time there was a robot.")
    assert ids[0] == 0  # BOS from config.json
    assert tokenizer.decode(ids) == "Once upon a time there was a robot."
    step = tokenizer.stream()
    assert "".join(step(t) for t in ids) + step(None) == "Once upon a time there was a robot."


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path):
    make_checkpoint(tmp_path, vocab_size=300, tokenizer_vocab=310)
    with pytest.raises(ModelFormatError, match="tokenizer has 310 tokens but the model's embedding has only 300"):
        load_tokenizer(load_weights(tmp_path))
