"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), seeded."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from halo.errors import ConfigError, HaloError


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int = 0

    def __post_init__(self):
        """Every value the sampler will meet, checked here: a bad one is the caller's error (a CLI usage error, an
        HTTP 400), never a failure in the middle of a generation (which `serve` would take for the cluster's)."""
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ConfigError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ConfigError(f"--top-k must be an integer >= 0, got {self.top_k}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2 ** 64:
            raise ConfigError(f"--seed must be an integer from 0 to 2^64 - 1, got {self.seed}")


DRAW_BLOCK = 512  # tokens a draw sums one by one (Sampler.draw)


def check_finite(logits: np.ndarray) -> None:
    """Logits with a NaN or a +infinity, or none finite: a HaloError (argmax of a NaN is token 0: a damaged model said
    "" forever, exit 0). -infinity is a masked token (a top-k head's), not damage."""
    if not np.isfinite(np.max(logits, axis=-1)).all():  # a row's max is NaN with any NaN, +inf with any +inf, and
        # -inf with no finite logit: one reduction, no array of flags on every token (the counts only on failure)
        raise HaloError(f"the model's logits are not finite ({int(np.isnan(logits).sum())} NaN, "
                        f"{int(np.isposinf(logits).sum())} +infinite of {logits.size}): its weights are damaged (fetch "
                        "a named model again; check the file, or a device's copy of it)")


class Sampler:
    def __init__(self, settings: SamplingSettings):
        self.settings = settings
        self.rng = np.random.default_rng(settings.seed)

    def __call__(self, logits: np.ndarray) -> int:
        check_finite(logits)
        probs = self.probabilities(logits)
        return int(np.argmax(logits)) if probs is None else self.draw(probs)

    def probabilities(self, logits: np.ndarray) -> np.ndarray | None:
        """The distribution the next token is drawn from (temperature, top-k, top-p applied), float64; None where the
        choice is greedy (temperature 0, or so small that the largest logit overflows: its limit)."""
        s = self.settings
        if s.temperature == 0:
            return None
        z = logits.astype(np.float64)  # a copy, worked in place: each fresh array of a 49k vocabulary (400 KB) cost
        with np.errstate(over="ignore"):  # page faults, 4 of them 0.4 ms a token (halo-master serve: per request)
            z /= s.temperature
        top = z.max()
        if not np.isfinite(top):
            return None
        if 0 < s.top_k < len(z):
            z[z < np.partition(z, -s.top_k)[-s.top_k]] = -np.inf
        z -= top
        probs = np.exp(z, out=z)
        probs /= probs.sum()
        if s.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, s.top_p) + 1)]  # smallest set reaching top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[keep] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return probs

    def draw(self, probs: np.ndarray) -> int:
        """Inverse-CDF sampling with one uniform draw, as `rng.choice(len(probs), p=probs)` draws (the same token for the
        same seed but where u lies within rounding of a boundary), in two levels: the block of DRAW_BLOCK tokens whose
        running sum first passes u x total, then the token inside it. choice's cumulative sum over the whole
        vocabulary and its checks took 0.26 ms a token at SmolLM2's 49k (the draw alone; 0.34 ms with the probabilities):
        a batch of 16 requests spent 4 ms of each pass there (halo-master serve). Probabilities without a finite,
        positive total (which `probabilities` never makes: a NaN logit gives greedy) are refused, as choice refused
        them."""
        target = self.rng.random()
        sums = np.add.reduceat(probs, np.arange(0, len(probs), DRAW_BLOCK))
        running = np.cumsum(sums)
        if not (np.isfinite(running[-1]) and running[-1] > 0):
            raise ValueError(f"probabilities must be finite with a positive total, got a total of {running[-1]}")
        target *= running[-1]
        block = min(int(np.searchsorted(running, target, side="right")), len(running) - 1)
        while sums[block] <= 0:  # (target rounded to the total: the last block with mass)
            block -= 1
        first = block * DRAW_BLOCK
        inside = np.cumsum(probs[first:first + DRAW_BLOCK])
        i = int(np.searchsorted(inside, target - (running[block - 1] if block else 0.0), side="right"))
        if i >= len(inside):  # rounding past the block's end: its last token with mass
            i = int(np.flatnonzero(probs[first:first + DRAW_BLOCK])[-1])
        return first + i
