"""A pipeline stage in torch, for workers with a CUDA GPU (the `gpu` extra brings torch).

The same Llama arithmetic as halo/compute/neuron_groups.py (RMSNorm, rotate-half rotary, grouped-query
attention over a per-stage KV cache, SwiGLU) with all weights and the KV cache resident on the device.
Weights: fp32 for --weights fp32; fp16 for native and int8 (a GPU reads half of fp32's bytes a token,
and its tensor cores multiply fp16; 4/8-bit blocks are dequantized once, at load). Activations stay fp32.

A decode step (one position) runs `_step`: static shapes only (attention over the whole cache with the
positions past the current one masked, the position a device tensor), so on CUDA it is captured once in
a CUDA graph and replayed: one launch a token instead of ~15 a layer, where a small model's step is
launch-bound. Prefill (several positions) runs eagerly.

Results agree with the numpy engine to float rounding (different kernels; fp16 weights round each weight
to 11 bits), so greedy tokens are equal on the tests' models; bit-identical replay after a failure needs
the replacement stage on the same kind of engine.
"""

from __future__ import annotations

import math

import numpy as np

from halo.compute.linear import FORMATS
from halo.errors import ConfigError
from halo.model.ops import rope_inv_freq
from halo.model.quant import as_float32
from halo.model.weights import ModelWeights

from halo.pipeline.stage import HeadRequest, check_units, n_units, top_k

LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
NORMS = ("attn_norm", "mlp_norm")


