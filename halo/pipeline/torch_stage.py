"""A pipeline stage in torch, for workers with a CUDA GPU (the `gpu` extra brings torch).

The same Llama arithmetic as halo/neuron_groups.py (RMSNorm, rotate-half rotary, grouped-query
attention over a per-stage KV cache, SwiGLU), in float32, with all weights resident on the device.
Results agree with the numpy engine to float32 rounding (different kernels), so greedy tokens are
equal; bit-identical replay after a failure needs the replacement stage on the same kind of engine.
"""

from __future__ import annotations

import math

import numpy as np

from halo.errors import ConfigError
from halo.ops import rope_inv_freq
from halo.weights import ModelWeights

from .stage import HeadRequest, check_units, n_units, top_k


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class TorchStageEngine:
    def __init__(self, weights: ModelWeights, start: int, stop: int, max_seq_len: int, device: str = "cuda"):
        import torch

        c = self.config = weights.config
        check_units(c, start, stop)
        self.torch, self.device = torch, torch.device(device)
        self.engine = f"torch-{self.device.type}"
        self.start, self.stop, self.max_seq_len = start, stop, max_seq_len
        put = lambda a: torch.from_numpy(np.array(a, dtype=np.float32)).to(self.device)  # a writable copy  # noqa: E731
        self.layers = list(range(max(0, start - 1), min(c.n_layers, stop - 1)))
        self.embedding = put(weights.tok_embeddings) if start == 0 else None
        self.weights = {l: {name: put(getattr(weights.layers[l], name)) for name in
                            ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")}
                        for l in self.layers}
        self.has_head = stop == n_units(c)
        self.final_norm = put(weights.final_norm) if self.has_head else None
        self.lm_head = put(weights.lm_head) if self.has_head else None
        angles = np.outer(np.arange(max_seq_len, dtype=np.float64), rope_inv_freq(c))
        self.cos, self.sin = put(np.cos(angles)), put(np.sin(angles))
        shape = (c.n_kv_heads, max_seq_len, c.head_dim)
        self.cache_k = {l: torch.zeros(shape, device=self.device) for l in self.layers}
        self.cache_v = {l: torch.zeros(shape, device=self.device) for l in self.layers}

    @property
    def takes_tokens(self) -> bool:
        return self.embedding is not None

    def _rmsnorm(self, x, weight):
        return x * self.torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + self.config.norm_eps) * weight

    def _rotate(self, x, start: int):
        T, half = x.shape[0], x.shape[-1] // 2
        cos, sin = self.cos[start:start + T, None, :], self.sin[start:start + T, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _attention(self, l: int, h, start: int):
        torch, c, w = self.torch, self.config, self.weights[l]
        T, hd, end = h.shape[0], c.head_dim, start + h.shape[0]
        q = self._rotate((h @ w["wq"].T).view(T, c.n_heads, hd), start)
        k = self._rotate((h @ w["wk"].T).view(T, c.n_kv_heads, hd), start)
        self.cache_k[l][:, start:end] = k.transpose(0, 1)
        self.cache_v[l][:, start:end] = (h @ w["wv"].T).view(T, c.n_kv_heads, hd).transpose(0, 1)
        r = c.n_heads // c.n_kv_heads
        q = q.view(T, c.n_kv_heads, r, hd).permute(1, 0, 2, 3).reshape(c.n_kv_heads, T * r, hd)
        scores = q @ self.cache_k[l][:, :end].transpose(1, 2) / math.sqrt(hd)  # [KVH, T*r, S]
        if T > 1:
            query_pos = (start + torch.arange(T, device=self.device)).repeat_interleave(r)
            mask = torch.arange(end, device=self.device)[None, :] > query_pos[:, None]
            scores = scores.masked_fill(mask[None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ self.cache_v[l][:, :end]  # [KVH, T*r, hd]
        out = out.view(c.n_kv_heads, T, r, hd).permute(1, 0, 2, 3).reshape(T, c.n_heads * hd)
        return out @ w["wo"].T

    def forward(self, inputs: np.ndarray, start_pos: int, head: HeadRequest = HeadRequest()) -> list[np.ndarray]:
        torch, c = self.torch, self.config
        T = len(inputs)
        if T == 0 or start_pos < 0 or start_pos + T > self.max_seq_len:
            raise ConfigError(f"positions {start_pos}..{start_pos + T - 1} are outside the context "
                              f"of {self.max_seq_len} tokens")
        with torch.inference_mode():
            if self.takes_tokens:
                if inputs.ndim != 1 or inputs.min() < 0 or inputs.max() >= c.vocab_size:
                    raise ConfigError(f"token ids must be a 1-D array within 0..{c.vocab_size - 1}")
                x = self.embedding[torch.from_numpy(np.asarray(inputs, dtype=np.int64)).to(self.device)]
            else:
                if inputs.ndim != 2 or inputs.shape[1] != c.dim:
                    raise ConfigError(f"the residual stream has shape {inputs.shape}, expected [T, {c.dim}]")
                x = torch.from_numpy(np.ascontiguousarray(inputs, dtype=np.float32)).to(self.device)
            for l in self.layers:
                w = self.weights[l]
                x = x + self._attention(l, self._rmsnorm(x, w["attn_norm"]), start_pos)
                h = self._rmsnorm(x, w["mlp_norm"])
                gate = h @ w["w_gate"].T
                x = x + (torch.nn.functional.silu(gate) * (h @ w["w_up"].T)) @ w["w_down"].T
            if not self.has_head:
                return [x.cpu().numpy()]
            h = self._rmsnorm(x if head.all_positions else x[-1:], self.final_norm)
            logits = (h @ self.lm_head.T).cpu().numpy()
        if head.all_positions or head.top_k == 0:
            return [logits]
        return list(top_k(logits[-1], head.top_k))

    def reset(self) -> None:
        for l in self.layers:
            self.cache_k[l].zero_()
            self.cache_v[l].zero_()

    @property
    def weight_nbytes(self) -> int:
        tensors = [t for w in self.weights.values() for t in w.values()]
        tensors += [t for t in (self.embedding, self.final_norm, self.lm_head) if t is not None]
        return int(sum(t.numel() * t.element_size() for t in tensors))
