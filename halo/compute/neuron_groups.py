"""Neuron groups: the unit of work that halo distributes, and the partial outputs they produce.

Every block of a Llama layer is a sum over independent neuron groups:

- attention: one group per query head h, holding its rows of W_q and its columns of W_o. The head
  needs K/V of KV head `h // (n_heads / n_kv_heads)`. Decision: every device computes (and
  caches) the K/V projections of each KV head that one of its query heads uses. K/V projections
  are small (n_kv_heads * head_dim rows), so duplicating them where a KV head's query heads are
  split across devices costs little compute and saves a synchronization round per layer; each
  device's KV cache then holds exactly what its own heads read.
- MLP: groups of `mlp_group_size` intermediate neurons (rows of W_gate and W_up, columns of
  W_down); 256 by default as in HALO; the last group holds the remainder when the size does not
  divide the intermediate size.
- LM head: groups of `vocab_group_size` vocabulary rows; a group's output is its logits slice.

A *shard* is one device's set of groups of one block. Its `forward` returns the block's
partial output; the sum over shards of a partition equals the whole block's output. The
single-process reference model is built from shards holding every group, so the reference and
the distributed runtime run the same arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from halo.compute.backends import block_backend, c_weights
from halo.compute.block_graph import AttentionGraph, MlpGraph
from halo.compute.group_cache import GroupCache
from halo.compute.linear import (DenseProjection, DequantKernel, KernelProjection, _nbits, int8_block_for,
                                 make_projection)
from halo.errors import ConfigError
from halo.host.memory import BufferPool, load_pages, own_pages, zeros_by_page
from halo.model.config import ModelConfig
from halo.model.ops import Rotary, rmsnorm, silu, softmax
from halo.model.quant import QuantizedMatrix, Weight, as_float32
from halo.model.weights import LayerWeights

DEFAULT_MLP_GROUP_SIZE = 256
DEFAULT_VOCAB_GROUP_SIZE = 256


def default_mlp_group_size(hidden_dim: int) -> int:
    """HALO's 256 neurons per group, or hidden/8 when that would leave fewer than 8 groups (tiny models)."""
    return min(DEFAULT_MLP_GROUP_SIZE, math.ceil(hidden_dim / 8))


@dataclass(frozen=True)
class GroupLayout:
    """How a model's blocks divide into neuron groups."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    mlp_group_size: int = DEFAULT_MLP_GROUP_SIZE
    vocab_group_size: int = DEFAULT_VOCAB_GROUP_SIZE

    @classmethod
    def for_model(cls, config: ModelConfig, mlp_group_size: int | None = None,
                  vocab_group_size: int = DEFAULT_VOCAB_GROUP_SIZE) -> "GroupLayout":
        """mlp_group_size None: 256 (HALO's size), or hidden/8 for models too small to give 8 groups of 256."""
        if mlp_group_size is None:
            mlp_group_size = default_mlp_group_size(config.hidden_dim)
        if mlp_group_size <= 0 or vocab_group_size <= 0:
            raise ValueError("group sizes must be positive")
        return cls(config.n_heads, config.n_kv_heads, config.head_dim, config.hidden_dim, config.vocab_size,
                   mlp_group_size, vocab_group_size)

    @property
    def n_attention_groups(self) -> int:
        return self.n_heads

    @property
    def n_mlp_groups(self) -> int:
        return math.ceil(self.hidden_dim / self.mlp_group_size)

    @property
    def n_vocab_groups(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_group_size)

    def kv_head(self, head: int) -> int:
        return head // (self.n_heads // self.n_kv_heads)

    def mlp_neurons(self, group: int) -> range:
        return range(group * self.mlp_group_size, min((group + 1) * self.mlp_group_size, self.hidden_dim))

    def vocab_rows(self, group: int) -> range:
        return range(group * self.vocab_group_size, min((group + 1) * self.vocab_group_size, self.vocab_size))

    def vocab_ids(self, groups) -> np.ndarray:
        """The token ids of vocabulary groups, in the groups' order: the columns of their LM-head logits."""
        return np.concatenate([np.arange(r.start, r.stop) for r in map(self.vocab_rows, groups)])


def _check_groups(groups: Sequence[int], total: int, kind: str) -> tuple[int, ...]:
    groups = tuple(int(g) for g in groups)
    if not groups:
        raise ValueError(f"a {kind} shard needs at least one group")
    if len(set(groups)) != len(groups) or min(groups) < 0 or max(groups) >= total:
        raise ValueError(f"{kind} groups {groups} must be distinct and within 0..{total - 1}")
    return groups


def take_rows(w: Weight, rows: np.ndarray) -> Weight:
    """Rows of w: a view when they are one contiguous run (no copy of a memory-mapped model); compact
    weights select rows lazily (whole quantized rows, free)."""
    if isinstance(w, QuantizedMatrix):
        return w.take_rows(rows)
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows) and np.all(np.diff(rows) == 1):
        return w[rows[0]:rows[-1] + 1]
    return np.ascontiguousarray(w[rows])


