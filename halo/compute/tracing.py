"""The reference model computed group by group, for research: what the predictors learn from, and the
relaxed-merge simulations of the accuracy studies. Never used by the runtime.

`TracingTransformer` records, per layer, the residual stream entering it and the L2 norm of every
group's contribution (exactly what dropping that group removes from the block output), and lets a
`merge(layer, kind, contributions [T, G, D], hidden_in [T, D]) -> [T, D]` hook decide what each block's
output is made of (None: the plain sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from halo.compute.transformer import Transformer
from halo.model.ops import rmsnorm


@dataclass
class LayerTrace:
    hidden: np.ndarray  # [T, D] residual stream entering the layer
    attention_norms: np.ndarray  # [T, H] L2 norm of each head's contribution
    mlp_norms: np.ndarray  # [T, G] L2 norm of each MLP group's contribution


class TracingTransformer(Transformer):
    def __init__(self, weights, merge=None, **kwargs):
        super().__init__(weights, fmt="fp32", **kwargs)  # per-group outputs need the float32 weights
        self.merge = merge
        self.trace: list[LayerTrace] = []  # of the last forward pass

    def forward(self, tokens, start_pos: int | None = None, all_logits: bool = False) -> np.ndarray:
        self.trace = []
        return super().forward(tokens, start_pos, all_logits)

    def layer(self, i: int, x: np.ndarray, start: int) -> np.ndarray:
        eps, layer_input, w = self.config.norm_eps, x, self.worker
        heads = w.attention[i].forward_groups(rmsnorm(x, self.weights.layers[i].attn_norm, eps), start, w.rotary)
        x = x + self._block_output(i, "attention", heads, layer_input)
        groups = w.mlp[i].forward_groups(rmsnorm(x, self.weights.layers[i].mlp_norm, eps))
        x = x + self._block_output(i, "mlp", groups, layer_input)
        self.trace.append(LayerTrace(layer_input, np.linalg.norm(heads, axis=-1), np.linalg.norm(groups, axis=-1)))
        return x

    def _block_output(self, layer: int, kind: str, contributions: np.ndarray, layer_input: np.ndarray) -> np.ndarray:
        if self.merge is None:
            return contributions.sum(axis=1)
        return self.merge(layer, kind, contributions, layer_input)
