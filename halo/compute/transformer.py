"""The single-process reference model: one device worker holding every neuron group.

It is the oracle the distributed runtime is tested against, and the engine on one device. Its
arithmetic is literally the runtime's: the same DeviceWorker and shards, holding every group.
"""

from __future__ import annotations

import numpy as np

from halo.compute.batch import Rows, check_slots, check_span, check_tokens
from halo.compute.linear import DenseProjection
from halo.compute.neuron_groups import GroupLayout
from halo.compute.shares import Block, everything, share_memory
from halo.compute.worker import DeviceWorker
from halo.errors import ConfigError
from halo.model.config import DEFAULT_CONTEXT
from halo.model.quant import embed
from halo.model.weights import ModelWeights

__all__ = ["DEFAULT_CONTEXT", "Transformer"]


def _check_fits(weights: ModelWeights, layout: GroupLayout, fmt: str, context: int, slots: int) -> None:
    """Refuse, with the numbers, a model this process has no memory for (under a cgroup limit: a device's systemd
    MemoryMax, a test bed's device), rather than be killed halfway through loading it."""
    from halo.host.memory import charged_bytes, memory_limit

    limit = memory_limit()
    if limit is None:
        return
    held, cache = share_memory(everything(weights.config, layout), layout, weights, fmt, context, slots)
    left = limit[0] - charged_bytes()  # (page cache the cgroup merely read through is reclaimed as needed)
    if held + cache > left:
        raise ConfigError(f"the model needs {(held + cache) / 1e6:.1f} MB (weights {held / 1e6:.1f} MB in {fmt}, KV cache "
                          f"{cache / 1e6:.1f} MB for {context} positions x {slots} slot(s)) but this process's memory cgroup leaves "
                          f"{left / 1e6:.1f} MB of its {limit[0] / 1e6:.1f} MB: run it across devices "
                          "(--agents, --cluster, --local-agents), or with a smaller --weights format, --context or --slots")


class Transformer:
    def __init__(self, weights: ModelWeights, fmt: str = "fp32", max_seq_len: int | None = None, threads: int = 1,
                 layout: GroupLayout | None = None, slots: int = 1):
        """slots: KV caches kept, one per sequence a batched pass (`forward_rows`) may carry."""
        c = self.config = weights.config
        self.max_seq_len = min(c.max_seq_len, max_seq_len or DEFAULT_CONTEXT)
        if self.max_seq_len <= 0:
            raise ConfigError(f"context length must be positive, got {self.max_seq_len}")
        self.layout = layout or GroupLayout.for_model(c)
        self.fmt = fmt
        self.weights = weights
        self.tok_embeddings = weights.tok_embeddings  # [V, D]; a lookup, never multiplied
        self.slots = check_slots(slots)
        _check_fits(weights, self.layout, fmt, self.max_seq_len, slots)
        self.worker = DeviceWorker(weights, self.layout, everything(c, self.layout), self.max_seq_len, fmt, threads,
                                   slots=slots)
        self.pos = 0  # tokens already in the KV cache

    def forward(self, tokens: list[int] | np.ndarray, start_pos: int | None = None, all_logits: bool = False) -> np.ndarray:
        """Run tokens at positions start_pos.. (default: right after the cache) -> logits of the last
        token [V] (or of all tokens [T, V])."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        start = self.pos if start_pos is None else start_pos
        check_span(start, len(tokens), self.max_seq_len)
        x = embed(self.tok_embeddings, tokens)  # [T, D]
        for i in range(self.config.n_layers):
            x = self.layer(i, x, start)
        self.pos = start + len(tokens)
        logits = self.worker.compute(Block("lm_head", self.config.n_layers), x if all_logits else x[-1:], start)
        return logits if all_logits else logits[0]

    def forward_rows(self, tokens: list[int] | np.ndarray, rows: Rows) -> np.ndarray:
        """A batched pass: tokens of several sequences, each in its KV-cache slot at its positions (halo/compute/batch.py) ->
        the logits of each sequence's last row [sequences, V], in row order."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        rows.check(len(tokens), self.max_seq_len, self.slots)
        x = embed(self.tok_embeddings, tokens)
        for i in range(self.config.n_layers):
            x = self.layer(i, x, rows)
        return self.worker.compute(Block("lm_head", self.config.n_layers), x[rows.last_rows], rows.last_only())

    def layer(self, i: int, x: np.ndarray, start: "int | Rows") -> np.ndarray:
        """Decoder layer i on the residual stream x [T, D] at positions start.."""
        x = x + self.worker.compute(Block("attention", i), x, start)
        return x + self.worker.compute(Block("mlp", i), x, start)

    def reset(self) -> None:
        self.pos = 0
        self.worker.reset()

    def weight_nbytes(self) -> int:
        w = self.weights
        norms = sum(n.nbytes for n in [*(l.attn_norm for l in w.layers), *(l.mlp_norm for l in w.layers), w.final_norm])
        total = self.worker.nbytes + norms + self.tok_embeddings.nbytes
        head = self.worker.lm_head.proj
        if isinstance(head, DenseProjection) and np.shares_memory(head.matrices[0], self.tok_embeddings):
            total -= head.nbytes  # tied head: the embedding table counted once
        return total

    def kv_cache_nbytes(self) -> int:
        return sum(s.cache_nbytes for s in self.worker.attention.values())