def take_cols(w: Weight, cols: np.ndarray, fmt: str = "fp32") -> Weight:
    """Columns of w as a contiguous copy (all of them: the array itself). A strided view would make every
    token read the whole matrix from memory and BLAS fall back to slow paths.

    Compact weights in the native format are cut along whole quantization blocks; a neuron group boundary
    that splits a block is refused (ConfigError naming the tensor): dequantizing just that slice would make
    the shard's arithmetic differ from the whole matrix's. Every real layout is aligned (head_dim 64 = 2
    blocks of 32, MLP groups of 192/256 = 6/8 blocks). In the fp32/int8 formats they are dequantized
    (only the blocks the columns touch)."""
    if len(cols) == w.shape[1] and np.all(cols == np.arange(w.shape[1])):
        return w
    if isinstance(w, QuantizedMatrix):
        return w.take_cols(cols) if fmt == "native" else w.columns_float32(cols)
    return np.ascontiguousarray(w[:, cols])


QUERY_CHUNK = 64  # query positions a prefill attends at once (causal_attention)


def causal_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start_pos: int) -> np.ndarray:
    """Softmax attention of queries at positions start_pos.. over the cached keys/values up to each one's position.
    q [G, T, r, hd] (r query heads per KV head of G), keys [G, hd, >= start_pos + T], values [G, >= start_pos + T, hd]
    -> [G, T, r, hd]. QUERY_CHUNK queries at a time, each chunk scoring only the keys up to its last position: a
    long prompt's scores never exist whole (a 1,024-token TinyLlama prompt's were 134 MB a layer, every softmax
    step a pass over them) and the keys past a chunk are not scored only to be masked."""
    G, T, r, hd = q.shape
    scale = np.float32(1.0 / math.sqrt(hd))
    out = np.empty(q.shape, dtype=np.float32)
    for c0 in range(0, T, QUERY_CHUNK):
        c1 = min(T, c0 + QUERY_CHUNK)
        seen = start_pos + c1  # keys the chunk's last query sees
        scores = np.matmul(q[:, c0:c1].reshape(G, (c1 - c0) * r, hd), keys[:, :, :seen])  # [G, rows, seen]
        scores = scores.reshape(G, c1 - c0, r, seen)
        scores *= scale
        if c1 - c0 > 1:  # query t sees keys 0..start_pos + t: mask the later ones within the chunk
            later = np.arange(seen)[None, :] > (start_pos + np.arange(c0, c1))[:, None]  # [chunk, seen]
            np.copyto(scores, np.float32(-np.inf), where=later[None, :, None, :])
        softmax(scores, out=scores)
        out[:, c0:c1] = np.matmul(scores.reshape(G, (c1 - c0) * r, seen), values[:, :seen]).reshape(G, c1 - c0, r, hd)
    return out


