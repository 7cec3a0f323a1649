"""A stage's unit range as one ONNX graph (onnx.helper), for browser workers on onnxruntime-web.

Inputs: `tokens` int64 [T] (a stage with the embedding) or `hidden` float32 [T, D]; `start_pos`
int64 [1]; per layer l `past_k_l`, `past_v_l` float32 [KVH, P, hd] (P = start_pos: the cache so far).
Outputs: `hidden_out` [T, D], or for the head stage `logits` [R, V] of the rows `head_rows` int64 [R]
names and `top_ids` int64 [K], `top_values` [K] of the last of them (K = `k` int64 [1]); per layer
`present_k_l`, `present_v_l` [KVH, P + T, hd]. The worker keeps the present tensors as the next
call's past: its KV cache stays in the browser.

The arithmetic follows halo/neuron_groups.py op for op (RMSNorm as x * (1 / sqrt(mean(x²) + eps)) *
w, rotate-half rotary from the same cos/sin tables, causal softmax attention per KV head group,
SwiGLU with SiLU as x / (1 + exp(-x))), so results agree with the numpy engine to float32 rounding.
The file is named by the sha256 of its bytes: browsers cache it, and a changed model never hits a
stale copy.
"""

from __future__ import annotations

import hashlib

import numpy as np

from halo.weights import ModelWeights

from .stage import check_units, n_units

OPSET = 17
MAX_BYTES = 1_900_000_000  # one protobuf file; larger ranges belong on a native worker


class _Graph:
    def __init__(self):
        self.nodes, self.initializers, self.count = [], [], 0

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


