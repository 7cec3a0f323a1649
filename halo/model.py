"""The single-process reference model: every neuron group in one shard per block.

It is the oracle the distributed runtime is tested against, and the engine on one device.
"""

from __future__ import annotations

import numpy as np

from .errors import ConfigError
from .linear import DenseProjection
from .neuron_groups import AttentionShard, GroupLayout, LmHeadShard, MlpShard
from .ops import Rotary, rmsnorm
from .weights import ModelWeights

DEFAULT_CONTEXT = 2048


class Transformer:
    def __init__(self, weights: ModelWeights, fmt: str = "fp32", max_seq_len: int | None = None, threads: int = 1,
                 layout: GroupLayout | None = None):
        c = self.config = weights.config
        self.max_seq_len = min(c.max_seq_len, max_seq_len or DEFAULT_CONTEXT)
        if self.max_seq_len <= 0:
            raise ConfigError(f"context length must be positive, got {self.max_seq_len}")
        self.layout = layout or GroupLayout.for_model(c)
        self.fmt = fmt
        self.tok_embeddings = weights.tok_embeddings  # [V, D]; a lookup, never multiplied
        self.rotary = Rotary(c, self.max_seq_len)
        L = self.layout
        self.attn_norms = [layer.attn_norm for layer in weights.layers]
        self.mlp_norms = [layer.mlp_norm for layer in weights.layers]
        self.attention = [AttentionShard(layer, L, range(L.n_attention_groups), self.max_seq_len, fmt, threads)
                          for layer in weights.layers]
        self.mlp = [MlpShard(layer, L, range(L.n_mlp_groups), fmt, threads) for layer in weights.layers]
        self.final_norm = weights.final_norm
        self.lm_head = LmHeadShard(weights.lm_head, L, range(L.n_vocab_groups), fmt, threads)
        self.pos = 0  # tokens already in the KV cache

    def forward(self, tokens: list[int] | np.ndarray, start_pos: int | None = None, all_logits: bool = False) -> np.ndarray:
        """Run tokens at positions start_pos.. (default: right after the cache) -> logits of the last
        token [V] (or of all tokens [T, V])."""
        tokens = np.asarray(tokens, dtype=np.int64)
        start = self.pos if start_pos is None else start_pos
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError("forward needs a non-empty 1-D sequence of token ids")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1}")
        if start + len(tokens) > self.max_seq_len:
            raise ValueError(f"{start + len(tokens)} positions exceed the context length {self.max_seq_len}")
        x = np.array(self.tok_embeddings[tokens], dtype=np.float32)  # [T, D]
        for i in range(self.config.n_layers):
            x = self.layer(i, x, start)
        self.pos = start + len(tokens)
        h = rmsnorm(x if all_logits else x[-1:], self.final_norm, self.config.norm_eps)
        logits = self.lm_head.forward(h)
        return logits if all_logits else logits[0]

    def layer(self, i: int, x: np.ndarray, start: int) -> np.ndarray:
        """Decoder layer i on the residual stream x [T, D] at positions start..."""
        eps = self.config.norm_eps
        x = x + self.attention[i].forward(rmsnorm(x, self.attn_norms[i], eps), start, self.rotary)
        return x + self.mlp[i].forward(rmsnorm(x, self.mlp_norms[i], eps))

    def reset(self) -> None:
        self.pos = 0
        for shard in self.attention:
            shard.reset()

    def weight_nbytes(self) -> int:
        shards = [*self.attention, *self.mlp, self.lm_head]
        norms = sum(n.nbytes for n in [*self.attn_norms, *self.mlp_norms, self.final_norm])
        total = sum(s.nbytes for s in shards) + norms + self.tok_embeddings.nbytes
        head = self.lm_head.proj
        if isinstance(head, DenseProjection) and np.shares_memory(head.matrices[0], self.tok_embeddings):
            total -= head.nbytes  # tied head: the embedding table counted once
        return total

    def kv_cache_nbytes(self) -> int:
        return sum(s.cache_nbytes for s in self.attention)