class AttentionShard:
    """A set of query heads of one layer, with the K/V heads they read and their KV cache."""

    def __init__(self, layer: LayerWeights, layout: GroupLayout, heads: Sequence[int], max_seq_len: int,
                 fmt: str = "fp32", threads: int = 1, slots: int = 1):
        """slots: KV caches kept, one per sequence a batched pass may carry (halo/compute/batch.py)."""
        self.heads = _check_groups(heads, layout.n_heads, "attention")
        self.kv_heads = tuple(sorted({layout.kv_head(h) for h in self.heads}))
        hd = self.head_dim = layout.head_dim
        q_rows = np.concatenate([np.arange(h * hd, (h + 1) * hd) for h in self.heads])
        kv_rows = np.concatenate([np.arange(k * hd, (k + 1) * hd) for k in self.kv_heads])
        self.qkv = make_projection([take_rows(layer.wq, q_rows), take_rows(layer.wk, kv_rows),
                                    take_rows(layer.wv, kv_rows)], fmt, threads, open_session=False)
        self.out = make_projection([take_cols(layer.wo, q_rows, fmt)], fmt, threads, int8_block_for(hd),
                                   open_session=False)
        self._wo_dense = self.out.matrices[0] if isinstance(self.out, DenseProjection) else None
        # local query heads grouped by the local KV head they read
        local_kv = {k: i for i, k in enumerate(self.kv_heads)}
        self.heads_of_kv = [[i for i, h in enumerate(self.heads) if local_kv[layout.kv_head(h)] == j]
                            for j in range(len(self.kv_heads))]
        kv_of_head = [local_kv[layout.kv_head(h)] for h in self.heads]
        # every local KV head read by the same number of consecutive local query heads (a whole model's layout, and
        # most shares): attention runs as one batched product over the KV heads instead of a loop
        r = len(self.heads_of_kv[0])
        self.kv_batched = all(heads == list(range(j * r, (j + 1) * r)) for j, heads in enumerate(self.heads_of_kv))
        self.backend = block_backend(self.qkv, self.out)  # halo/compute/backends.py
        self.graph = (AttentionGraph(self.qkv, self.out, kv_of_head, hd, len(self.kv_heads), threads)
                      if self.backend == "onnx-graph" else None)
        self.threads = threads
        self.kv_of_head = np.array(kv_of_head, np.int32)  # the decode step's: local KV head of each local query head
        self.step_weights = c_weights(self.qkv, self.out) if self.backend == "c-step" else None  # (qkv, out): `step`
        # [slots, positions, local KV heads, hd]: a slot's cache of positions 0..P-1 is one contiguous block (the graph's
        # input); memory follows the positions written, page by page
        self.cache_k = zeros_by_page((slots, max_seq_len, len(self.kv_heads), hd))
        self.cache_v = zeros_by_page(self.cache_k.shape)

    def forward(self, x: np.ndarray, start_pos: int, rotary: Rotary, slot: int = 0, with_norms: bool = False):
        """x: [T, D] normed input at positions start_pos.. of the sequence in KV-cache `slot` -> partial output [T, D]
        (and head norms [T, H])."""
        if with_norms:
            return sum_and_norms(self.forward_groups(x, start_pos, rotary, slot))
        if self.graph is not None:
            return self._run_graph(x, start_pos, rotary, slot)
        return self.out(self._attend(x, start_pos, rotary, slot))[0]

    @property
    def fused(self) -> bool:
        """Whether a token runs through `step` (backend "c-step": halo's C kernel holds both projections)."""
        return self.backend == "c-step"

    def step(self, x: np.ndarray, norm: np.ndarray, eps: float, start_pos: int, rotary: Rotary, slot: int = 0) -> np.ndarray:
        """T positions' residual stream x [T, D] through the block in one C call (RMSNorm by `norm`, q/k/v, rotary, the
        cache of `slot` written at start_pos.., attention, W_o) -> partial output [T, D]; as `forward` of the normed x,
        each position with the bits of a call of its own."""
        qkv, out = self.step_weights
        y = np.empty((len(x), out[1]), np.float32)
        _nbits.attention_step(x, norm, eps, qkv, out, rotary.cos, rotary.sin, self.cache_k[slot], self.cache_v[slot], start_pos,
                              self.kv_of_head, y, self.threads)
        return y

    def write_kv(self, x: np.ndarray, norm: np.ndarray, eps: float, start_pos: int, rotary: Rotary) -> None:
        """The keys and values `step` writes for positions start_pos.. (the same bits), without attending: a cache
        filled from a history costs its projections, not its attention."""
        qkv, out = self.step_weights
        _nbits.attention_step(x, norm, eps, qkv, out, rotary.cos, rotary.sin, self.cache_k[0], self.cache_v[0], start_pos,
                              self.kv_of_head, np.empty((len(x), out[1]), np.float32), self.threads, attend=False)

    def step_rows(self, x: np.ndarray, norm: np.ndarray, eps: float, rows: np.ndarray, rotary: Rotary) -> np.ndarray:
        """`step` for a batched pass: row t of x at position rows[t, 1] of slot rows[t, 0] (int32 [T, 2]), every row with
        the bits of a step of its own, each weight read once for all of them."""
        qkv, out = self.step_weights
        y = np.empty((len(x), out[1]), np.float32)
        _nbits.attention_step(x, norm, eps, qkv, out, rotary.cos, rotary.sin, self.cache_k, self.cache_v, 0,
                              self.kv_of_head, y, self.threads, rows)
        return y

    def forward_groups(self, x: np.ndarray, start_pos: int, rotary: Rotary, slot: int = 0) -> np.ndarray:
        """Each head's contribution to the block output, [T, H, D] (for relaxed merging)."""
        if self._wo_dense is None:
            raise ValueError("per-group outputs need the fp32 weight format")
        hd = self.head_dim
        return grouped_output(self._attend(x, start_pos, rotary, slot), self._wo_dense,
                              [slice(i * hd, (i + 1) * hd) for i in range(len(self.heads))])

    def _run_graph(self, x: np.ndarray, start_pos: int, rotary: Rotary, slot: int = 0) -> np.ndarray:
        """The compact formats' path: the whole block in one graph call; the new K/V go to the cache."""
        end = self._check_end(start_pos + len(x))
        cache_k, cache_v = self.cache_k[slot], self.cache_v[slot]
        cos, sin = rotary.cos[start_pos:end, None, :], rotary.sin[start_pos:end, None, :]
        y, k, v = self.graph(np.ascontiguousarray(x, dtype=np.float32), cos, sin, cache_k[:start_pos],
                             cache_v[:start_pos], start_pos)
        cache_k[start_pos:end], cache_v[start_pos:end] = k, v
        return y

    def _check_end(self, end: int) -> int:
        if end > self.cache_k.shape[1]:
            raise ValueError(f"position {end - 1} is beyond the context length {self.cache_k.shape[1]}")
        return end

    def _attend(self, x: np.ndarray, start_pos: int, rotary: Rotary, slot: int = 0) -> np.ndarray:
        """Project, rotate, cache K/V, attend: [T, D] -> the heads' outputs [T, H * hd] before W_o."""
        T, hd = x.shape[0], self.head_dim
        q = self._project(x, start_pos, rotary, slot)
        cache_k, cache_v = self.cache_k[slot], self.cache_v[slot]
        if self.kv_batched:  # the query heads of each KV head as one product (the same per KV head as below)
            kv, r = len(self.kv_heads), len(self.heads_of_kv[0])
            qj = q.reshape(T, kv, r, hd).transpose(1, 0, 2, 3)  # [kv, T, r, hd]
            keys, values = cache_k.transpose(1, 2, 0), cache_v.transpose(1, 0, 2)  # [kv, hd, S], [kv, S, hd]
            out = causal_attention(qj, keys, values, start_pos)  # [kv, T, r, hd]
            return out.transpose(1, 0, 2, 3).reshape(T, -1)
        attended = np.empty((T, len(self.heads), hd), dtype=np.float32)
        for j, local_heads in enumerate(self.heads_of_kv):
            qj = q[:, local_heads, :][None]  # [1, T, r, hd]
            out = causal_attention(qj, cache_k[None, :, j].transpose(0, 2, 1), cache_v[None, :, j], start_pos)
            attended[:, local_heads, :] = out[0]
        return attended.reshape(T, -1)

    def fill(self, x: np.ndarray, start_pos: int, rotary: Rotary) -> None:
        """Write the K/V of positions start_pos.. from their normed inputs without attending: a new session's
        cache filled from the inputs the master recorded, instead of replaying the history through every block
        (the graph path attends too, and its output is dropped: fills are rare, the graph is the one kernel)."""
        if self.graph is not None:
            self._run_graph(x, start_pos, rotary)
        else:
            self._project(x, start_pos, rotary)

    def _project(self, x: np.ndarray, start_pos: int, rotary: Rotary, slot: int = 0) -> np.ndarray:
        """Project, rotate, write K/V to the slot's cache at start_pos..: the rotated queries [T, H, hd]."""
        T, hd = x.shape[0], self.head_dim
        end = self._check_end(start_pos + T)
        q, k, v = self.qkv(x)
        self.cache_k[slot, start_pos:end] = rotary.apply(k.reshape(T, -1, hd), start_pos)
        self.cache_v[slot, start_pos:end] = v.reshape(T, -1, hd)
        return rotary.apply(q.reshape(T, len(self.heads), hd), start_pos)

    def reset(self) -> None:
        """Forget every position. Fresh zero arrays rather than zeroing these: a reset does not make the whole
        context's cache resident (94 MB for SmolLM2 at 2048), and the old pages go back at once."""
        self.cache_k = zeros_by_page(self.cache_k.shape)
        self.cache_v = zeros_by_page(self.cache_v.shape)

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.out.nbytes

    @property
    def cache_nbytes(self) -> int:
        return self.cache_k.nbytes + self.cache_v.nbytes


