"""One device's share of a model: its shards, the partial outputs of blocks, and the next layer's ranking.

The master and every agent each run one `DeviceWorker` (the master is a worker plus a coordinator).
A worker is built from the device's `Shares`: an AttentionShard (with its KV cache) per layer where it
holds heads, an MlpShard per layer where it holds MLP groups, an LmHeadShard for its vocabulary
slice. In HALO mode its MLP share is a rank range per layer and the `Remapper` picks the groups per
token from the predictors' ranking, which the worker computes one layer ahead from the residual
stream entering the attention block (`predict_next`).

Every block's input is the residual stream; the worker applies the block's RMSNorm itself (the
predictors read the un-normed residual, so the residual is what travels).
"""

from __future__ import annotations

import time

import numpy as np

from .neuron_groups import AttentionShard, GroupLayout, LmHeadShard, MlpShard
from .ops import Rotary, rmsnorm
from .shares import Block, Shares, rank_range
from .weights import ModelWeights


class DeviceWorker:
    def __init__(self, weights: ModelWeights, layout: GroupLayout, share: Shares, context: int, fmt: str = "fp32",
                 threads: int = 1, remap: bool = False, predictors=None, load_overlap: bool = True):
        """remap: HALO mode (MLP shares are rank ranges re-mapped per token; `predictors` ranks them, None:
        the identity ranking)."""
        c = self.config = weights.config
        self.weights, self.layout, self.share = weights, layout, share
        self.rotary = Rotary(c, context)
        self.attention = {l: AttentionShard(weights.layers[l], layout, heads, context, fmt, threads)
                          for l, heads in enumerate(share.attention) if heads}
        self.mlp: dict[int, MlpShard] = {}
        self.remapper = None
        if remap:
            from .remap import Remapper

            ranges = {l: rank_range(g) for l, g in enumerate(share.mlp) if g}  # ConfigError if not ranks
            self.remapper = Remapper(weights, layout, ranges, predictors, load_overlap, fmt, threads)
        else:
            self.mlp = {l: MlpShard(weights.layers[l], layout, g, fmt, threads) for l, g in enumerate(share.mlp) if g}
        self.lm_head = LmHeadShard(weights.lm_head, layout, share.lm_head, fmt, threads) if share.lm_head else None
        self.compute_ms = 0.0  # wall clock, every compute call
        self.cpu_ms = 0.0  # the same in this thread's CPU time: what it costs without other processes on the cores
        self.last_compute_ms = 0.0

    def holds(self, block: Block) -> bool:
        return self.share.holds(block)

    def begin_forward(self) -> None:
        """A new forward pass: rankings of the previous one must not be reused."""
        if self.remapper is not None:
            self.remapper.begin()

    def compute(self, block: Block, x: np.ndarray, start: int) -> np.ndarray:
        """This device's partial output of a block for the residual stream x [T, D] at positions start..:
        [T, D] (attention, MLP) or [T, its vocabulary slice] (LM head)."""
        t, cpu = time.perf_counter(), time.thread_time()
        w, eps = self.weights, self.config.norm_eps
        if block.kind == "attention":
            out = self.attention[block.layer].forward(rmsnorm(x, w.layers[block.layer].attn_norm, eps), start,
                                                      self.rotary)
        elif block.kind == "mlp":
            h = rmsnorm(x, w.layers[block.layer].mlp_norm, eps)
            out = self.remapper.mlp_partial(block.layer, h) if self.remapper else self.mlp[block.layer].forward(h)
        else:
            out = self.lm_head.forward(rmsnorm(x, w.final_norm, eps))
        self.last_compute_ms = 1e3 * (time.perf_counter() - t)
        self.compute_ms += self.last_compute_ms
        self.cpu_ms += 1e3 * (time.thread_time() - cpu)
        return out

    def predicts_from(self, block: Block) -> bool:
        """Whether this device ranks the next layer's groups from this block's input (HALO: it holds MLP
        ranks of the next layer)."""
        return (self.remapper is not None and block.kind == "attention"
                and bool(self.share.mlp[block.layer + 1] if block.layer + 1 < self.config.n_layers else False))

    def predict_next(self, block: Block, x: np.ndarray) -> None:
        """HALO: rank layer l+1's groups from the residual entering layer l's attention block, start loading ours."""
        if self.remapper is not None and block.kind == "attention":
            self.remapper.predict(block.layer + 1, x)

    def digest(self, layer: int) -> int:
        """24-bit digest of the MLP ranking this device computed for a layer (0: static groups)."""
        return self.remapper.digest(layer) if self.remapper is not None else 0

    def reset(self) -> None:
        for shard in self.attention.values():
            shard.reset()

    @property
    def nbytes(self) -> int:
        shards = [*self.attention.values(), *self.mlp.values()] + ([self.lm_head] if self.lm_head else [])
        total = sum(s.nbytes for s in shards)
        if self.remapper is not None:  # every candidate MLP group of its layers (any may be re-mapped here)
            total += sum(bank.nbytes for bank in self.remapper.banks.values())
        return total

    def close(self) -> None:
        if self.remapper is not None:
            self.remapper.close()
