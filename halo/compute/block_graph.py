"""A block's share as one onnxruntime graph: the compact formats' fast path.

A decode step of a small model is mostly fixed costs: a 576-wide SmolLM2 layer ran four kernel calls and a
dozen numpy operations per token, and each call costs tens of microseconds before any weight is read. So in
the compact formats (native 4/8-bit blocks, int8) an attention shard is one graph (q/k/v projection, rotary,
attention over its KV cache, W_o) and an MLP shard is one graph (gate/up, SwiGLU, W_down): one call per
block. The graphs take the kernels of halo/compute/linear.py as they are (same weights, same MatMulNBits), so a
shard's arithmetic is the same kernels' whichever device holds it. The float32 format keeps the numpy path
of halo/compute/neuron_groups.py: the reference checked against transformers, and the per-group contributions
(head and group norms) that predictor training reads.
"""

from __future__ import annotations

import math

import numpy as np

from halo.compute.linear import GraphBuilder, GraphSession, KernelProjection


def _open(graph: GraphBuilder, projections, inputs: dict, outputs: dict, threads: int) -> GraphSession:
    session = graph.session(inputs, outputs, threads)
    for p in projections:
        p.kernels[0].release()  # onnxruntime packed them: drop the prepared pages
    return session


class AttentionGraph:
    """Query heads of one layer as one graph. Inputs: the normed x [T, D], rotary cos/sin [T, 1, hd/2], the
    cached keys/values of positions 0..P-1 [P, KV, hd] and an additive causal mask [T, P+T]; outputs: the
    partial output [T, D] and the new positions' rotated keys and values [T, KV, hd] for the cache."""

    def __init__(self, qkv: KernelProjection, out: KernelProjection, kv_of_head: list[int], head_dim: int,
                 n_kv_heads: int, threads: int = 1):
        g = GraphBuilder()
        node, const = g.node, g.constant
        h, hd, kv = len(kv_of_head), head_dim, n_kv_heads
        qkv.kernels[0].add_to(g, "qkv_", "x", "qkv")
        q, k, v = node("Split", ["qkv", const("qkv_sizes", [h * hd, kv * hd, kv * hd])], ["q", "k_flat", "v_flat"],
                       axis=1)
        node("Reshape", [v, const("kv_shape", [0, kv, hd])], "v")

        def rotate(name: str, flat: str, heads: int, output: str) -> str:  # rotate-half, as halo/model/ops.py Rotary
            x = node("Reshape", [flat, const(name + "_shape", [0, heads, hd])], name + "_heads")
            a, b = node("Split", [x, const(name + "_halves", [hd // 2, hd // 2])], [name + "_a", name + "_b"], axis=2)
            first = node("Sub", [node("Mul", [a, "cos"], name + "_a_cos"), node("Mul", [b, "sin"], name + "_b_sin")],
                         name + "_first")
            second = node("Add", [node("Mul", [b, "cos"], name + "_b_cos"), node("Mul", [a, "sin"], name + "_a_sin")],
                          name + "_second")
            return node("Concat", [first, second], output, axis=2)

        q = rotate("q", q, h, "q_rotated")
        rotate("k", k, kv, "k")
        kv_index = const("kv_of_head", kv_of_head)
        keys = node("Gather", [node("Concat", ["past_k", "k"], "keys", axis=0), kv_index], "keys_per_head", axis=1)
        values = node("Gather", [node("Concat", ["past_v", "v"], "values", axis=0), kv_index], "values_per_head", axis=1)
        scores = node("MatMul", [node("Transpose", [q], "q_t", perm=[1, 0, 2]),
                                 node("Transpose", [keys], "keys_t", perm=[1, 2, 0])], "scores")  # [H, T, S]
        scaled = node("Mul", [scores, const("scale", 1.0 / math.sqrt(hd), np.float32)], "scaled")
        probs = node("Softmax", [node("Add", [scaled, "mask"], "masked")], "probs", axis=-1)
        attended = node("MatMul", [probs, node("Transpose", [values], "values_t", perm=[1, 0, 2])], "attended")
        heads = node("Transpose", [attended], "attended_t", perm=[1, 0, 2])
        node("Reshape", [heads, const("rows_shape", [0, -1])], "heads")
        out.kernels[0].add_to(g, "o_", "heads", "y")
        d = out.kernels[0].n
        self.session = _open(g, [qkv, out],
                             {"x": ("T", qkv.kernels[0].k), "cos": ("T", 1, hd // 2), "sin": ("T", 1, hd // 2),
                              "past_k": ("P", kv, hd), "past_v": ("P", kv, hd), "mask": ("T", "S")},
                             {"y": ("T", d), "k": ("T", kv, hd), "v": ("T", kv, hd)}, threads)

    def __call__(self, x, cos, sin, past_k, past_v, start_pos: int):
        t = len(x)
        mask = np.zeros((t, start_pos + t), np.float32)
        if t > 1:  # query i (position start_pos + i) sees keys 0..start_pos + i
            mask[np.arange(start_pos + t)[None, :] > (start_pos + np.arange(t))[:, None]] = -np.inf
        return self.session.run({"x": x, "cos": cos, "sin": sin, "past_k": past_k, "past_v": past_v, "mask": mask})


class MlpGraph:
    """MLP neuron groups of one layer as one graph: normed x [T, D] -> partial output [T, D]."""

    def __init__(self, gate_up: KernelProjection, down: KernelProjection, threads: int = 1):
        g = GraphBuilder()
        node = g.node
        neurons = gate_up.outputs[0].stop
        gate_up.kernels[0].add_to(g, "gate_up_", "x", "gate_up")
        gate, up = node("Split", ["gate_up", g.constant("halves", [neurons, neurons])], ["gate", "up"], axis=1)
        silu = node("Mul", [gate, node("Sigmoid", [gate], "gate_sigmoid")], "gate_silu")
        node("Mul", [silu, up], "act")
        down.kernels[0].add_to(g, "down_", "act", "y")
        self.session = _open(g, [gate_up, down], {"x": ("T", gate_up.kernels[0].k)}, {"y": ("T", down.kernels[0].n)},
                             threads)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.session.run({"x": x})[0]