def grouped_output(act: np.ndarray, w_out: np.ndarray, slices: list[slice]) -> np.ndarray:
    """Per-group contributions W_out[:, g] @ act[g] -> [T, G, D]; their sum over G is the partial output.

    The L2 norm of a group's contribution is exactly what dropping that group removes from the block
    output: the importance signal the predictors learn.
    """
    out = np.empty((act.shape[0], len(slices), w_out.shape[0]), dtype=np.float32)
    for i, s in enumerate(slices):
        out[:, i] = act[:, s] @ w_out[:, s].T
    return out


def sum_and_norms(contributions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[T, G, D] contributions -> (partial output [T, D], group norms [T, G])."""
    return contributions.sum(axis=1), np.linalg.norm(contributions, axis=-1)


def mlp_projections(layer: LayerWeights, layout: GroupLayout, groups: Sequence[int], fmt: str, threads: int = 1):
    """The two projections of some MLP groups (W_gate and W_up rows fused; W_down columns), sessions not opened.
    W_down's int8 blocks are cut within groups (int8_block_for), as W_o's within heads: blocks of 128 over a share's
    columns straddled groups differently in each share, so three devices' int8 MLP was not one device's."""
    neurons = np.concatenate([np.arange(r.start, r.stop) for r in map(layout.mlp_neurons, groups)])
    gate_up = make_projection([take_rows(layer.w_gate, neurons), take_rows(layer.w_up, neurons)], fmt, threads,
                              open_session=False)
    return gate_up, make_projection([take_cols(layer.w_down, neurons, fmt)], fmt, threads,
                                    int8_block_for(layout.mlp_group_size), open_session=False)


def mlp_group_kernels(layer: LayerWeights, layout: GroupLayout, group: int, fmt: str):
    """One MLP group's two kernel projections (gate+up rows, down columns), sessions not opened; refused where a
    projection is not one compact kernel (float32 or mixed-type tensors): prepared and compact groups need one."""
    gate_up, down = mlp_projections(layer, layout, [group], fmt)
    for p in (gate_up, down):
        if not isinstance(p, KernelProjection) or len(p.kernels) != 1:
            raise ConfigError(f"--weights {fmt}: an MLP group is not one compact kernel here (a float32 or mixed-type "
                              "tensor); prepared and compact groups need int8 or a GGUF's 4/8-bit blocks")
    return gate_up, down


class CompactMlpGroup:
    """One MLP group held as its kernels' compact arrays and computed from them (linear.DequantKernel): how a
    memory-bounded device keeps HALO's re-mapped groups. It costs its compact bytes in memory (an onnxruntime
    session per group: 2-3x) and nothing to make from them (a session: ~10 ms), so a group the ranking moves onto
    the device is one read away."""

    def __init__(self, gate_up: DequantKernel, down: DequantKernel):
        if gate_up.n % 2 or down.k != gate_up.n // 2:
            raise ValueError(f"gate+up rows {gate_up.n} do not feed W_down's {down.k} columns")
        self.gate_up, self.down = gate_up, down
        self.nbytes = gate_up.nbytes + down.nbytes
        # a decode step computes the device's groups in one C call (MlpGroupBank.forward), as held kernels are: called
        # group by group from Python, a bounded SmolLM2 agent computed its share 1.5x slower with every group held
        fused = _nbits is not None and not (gate_up.padded or down.padded)
        self.step_weights = (gate_up.c_weight, down.c_weight) if fused else None

    @classmethod
    def build(cls, layer: LayerWeights, layout: GroupLayout, group: int, fmt: str,
              buffers: BufferPool | None = None) -> "CompactMlpGroup":
        """From the model file (gathered and restated in kernel terms, as a session's kernels would be), into one
        buffer (from `buffers`, back to it when the group is garbage)."""
        kernels = [p.kernels[0] for p in mlp_group_kernels(layer, layout, group, fmt)]
        dtypes = [DequantKernel.scale_dtype_for(k) for k in kernels]
        sizes = [DequantKernel.nbytes_for(k, dtype) for k, dtype in zip(kernels, dtypes)]
        buffer = own_pages(sum(sizes)) if buffers is None else buffers.take(sum(sizes))
        made = cls(DequantKernel.copy_of(kernels[0], buffer[:sizes[0]], dtypes[0]),
                   DequantKernel.copy_of(kernels[1], buffer[sizes[0]:sum(sizes)], dtypes[1]))
        if buffers is not None:
            buffers.return_with(made, buffer)
        return made

    def forward(self, x: np.ndarray) -> np.ndarray:
        """x: [T, D] normed input -> this group's contribution [T, D]."""
        gate_up, n = self.gate_up(x), self.down.k
        return self.down(silu(gate_up[:, :n]) * gate_up[:, n:])


class MlpShard:
    """A set of MLP neuron groups of one layer: SwiGLU over its neurons, then its W_down columns."""

    def __init__(self, layer: LayerWeights, layout: GroupLayout, groups: Sequence[int], fmt: str = "fp32",
                 threads: int = 1):
        groups = _check_groups(groups, layout.n_mlp_groups, "MLP")
        self._assemble(layout, groups, *mlp_projections(layer, layout, groups, fmt, threads), threads)

    @classmethod
    def from_projections(cls, layout: GroupLayout, groups: Sequence[int], gate_up, down, threads: int = 1) -> "MlpShard":
        """A shard from its two projections made elsewhere (a prepared group's kernels: halo/compute/prepared.py)."""
        shard = cls.__new__(cls)
        shard._assemble(layout, _check_groups(groups, layout.n_mlp_groups, "MLP"), gate_up, down, threads)
        return shard

    def _assemble(self, layout: GroupLayout, groups: tuple, gate_up, down, threads: int) -> None:
        self.groups, self.gate_up, self.down = groups, gate_up, down
        self._down_dense = self.down.matrices[0] if isinstance(self.down, DenseProjection) else None
        self.backend = block_backend(self.gate_up, self.down)  # halo/compute/backends.py
        self.graph = MlpGraph(self.gate_up, self.down, threads) if self.backend == "onnx-graph" else None
        self.threads = threads
        self.step_weights = c_weights(self.gate_up, self.down) if self.backend == "c-step" else None  # (gate_up, down)
        sizes = [len(layout.mlp_neurons(g)) for g in self.groups]
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        self.slices = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]

    def forward(self, x: np.ndarray, with_norms: bool = False):
        """x: [T, D] normed input -> partial output [T, D] (and group norms [T, G])."""
        if with_norms:
            return sum_and_norms(self.forward_groups(x))
        if self.graph is not None:
            return self.graph(np.ascontiguousarray(x, dtype=np.float32))
        gate, up = self.gate_up(x)
        return self.down(silu(gate) * up)[0]

    @property
    def fused(self) -> bool:
        """Whether a token runs through `step` (backend "c-step": halo's C kernel holds both projections)."""
        return self.backend == "c-step"

    def step(self, x: np.ndarray, norm: np.ndarray, eps: float, *unused) -> np.ndarray:
        """T positions' residual stream x [T, D] through the block in one C call (RMSNorm by `norm`, gate/up, SwiGLU,
        W_down) -> partial output [T, D]; as `forward` of the normed x, each position with the bits of a call of its own."""
        y = np.empty((len(x), self.step_weights[1][1]), np.float32)
        _nbits.mlp_step(x, norm, eps, [self.step_weights], y, self.threads)
        return y

    def forward_groups(self, x: np.ndarray) -> np.ndarray:
        """Each group's contribution to the block output, [T, G, D] (for relaxed merging)."""
        if self._down_dense is None:
            raise ValueError("per-group outputs need the fp32 weight format")
        gate, up = self.gate_up(x)
        return grouped_output(silu(gate) * up, self._down_dense, self.slices)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


