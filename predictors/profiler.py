"""Profiler: run calibration text through the reference model and record what the predictors learn.

For every token of every window and every layer l it stores the hidden state entering layer l (the
input a predictor has one layer ahead) and the activation L2 norm of each attention head and MLP
group of layer l. A predictor for layer l+1 pairs layer l's hidden states with layer l+1's norms.

Layout of the output directory (streamed to disk, never held whole in memory):
    meta.json                       model, text split, window size, counts
    {split}_hidden_{l}.npy          [tokens, D] float32
    {split}_norms_{l}.npy           [tokens, H + G] float32 (heads first, then MLP groups)
with split "train" (the first `train_fraction` of the text) and "val" (the rest).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from halo.compute.neuron_groups import GroupLayout
from halo.compute.tracing import TracingTransformer
from halo.errors import ConfigError
from halo.model.loader import load_tokenizer, load_weights, model_fingerprint


@dataclass
class ProfileInfo:
    directory: Path
    n_layers: int
    dim: int
    n_heads: int
    n_mlp_groups: int
    mlp_group_size: int
    tokens: dict  # split -> token count


def split_text(text: str, train_fraction: float) -> tuple[str, str]:
    """Cut at the paragraph boundary nearest train_fraction of the characters."""
    if not 0 < train_fraction < 1:
        raise ConfigError(f"train fraction must be in (0, 1), got {train_fraction}")
    cut = int(len(text) * train_fraction)
    boundary = text.find("\n\n", cut)
    cut = boundary if boundary >= 0 else cut
    return text[:cut], text[cut:]


def windows(tokens: list[int], bos: int, window: int) -> list[list[int]]:
    """Consecutive windows of window-1 tokens, each after a BOS (position 0 is not recorded)."""
    step = window - 1
    return [[bos] + tokens[i:i + step] for i in range(0, len(tokens), step) if len(tokens[i:i + step]) >= 8]


def profile(model_path: str | os.PathLike | None, text_path: str | os.PathLike, out: str | os.PathLike,
            train_fraction: float = 0.8, window: int = 256, max_chars: int | None = None,
            mlp_group_size: int | None = None, progress: bool = True) -> ProfileInfo:
    text_path, out = Path(text_path), Path(out)
    if not text_path.is_file():
        raise ConfigError(f"{text_path}: no such calibration text file")
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{text_path}: not UTF-8 text ({e})") from None
    if max_chars is not None:
        text = text[:max_chars]
    weights = load_weights(model_path)
    tokenizer = load_tokenizer(weights)
    window = min(window, weights.config.max_seq_len)
    layout = GroupLayout.for_model(weights.config, mlp_group_size)
    model = TracingTransformer(weights, max_seq_len=window, layout=layout)
    out.mkdir(parents=True, exist_ok=True)
    c = weights.config
    parts = dict(zip(("train", "val"), split_text(text, train_fraction)))
    counts = {}
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else 0
    for split, part in parts.items():
        chunks = windows(tokenizer.encode(part, bos=False), bos, window)
        n = sum(len(w) - 1 for w in chunks)
        if n == 0:
            raise ConfigError(f"the {split} part of {text_path} is too short to profile")
        counts[split] = n
        hidden = [np.lib.format.open_memmap(out / f"{split}_hidden_{l}.npy", "w+", np.float32, (n, c.dim))
                  for l in range(c.n_layers)]
        norms = [np.lib.format.open_memmap(out / f"{split}_norms_{l}.npy", "w+", np.float32,
                                           (n, layout.n_attention_groups + layout.n_mlp_groups))
                 for l in range(c.n_layers)]
        row = 0
        iterator = chunks
        if progress:
            from tqdm import tqdm

            iterator = tqdm(chunks, desc=f"profiling {split}", unit="window")
        for chunk in iterator:
            model.reset()
            model.forward(chunk)
            t = len(chunk) - 1
            for l, layer in enumerate(model.trace):
                hidden[l][row:row + t] = layer.hidden[1:]
                norms[l][row:row + t] = np.concatenate([layer.attention_norms[1:], layer.mlp_norms[1:]], axis=1)
            row += t
        for array in hidden + norms:
            array.flush()
        del hidden, norms
    info = ProfileInfo(out, c.n_layers, c.dim, layout.n_attention_groups, layout.n_mlp_groups, layout.mlp_group_size,
                       counts)
    meta = {"model": weights.source, "model_sha256": model_fingerprint(weights.source), "text": str(text_path),
            "train_fraction": train_fraction, "window": window, "max_chars": max_chars, "n_layers": c.n_layers,
            "dim": c.dim, "n_heads": info.n_heads, "n_mlp_groups": info.n_mlp_groups,
            "mlp_group_size": info.mlp_group_size, "tokens": counts}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return info


def load_split(directory: Path, split: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(hidden [N, D] entering `layer`, norms [N, H+G] of `layer`) as read-only memory maps."""
    return (np.load(directory / f"{split}_hidden_{layer}.npy", mmap_mode="r"),
            np.load(directory / f"{split}_norms_{layer}.npy", mmap_mode="r"))