class TorchStageEngine:
    def __init__(self, weights: ModelWeights, start: int, stop: int, max_seq_len: int, device: str = "cuda",
                 fmt: str = "fp32", graphs: bool = True):
        import torch

        c = self.config = weights.config
        check_units(c, start, stop)
        if fmt not in FORMATS:
            raise ConfigError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
        self.torch, self.device = torch, torch.device(device)
        self.matrix_dtype = torch.float32 if fmt == "fp32" else torch.float16
        self.weight_format = "fp32" if fmt == "fp32" else "fp16"  # what the planner prices this stage's memory at
        self.engine = f"torch-{self.device.type}" + ("" if fmt == "fp32" else "-fp16")
        self.start, self.stop, self.max_seq_len = start, stop, max_seq_len
        self.layers = list(range(max(0, start - 1), min(c.n_layers, stop - 1)))
        self.embedding = self._put(weights.tok_embeddings) if start == 0 else None
        self.weights = {l: {name: self._put(getattr(weights.layers[l], name), name not in NORMS) for name in LAYER_WEIGHTS}
                        for l in self.layers}
        self.has_head = stop == n_units(c)
        self.final_norm = self._put(weights.final_norm) if self.has_head else None
        self.lm_head = self._put(weights.lm_head, True) if self.has_head else None
        angles = np.outer(np.arange(max_seq_len, dtype=np.float64), rope_inv_freq(c))
        self.cos, self.sin = self._put(np.cos(angles)), self._put(np.sin(angles))
        shape = (c.n_kv_heads, max_seq_len, c.head_dim)
        self.cache_k = {l: torch.zeros(shape, device=self.device) for l in self.layers}
        self.cache_v = {l: torch.zeros(shape, device=self.device) for l in self.layers}
        # the decode step's static buffers: its input (a token id or a residual row), position and output
        self._token = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._x = torch.zeros(1, c.dim, device=self.device)
        self._pos = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._positions = torch.arange(max_seq_len, device=self.device)
        self._out = torch.zeros(1, c.vocab_size if self.has_head else c.dim, device=self.device)
        self.use_graph = graphs and self.device.type == "cuda"
        self._graph = None

    def _put(self, array, matrix: bool = False):
        """A writable copy on the device; matrices in the engine's matrix dtype (converted on the host: the
        device never holds an fp32 copy of an fp16 engine's weights)."""
        dtype = np.float16 if matrix and self.matrix_dtype == self.torch.float16 else np.float32
        return self.torch.from_numpy(np.array(as_float32(array), dtype=dtype)).to(self.device)

    @property
    def takes_tokens(self) -> bool:
        return self.embedding is not None

    # ---- the arithmetic ------------------------------------------------------------------------------------
    def _matmul(self, h, w):
        """h [T, in] (fp32) times w [out, in]^T, in w's dtype, back to fp32."""
        return (h.to(w.dtype) @ w.T).float()

    def _rmsnorm(self, x, weight):
        return x * self.torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + self.config.norm_eps) * weight

    def _rotate(self, x, cos, sin):
        """x [T, heads, hd] at the positions whose cos / sin [T, hd / 2] are given."""
        half = x.shape[-1] // 2
        cos, sin = cos[:, None, :], sin[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _qkv(self, l: int, h, cos, sin):
        c, w, T = self.config, self.weights[l], h.shape[0]
        q = self._rotate(self._matmul(h, w["wq"]).view(T, c.n_heads, c.head_dim), cos, sin)
        k = self._rotate(self._matmul(h, w["wk"]).view(T, c.n_kv_heads, c.head_dim), cos, sin)
        v = self._matmul(h, w["wv"]).view(T, c.n_kv_heads, c.head_dim)
        return q, k, v

    def _attend(self, l: int, q, end: int | None, mask):
        """q [T, H, hd] against the cache (its first `end` positions, or all with `mask` [T * r, S] hiding the
        rest) -> the output projection [T, D]."""
        torch, c = self.torch, self.config
        T, hd, r = q.shape[0], c.head_dim, c.n_heads // c.n_kv_heads
        keys, values = (self.cache_k[l], self.cache_v[l]) if end is None else \
            (self.cache_k[l][:, :end], self.cache_v[l][:, :end])
        q = q.view(T, c.n_kv_heads, r, hd).permute(1, 0, 2, 3).reshape(c.n_kv_heads, T * r, hd)
        scores = q @ keys.transpose(1, 2) / math.sqrt(hd)  # [KVH, T*r, S]
        if mask is not None:
            scores = scores.masked_fill(mask[None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values  # [KVH, T*r, hd]
        out = out.view(c.n_kv_heads, T, r, hd).permute(1, 0, 2, 3).reshape(T, c.n_heads * hd)
        return self._matmul(out, self.weights[l]["wo"])

    def _mlp(self, l: int, x):
        w = self.weights[l]
        h = self._rmsnorm(x, w["mlp_norm"])
        gate = self._matmul(h, w["w_gate"])
        return x + self._matmul(self.torch.nn.functional.silu(gate) * self._matmul(h, w["w_up"]), w["w_down"])

    def _layers_eager(self, x, start: int):
        """Positions start.. (any number) through this stage's layers."""
        torch, c = self.torch, self.config
        T, end = x.shape[0], start + x.shape[0]
        cos, sin = self.cos[start:end], self.sin[start:end]
        mask = None
        if T > 1:
            query_pos = (start + torch.arange(T, device=self.device)).repeat_interleave(c.n_heads // c.n_kv_heads)
            mask = torch.arange(end, device=self.device)[None, :] > query_pos[:, None]
        for l in self.layers:
            q, k, v = self._qkv(l, self._rmsnorm(x, self.weights[l]["attn_norm"]), cos, sin)
            self.cache_k[l][:, start:end] = k.transpose(0, 1)
            self.cache_v[l][:, start:end] = v.transpose(0, 1)
            x = self._mlp(l, x + self._attend(l, q, end, mask))
        return x

    def _step(self) -> None:
        """One decode position from the static buffers (_token or _x, _pos) into _out; static shapes and no
        host synchronization, so CUDA can capture it in a graph."""
        c = self.config
        x = self.embedding[self._token] if self.takes_tokens else self._x
        cos, sin = self.cos.index_select(0, self._pos), self.sin.index_select(0, self._pos)
        mask = (self._positions > self._pos)[None, :].expand(c.n_heads // c.n_kv_heads, -1)
        for l in self.layers:
            q, k, v = self._qkv(l, self._rmsnorm(x, self.weights[l]["attn_norm"]), cos, sin)
            self.cache_k[l].index_copy_(1, self._pos, k.transpose(0, 1))
            self.cache_v[l].index_copy_(1, self._pos, v.transpose(0, 1))
            x = self._mlp(l, x + self._attend(l, q, None, mask))
        self._out.copy_(self._head(x) if self.has_head else x)

    def _head(self, x):
        return self._matmul(self._rmsnorm(x, self.final_norm), self.lm_head)

    def _decode(self):
        """_step, through a CUDA graph captured at the first decode (warm-up runs compute the real step: the same
        values land in the cache again when the graph replays it)."""
        torch = self.torch
        if not self.use_graph:
            self._step()
            return self._out
        if self._graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step()
            torch.cuda.current_stream().wait_stream(side)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._step()
        self._graph.replay()
        return self._out

    # ---- the stage interface -------------------------------------------------------------------------------
    def forward(self, inputs: np.ndarray, start_pos: int, head: HeadRequest = HeadRequest()) -> list[np.ndarray]:
        torch, c = self.torch, self.config
        T = len(inputs)
        if T == 0 or start_pos < 0 or start_pos + T > self.max_seq_len:
            raise ConfigError(f"positions {start_pos}..{start_pos + T - 1} are outside the context "
                              f"of {self.max_seq_len} tokens")
        if self.takes_tokens:
            if inputs.ndim != 1 or inputs.min() < 0 or inputs.max() >= c.vocab_size:
                raise ConfigError(f"token ids must be a 1-D array within 0..{c.vocab_size - 1}")
        elif inputs.ndim != 2 or inputs.shape[1] != c.dim:
            raise ConfigError(f"the residual stream has shape {inputs.shape}, expected [T, {c.dim}]")
        with torch.inference_mode():
            if T == 1:
                self._pos.fill_(start_pos)
                if self.takes_tokens:
                    self._token.fill_(int(inputs[0]))
                else:
                    self._x.copy_(torch.from_numpy(np.ascontiguousarray(inputs, dtype=np.float32)))
                out = self._decode().cpu().numpy().copy()
                if not self.has_head:
                    return [out]
                logits = out
            else:
                if self.takes_tokens:
                    x = self.embedding[torch.from_numpy(np.asarray(inputs, dtype=np.int64)).to(self.device)]
                else:
                    x = torch.from_numpy(np.ascontiguousarray(inputs, dtype=np.float32)).to(self.device)
                x = self._layers_eager(x, start_pos)
                if not self.has_head:
                    return [x.cpu().numpy()]
                logits = self._head(x if head.all_positions else x[-1:]).cpu().numpy()
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