class MlpGroupBank:
    """Every MLP group of a layer, any subset computed per call (HALO mode re-maps groups per token).

    fp32: nothing is copied. The checkpoint's own layout is group-major enough: a group's W_gate and W_up
    rows are contiguous, and its W_down columns are a block BLAS reads in place (runs of group-size
    floats), so nothing is gathered per token; loading = bringing those pages in (`prefetch`).
    Compact formats (int8, native 4/8-bit): the built groups live in a `GroupCache` shared by the device's banks.
    Unbounded, every group is one MlpShard (onnxruntime kernels on its compact blocks), built once. Bounded (a
    memory budget: `compact` set), a group is a CompactMlpGroup (its compact arrays), and one the ranking
    needs and the cache lost is read again from the prepared groups or the model file (`prefetch` does it ahead,
    on the load thread)."""

    def __init__(self, layer: LayerWeights, layout: GroupLayout, fmt: str = "fp32", threads: int = 1,
                 cache: GroupCache | None = None, index: int = 0, prepared=None):
        """cache: where compact groups are kept (None: a bank of its own, unbounded); index: the layer, its key;
        prepared: the device's groups written group-major in kernel form (halo/compute/prepared.py), built from instead of
        the model file."""
        self.layer, self.layout, self.fmt, self.threads, self.index = layer, layout, fmt, threads, index
        self.prepared = prepared
        self.compact = False  # compact formats: groups held as CompactMlpGroup (memory-bounded) instead of sessions
        if fmt == "fp32":
            self.w_gate, self.w_up, self.w_down = (as_float32(w) for w in (layer.w_gate, layer.w_up, layer.w_down))
            self.cache = None
        else:
            self.cache = cache if cache is not None else GroupCache()
            self.w_down = None
        self.dim = layer.w_down.shape[0]

    def _rows(self, group: int) -> slice:
        r = self.layout.mlp_neurons(group)
        return slice(r.start, r.stop)

    def shard(self, group: int, ahead: bool = False) -> "MlpShard | CompactMlpGroup":
        """A compact group's kernels: from the cache, or built now (from the prepared groups or the model file)."""
        return self.cache.get((self.index, group), lambda: self._build(group), ahead)

    def _build(self, group: int) -> "MlpShard | CompactMlpGroup":
        if self.compact:
            if self.prepared is not None:
                return self.prepared.compact_group(self.index, group, self.cache.buffers)
            return CompactMlpGroup.build(self.layer, self.layout, group, self.fmt, self.cache.buffers)
        if self.prepared is not None:
            return self.prepared.shard(self.index, group, self.threads)
        return MlpShard(self.layer, self.layout, [group], self.fmt, self.threads)

    def forward(self, x: np.ndarray, groups: Sequence[int], keep: np.ndarray | None = None,
                norm: np.ndarray | None = None, eps: float = 0.0) -> np.ndarray:
        """x: [T, D] input, normed with `norm` first (None: x is normed already) -> the summed output of `groups`
        [T, D]; keep [T, len(groups)] says which tokens each group serves (None: all). A decode step norms in the
        same C call that computes every group, as exact's fused MLP step does."""
        out = np.zeros((len(x), self.dim), dtype=np.float32)
        if len(x) == 1 and self.cache is not None and len(groups) and (keep is None or keep.all()):
            shards = [self.shard(int(g)) for g in groups]  # held until computed
            if all(getattr(s, "step_weights", None) for s in shards):  # a decode step: every group, one C call
                _nbits.mlp_step(np.ascontiguousarray(x, np.float32), norm, eps, [s.step_weights for s in shards],
                                out, self.threads)
                return out
            del shards  # (computed group by group below, each taken again)
        if norm is not None:
            x = rmsnorm(x, norm, eps)
        for j, g in enumerate(groups):
            tokens = slice(None) if keep is None else np.flatnonzero(keep[:, j])
            xs = x[tokens]
            if len(xs) == 0:
                continue
            if self.cache is not None:  # one group held at a time: a prompt's rows need every group of the layer,
                # which a bounded cache holds only in part (all held at once: up to a layer's groups beyond its
                # capacity, 99 MB for the Llama-3.1-8B shape)
                out[tokens] += self.shard(int(g)).forward(xs)
            else:
                s = self._rows(int(g))
                out[tokens] += (silu(xs @ self.w_gate[s].T) * (xs @ self.w_up[s].T)) @ self.w_down[:, s].T
        return out

    def prefetch(self, groups: Sequence[int]) -> int:
        """Load the groups ahead of use. fp32: have the kernel read their weights from the model file (madvise
        WILLNEED: asynchronous, no copy, the GIL stays free); on a device short of RAM this is the disk read;
        returns the bytes asked for (W_down columns span whole rows of pages: its rows are advised). Compact:
        build the groups the cache lacks; returns their bytes."""
        if not len(groups):
            return 0
        if self.cache is not None:
            missing = [int(g) for g in groups if (self.index, int(g)) not in self.cache]
            return sum(self.shard(g, ahead=True).nbytes for g in missing)
        covered = 0
        for g in groups:
            s = self._rows(int(g))
            covered += load_pages(self.w_gate[s]) + load_pages(self.w_up[s])
        return covered + load_pages(self.w_down)

    @property
    def nbytes(self) -> int:
        """fp32: the layer's mapped MLP weights; compact: 0 (the shared cache holds them: GroupCache.held_bytes)."""
        return 0 if self.cache is not None else sum(w.nbytes for w in (self.w_gate, self.w_up, self.w_down))


class LmHeadShard:
    """A set of vocabulary groups: the logits of its rows."""

    def __init__(self, lm_head: Weight, layout: GroupLayout, groups: Sequence[int], fmt: str = "fp32",
                 threads: int = 1):
        self.groups = _check_groups(groups, layout.n_vocab_groups, "LM-head")
        self.token_ids = layout.vocab_ids(self.groups)
        self.proj = make_projection([take_rows(lm_head, self.token_ids)], fmt, threads)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """x: [T, D] final-normed hidden state -> logits [T, len(token_ids)] for self.token_ids."""
        return self.proj(x)[0]

    @property
    def row_by_row(self) -> bool:
        """Whether each position's logits have the bits they would have alone (halo's C kernel quantizes and sums each
        row on its own; a BLAS matrix product may not)."""
        return getattr(self.proj, "row_by_row", False)

    @property
    def nbytes(self) -> int:
        return self.proj.nbytes
