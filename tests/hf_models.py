"""Random small Llama checkpoints written by `transformers`, for parity tests (test-only dependency)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A small byte-level BPE tokenizer.json with at most vocab_size tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["Once upon a time there was a little robot who liked to count packets.",
            "The quick brown fox jumps over the lazy dog. Edge devices talk over lossy Wi-Fi."] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(directory / "tokenizer.json"))


def make_checkpoint(directory: Path, seed: int = 0, dtype: str = "float32", max_shard_size: str | None = None,
                    tokenizer_vocab: int | None = None, **overrides):
    """Write a random LlamaForCausalLM to directory; returns the float32 torch model that reads it back."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.25, bos_token_id=0, eos_token_id=1)
    settings.update(overrides)
    torch.manual_seed(seed)
    config = LlamaConfig(**settings)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1 so a wrong norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    write_tokenizer(Path(directory), tokenizer_vocab or settings["vocab_size"] - 64)
    reference = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    reference.eval()
    return reference


def reference_logits(model, tokens: list[int], n_decode: int) -> tuple[np.ndarray, list[np.ndarray], list[int]]:
    """Prefill logits [T, V] and greedy decode logits with transformers' own KV cache."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=True)
        prefill = out.logits[0].numpy()
        past = out.past_key_values
        token = int(prefill[-1].argmax())
        decoded, steps = [], []
        for _ in range(n_decode):
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].numpy()
            steps.append(logits)
            decoded.append(token)
            token = int(logits.argmax())
    return prefill, steps, decoded
