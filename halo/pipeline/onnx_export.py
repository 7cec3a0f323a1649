"""A stage's unit range as one ONNX graph (onnx.helper), for browser workers on onnxruntime-web.

Inputs: `tokens` int64 [T] (a stage with the embedding) or `hidden` float32 [T, D]; `start_pos`
int64 [1]; per layer l `past_k_l`, `past_v_l` float32 [KVH, P, hd] (P = start_pos: the cache so far).
Outputs: `hidden_out` [T, D], or for the head stage `logits` [R, V] of the rows `head_rows` int64 [R]
names and `top_ids` int64 [K], `top_values` [K] of the last of them (K = `k` int64 [1]); per layer
`present_k_l`, `present_v_l` [KVH, P + T, hd]. The worker keeps the present tensors as the next
call's past: its KV cache stays in the browser.

The arithmetic follows halo/compute/neuron_groups.py op for op (RMSNorm as x * (1 / sqrt(mean(x²) + eps)) *
w, rotate-half rotary from the same cos/sin tables, causal softmax attention per KV head group,
SwiGLU with SiLU as x / (1 + exp(-x))), so results agree with the numpy engine to float32 rounding.
The file is named by the sha256 of its bytes: browsers cache it, and a changed model never hits a
stale copy.
"""

from __future__ import annotations

import hashlib

import numpy as np

from halo.model.weights import ModelWeights

from halo.pipeline.stage import check_units, n_units

OPSET = 17
MAX_BYTES = 1_900_000_000  # one protobuf file; larger ranges belong on a native worker


class _Graph:
    """Nodes and initializers of one ONNX graph, with the few composite operations a decoder layer needs."""

    def __init__(self):
        self.nodes, self.initializers, self.count = [], [], 0
        self.inputs, self.outputs = [], []

    def const(self, name: str, array) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        from onnx import helper

        self.count += 1
        out = out or f"{op_type.lower()}_{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def io(self, which: list, name: str, dtype: str, shape: list) -> str:
        from onnx import TensorProto, helper

        which.append(helper.make_tensor_value_info(name, getattr(TensorProto, dtype), shape))
        return name

    def rmsnorm(self, v: str, weight: np.ndarray, name: str) -> str:
        w = self.const(name, weight)
        mean = self.op("ReduceMean", self.op("Mul", v, v), axes=[-1], keepdims=1)
        inv = self.op("Div", "one", self.op("Sqrt", self.op("Add", mean, "eps")))
        return self.op("Mul", self.op("Mul", v, inv), w)

    def linear(self, v: str, matrix: np.ndarray, name: str) -> str:
        return self.op("MatMul", v, self.const(name, np.ascontiguousarray(matrix.T)))

    def rotate(self, v: str, cos: str, sin: str) -> str:
        """[T, H, hd], rotate-half RoPE."""
        x1 = self.op("Slice", v, "half_lo", "half_mid", "axis_last")
        x2 = self.op("Slice", v, "half_mid", "half_hi", "axis_last")
        first = self.op("Sub", self.op("Mul", x1, cos), self.op("Mul", x2, sin))
        second = self.op("Add", self.op("Mul", x2, cos), self.op("Mul", x1, sin))
        return self.op("Concat", first, second, axis=-1)


def _constants(g: _Graph, c, max_seq_len: int) -> None:
    hd, kvh, r = c.head_dim, c.n_kv_heads, c.n_heads // c.n_kv_heads
    scalars = {"eps": np.float32(c.norm_eps), "one": np.float32(1.0), "neg_inf": np.float32(-np.inf),
               "scale": np.float32(1.0 / np.sqrt(hd)), "i0": np.array(0, np.int64), "i1": np.array(1, np.int64)}
    shapes = {"shape_q": [0, c.n_heads, hd], "shape_kv": [0, kvh, hd], "shape_group": [0, kvh, r, hd],
              "shape_flat_q": [kvh, -1, hd], "shape_back": [kvh, -1, r, hd], "shape_out": [0, c.n_heads * hd],
              "half_lo": [0], "half_mid": [hd // 2], "half_hi": [hd], "axis_last": [-1], "axis_1": [1],
              "r_repeats": [1, r], "col": [-1, 1]}
    for name, value in scalars.items():
        g.const(name, value)
    for name, value in shapes.items():
        g.const(name, np.array(value, np.int64))
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64), _inv_freq(c))
    g.const("cos_table", np.cos(angles).astype(np.float32))
    g.const("sin_table", np.sin(angles).astype(np.float32))


def _stage_input(g: _Graph, weights: ModelWeights, start: int) -> tuple[str, str]:
    """(the residual stream [T, D], its length as a [1] tensor): token ids embedded, or the hidden state."""
    if start == 0:
        g.io(g.inputs, "tokens", "INT64", ["T"])
        g.const("embedding", weights.tok_embeddings)
        return g.op("Gather", "embedding", "tokens"), g.op("Shape", "tokens")
    g.io(g.inputs, "hidden", "FLOAT", ["T", weights.config.dim])
    return "hidden", g.op("Shape", "hidden", start=0, end=1)


def _positions(g: _Graph, length: str) -> tuple[str, str, str]:
    """(cos, sin of the new positions [T, 1, hd/2], the causal mask [T*r, S])."""
    T = g.op("Squeeze", length, "half_lo")
    start_scalar = g.op("Squeeze", "start_pos", "half_lo")
    end = g.op("Add", start_scalar, T)
    positions = g.op("Range", start_scalar, end, "i1")  # [T]
    cos = g.op("Unsqueeze", g.op("Gather", "cos_table", positions), "axis_1")
    sin = g.op("Unsqueeze", g.op("Gather", "sin_table", positions), "axis_1")
    key_positions = g.op("Range", "i0", end, "i1")  # [S]
    query_positions = g.op("Reshape", g.op("Tile", g.op("Reshape", positions, "col"), "r_repeats"), "col")  # [T*r, 1]
    return cos, sin, g.op("Greater", g.op("Unsqueeze", key_positions, "half_lo"), query_positions)


