"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), seeded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, settings: SamplingSettings):
        self.settings = settings
        self.rng = np.random.default_rng(settings.seed)

    def __call__(self, logits: np.ndarray) -> int:
        s = self.settings
        if s.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / s.temperature
        if 0 < s.top_k < len(z):
            kth = np.partition(z, -s.top_k)[-s.top_k]
            z = np.where(z < kth, -np.inf, z)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        if s.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, s.top_p) + 1)]  # smallest set reaching top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[keep] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return int(self.rng.choice(len(probs), p=probs))
