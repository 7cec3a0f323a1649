"""The element-wise pieces of a Llama layer: RMSNorm, SwiGLU's SiLU, rotary embeddings, softmax."""

from __future__ import annotations

import math

import numpy as np

from halo.model.config import ModelConfig


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # x: [T, D]; the mean as np.mean computes it (a sum, then / D), without its wrapper's cost per call
    scale = 1.0 / np.sqrt(np.add.reduce(x * x, axis=-1, keepdims=True) / x.shape[-1] + eps)
    return (x * scale * weight).astype(np.float32, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Over the last axis: minus the max, exp, over the sum (out=x: in place, no temporaries as large as x)."""
    out = np.subtract(x, x.max(axis=-1, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True)
    return out


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Rotary frequencies per pair, with Llama-3 scaling when the config asks for it."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


class Rotary:
    """cos/sin tables for every position up to the context length, computed once."""

    def __init__(self, config: ModelConfig, max_seq_len: int):
        angles = np.outer(np.arange(max_seq_len, dtype=np.float64), rope_inv_freq(config))
        self.cos = np.cos(angles).astype(np.float32)  # [S, hd/2]
        self.sin = np.sin(angles).astype(np.float32)

    def apply(self, x: np.ndarray, start_pos: int) -> np.ndarray:
        # x: [T, H, hd], rotate-half convention
        T, half = x.shape[0], x.shape[-1] // 2
        cos = self.cos[start_pos:start_pos + T, None, :]
        sin = self.sin[start_pos:start_pos + T, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