def _layer(g: _Graph, weights: ModelWeights, l: int, x: str, cos: str, sin: str, mask: str) -> str:
    """Decoder layer l on the residual stream x, with its KV cache as graph inputs and outputs."""
    c, lw = weights.config, weights.layers[l]
    kvh, hd = c.n_kv_heads, c.head_dim
    for name in (f"past_k_{l}", f"past_v_{l}"):
        g.io(g.inputs, name, "FLOAT", [kvh, "P", hd])
    h = g.rmsnorm(x, lw.attn_norm, f"l{l}.attn_norm")
    q = g.rotate(g.op("Reshape", g.linear(h, lw.wq, f"l{l}.wq"), "shape_q"), cos, sin)
    k = g.rotate(g.op("Reshape", g.linear(h, lw.wk, f"l{l}.wk"), "shape_kv"), cos, sin)
    v = g.op("Reshape", g.linear(h, lw.wv, f"l{l}.wv"), "shape_kv")
    keys = g.op("Concat", f"past_k_{l}", g.op("Transpose", k, perm=[1, 0, 2]), axis=1, out=f"present_k_{l}")
    values = g.op("Concat", f"past_v_{l}", g.op("Transpose", v, perm=[1, 0, 2]), axis=1, out=f"present_v_{l}")
    for name in (keys, values):
        g.io(g.outputs, name, "FLOAT", [kvh, "S", hd])
    qg = g.op("Reshape", g.op("Transpose", g.op("Reshape", q, "shape_group"), perm=[1, 0, 2, 3]), "shape_flat_q")
    scores = g.op("Mul", g.op("MatMul", qg, g.op("Transpose", keys, perm=[0, 2, 1])), "scale")  # [KVH, T*r, S]
    probs = g.op("Softmax", g.op("Where", mask, "neg_inf", scores), axis=-1)
    attended = g.op("MatMul", probs, values)  # [KVH, T*r, hd]
    attended = g.op("Reshape", g.op("Transpose", g.op("Reshape", attended, "shape_back"), perm=[1, 0, 2, 3]),
                    "shape_out")
    x = g.op("Add", x, g.linear(attended, lw.wo, f"l{l}.wo"))
    h = g.rmsnorm(x, lw.mlp_norm, f"l{l}.mlp_norm")
    gate = g.linear(h, lw.w_gate, f"l{l}.w_gate")
    silu = g.op("Div", gate, g.op("Add", "one", g.op("Exp", g.op("Neg", gate))))
    return g.op("Add", x, g.linear(g.op("Mul", silu, g.linear(h, lw.w_up, f"l{l}.w_up")), lw.w_down, f"l{l}.w_down"))


def _head(g: _Graph, weights: ModelWeights, x: str) -> None:
    """Final norm + LM head over the rows asked for, and the top k of the last one."""
    from onnx import helper

    g.io(g.inputs, "head_rows", "INT64", ["R"])
    g.io(g.inputs, "k", "INT64", [1])
    rows = g.op("Gather", x, "head_rows")
    logits = g.linear(g.rmsnorm(rows, weights.final_norm, "final_norm"), weights.lm_head, "lm_head")
    g.op("Identity", logits, out="logits")
    last = g.op("Gather", logits, g.op("Sub", g.op("Shape", "head_rows"), "i1"))  # [1, V]
    g.nodes.append(helper.make_node("TopK", [last, "k"], ["top_values_2d", "top_ids_2d"], axis=-1, largest=1,
                                    sorted=1))
    g.op("Squeeze", "top_values_2d", "half_lo", out="top_values")
    g.op("Squeeze", "top_ids_2d", "half_lo", out="top_ids")
    g.io(g.outputs, "logits", "FLOAT", ["R", weights.config.vocab_size])
    g.io(g.outputs, "top_ids", "INT64", ["K"])
    g.io(g.outputs, "top_values", "FLOAT", ["K"])


def export_stage(weights: ModelWeights, start: int, stop: int, max_seq_len: int) -> bytes:
    """The serialized ONNX model of units [start, stop)."""
    from onnx import helper

    c = weights.config
    check_units(c, start, stop)
    g = _Graph()
    _constants(g, c, max_seq_len)
    g.io(g.inputs, "start_pos", "INT64", [1])
    x, length = _stage_input(g, weights, start)
    cos, sin, mask = _positions(g, length)
    for l in range(max(0, start - 1), min(c.n_layers, stop - 1)):
        x = _layer(g, weights, l, x, cos, sin, mask)
    if stop == n_units(c):
        _head(g, weights, x)
    else:
        g.op("Identity", x, out="hidden_out")
        g.io(g.outputs, "hidden_out", "FLOAT", ["T", c.dim])
    graph = helper.make_graph(g.nodes, f"halo-units-{start}-{stop}", g.inputs, g.outputs, initializer=g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="halo")
    model.ir_version = 8  # readable by onnxruntime-web and older runtimes
    data = model.SerializeToString()
    if len(data) > MAX_BYTES:
        from halo.errors import ConfigError

        raise ConfigError(f"units [{start}, {stop}) make a {len(data) / 1e9:.1f} GB ONNX file; a browser worker can "
                          "hold at most ~1.9 GB: give it fewer layers (the planner does, with its memory budget)")
    return data


def content_name(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() + ".onnx"


def _inv_freq(config) -> np.ndarray:
    from halo.model.ops import rope_inv_freq

    return rope_inv_freq(config)