def export_stage(weights: ModelWeights, start: int, stop: int, max_seq_len: int) -> bytes:
    """The serialized ONNX model of units [start, stop)."""
    from onnx import TensorProto, helper

    c = weights.config
    check_units(c, start, stop)
    g = _Graph()
    hd, kvh, r = c.head_dim, c.n_kv_heads, c.n_heads // c.n_kv_heads
    layers = list(range(max(0, start - 1), min(c.n_layers, stop - 1)))
    inputs, outputs = [], []
    g.const("eps", np.float32(c.norm_eps))
    g.const("one", np.float32(1.0))
    g.const("neg_inf", np.float32(-np.inf))
    g.const("scale", np.float32(1.0 / np.sqrt(hd)))
    g.const("i0", np.array(0, np.int64))
    g.const("i1", np.array(1, np.int64))
    g.const("shape_q", np.array([0, c.n_heads, hd], np.int64))
    g.const("shape_kv", np.array([0, kvh, hd], np.int64))
    g.const("shape_group", np.array([0, kvh, r, hd], np.int64))
    g.const("shape_flat_q", np.array([kvh, -1, hd], np.int64))
    g.const("shape_back", np.array([kvh, -1, r, hd], np.int64))
    g.const("shape_out", np.array([0, c.n_heads * hd], np.int64))
    g.const("half_lo", np.array([0], np.int64))
    g.const("half_mid", np.array([hd // 2], np.int64))
    g.const("half_hi", np.array([hd], np.int64))
    g.const("axis_last", np.array([-1], np.int64))
    g.const("axis_1", np.array([1], np.int64))
    g.const("r_repeats", np.array([1, r], np.int64))
    g.const("col", np.array([-1, 1], np.int64))
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64), _inv_freq(c))
    g.const("cos_table", np.cos(angles).astype(np.float32))
    g.const("sin_table", np.sin(angles).astype(np.float32))
    inputs.append(helper.make_tensor_value_info("start_pos", TensorProto.INT64, [1]))
    if start == 0:
        inputs.append(helper.make_tensor_value_info("tokens", TensorProto.INT64, ["T"]))
        g.const("embedding", weights.tok_embeddings)
        x = g.op("Gather", "embedding", "tokens")
        length = g.op("Shape", "tokens")
    else:
        inputs.append(helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", c.dim]))
        x = "hidden"
        length = g.op("Shape", "hidden", start=0, end=1)
    T = g.op("Squeeze", length, "half_lo")
    start_scalar = g.op("Squeeze", "start_pos", "half_lo")
    end = g.op("Add", start_scalar, T)
    positions = g.op("Range", start_scalar, end, "i1")  # [T]
    cos = g.op("Unsqueeze", g.op("Gather", "cos_table", positions), "axis_1")  # [T, 1, hd/2]
    sin = g.op("Unsqueeze", g.op("Gather", "sin_table", positions), "axis_1")
    key_positions = g.op("Range", "i0", end, "i1")  # [S]
    query_positions = g.op("Reshape", g.op("Tile", g.op("Reshape", positions, "col"), "r_repeats"), "col")  # [T*r, 1]
    mask = g.op("Greater", g.op("Unsqueeze", key_positions, "half_lo"), query_positions)  # [T*r, S]

    def rmsnorm(v: str, weight: np.ndarray, name: str) -> str:
        w = g.const(name, weight)
        mean = g.op("ReduceMean", g.op("Mul", v, v), axes=[-1], keepdims=1)
        inv = g.op("Div", "one", g.op("Sqrt", g.op("Add", mean, "eps")))
        return g.op("Mul", g.op("Mul", v, inv), w)

    def linear(v: str, matrix: np.ndarray, name: str) -> str:
        return g.op("MatMul", v, g.const(name, np.ascontiguousarray(matrix.T)))

    def rotate(v: str) -> str:  # [T, H, hd], rotate half
        x1 = g.op("Slice", v, "half_lo", "half_mid", "axis_last")
        x2 = g.op("Slice", v, "half_mid", "half_hi", "axis_last")
        first = g.op("Sub", g.op("Mul", x1, cos), g.op("Mul", x2, sin))
        second = g.op("Add", g.op("Mul", x2, cos), g.op("Mul", x1, sin))
        return g.op("Concat", first, second, axis=-1)

    for l in layers:
        lw = weights.layers[l]
        for name in (f"past_k_{l}", f"past_v_{l}"):
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [kvh, "P", hd]))
        h = rmsnorm(x, lw.attn_norm, f"l{l}.attn_norm")
        q = rotate(g.op("Reshape", linear(h, lw.wq, f"l{l}.wq"), "shape_q"))
        k = rotate(g.op("Reshape", linear(h, lw.wk, f"l{l}.wk"), "shape_kv"))
        v = g.op("Reshape", linear(h, lw.wv, f"l{l}.wv"), "shape_kv")
        keys = g.op("Concat", f"past_k_{l}", g.op("Transpose", k, perm=[1, 0, 2]), axis=1, out=f"present_k_{l}")
        values = g.op("Concat", f"past_v_{l}", g.op("Transpose", v, perm=[1, 0, 2]), axis=1, out=f"present_v_{l}")
        for name in (keys, values):
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [kvh, "S", hd]))
        qg = g.op("Reshape", g.op("Transpose", g.op("Reshape", q, "shape_group"), perm=[1, 0, 2, 3]), "shape_flat_q")
        scores = g.op("Mul", g.op("MatMul", qg, g.op("Transpose", keys, perm=[0, 2, 1])), "scale")  # [KVH, T*r, S]
        probs = g.op("Softmax", g.op("Where", mask, "neg_inf", scores), axis=-1)
        attended = g.op("MatMul", probs, values)  # [KVH, T*r, hd]
        attended = g.op("Reshape", g.op("Transpose", g.op("Reshape", attended, "shape_back"), perm=[1, 0, 2, 3]),
                        "shape_out")
        x = g.op("Add", x, linear(attended, lw.wo, f"l{l}.wo"))
        h = rmsnorm(x, lw.mlp_norm, f"l{l}.mlp_norm")
        gate = linear(h, lw.w_gate, f"l{l}.w_gate")
        silu = g.op("Div", gate, g.op("Add", "one", g.op("Exp", g.op("Neg", gate))))
        x = g.op("Add", x, linear(g.op("Mul", silu, linear(h, lw.w_up, f"l{l}.w_up")), lw.w_down, f"l{l}.w_down"))
    if stop == n_units(c):
        inputs.append(helper.make_tensor_value_info("head_rows", TensorProto.INT64, ["R"]))
        inputs.append(helper.make_tensor_value_info("k", TensorProto.INT64, [1]))
        rows = g.op("Gather", x, "head_rows")
        logits = linear(rmsnorm(rows, weights.final_norm, "final_norm"), weights.lm_head, "lm_head")
        g.op("Identity", logits, out="logits")
        last = g.op("Gather", logits, g.op("Sub", g.op("Shape", "head_rows"), "i1"))  # [1, V]
        g.nodes.append(helper.make_node("TopK", [last, "k"], ["top_values_2d", "top_ids_2d"], axis=-1, largest=1,
                                        sorted=1))
        g.op("Squeeze", "top_values_2d", "half_lo", out="top_values")
        g.op("Squeeze", "top_ids_2d", "half_lo", out="top_ids")
        outputs += [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["R", c.vocab_size]),
                    helper.make_tensor_value_info("top_ids", TensorProto.INT64, ["K"]),
                    helper.make_tensor_value_info("top_values", TensorProto.FLOAT, ["K"])]
    else:
        g.op("Identity", x, out="hidden_out")
        outputs.append(helper.make_tensor_value_info("hidden_out", TensorProto.FLOAT, ["T", c.dim]))
    graph = helper.make_graph(g.nodes, f"halo-units-{start}-{stop}", inputs, outputs, initializer=g.initializers)
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
    from halo.ops import rope_inv_freq

    return rope_inv_freq(config)
