"""Weight formats: how a block's projection matrices are stored and multiplied.

A `Projection` holds one or more matrices that read the same input (q/k/v, gate/up) and returns
one output per matrix. Two formats:

- "fp32": the float32 arrays as loaded (memory maps stay memory maps: zero-copy), numpy BLAS.
- "int8": per-block symmetric int8 weights (32 inputs per block, one float32 scale each: 1.125
  bytes per weight), run by onnxruntime's MatMulNBits kernel with int8 activations
  (accuracy_level 4), which streams the quantized weights at memory speed on x86 (AVX2/AVX-512
  VNNI) and Arm (NEON dot-product). Matrices that share an input are fused into one kernel call.
"""

from __future__ import annotations

import numpy as np

from .errors import ConfigError

FORMATS = ("fp32", "int8")
INT8_BLOCK = 32


class DenseProjection:
    def __init__(self, matrices: list[np.ndarray]):
        self.matrices = matrices
        self.nbytes = sum(m.nbytes for m in matrices)

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        # x: [T, in] -> [T, out_i] for each matrix
        return [x @ m.T for m in self.matrices]


def quantize_int8(w: np.ndarray, block: int = INT8_BLOCK, rows_per_chunk: int = 4096):
    """Symmetric per-block int8, stored as uint8 with zero point 128 (MatMulNBits' default).

    Returns (codes [N, K/block, block] uint8, scales [N, K/block] float32). Works through the rows in
    chunks so a large float32 matrix is never duplicated whole.
    """
    n, k = w.shape
    blocks = -(-k // block)
    codes = np.empty((n, blocks, block), dtype=np.uint8)
    scales = np.empty((n, blocks), dtype=np.float32)
    for start in range(0, n, rows_per_chunk):
        chunk = np.zeros((min(rows_per_chunk, n - start), blocks * block), dtype=np.float32)
        chunk[:, :k] = w[start:start + len(chunk)]
        chunk = chunk.reshape(len(chunk), blocks, block)
        scale = np.abs(chunk).max(axis=-1) / 127.0
        scale[scale == 0] = 1.0
        q = np.rint(chunk / scale[..., None])
        codes[start:start + len(chunk)] = (np.clip(q, -127, 127) + 128).astype(np.uint8)
        scales[start:start + len(chunk)] = scale
    return codes, scales


def dequantize_int8(codes: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    n = codes.shape[0]
    return ((codes.astype(np.float32) - 128.0) * scales[..., None]).reshape(n, -1)[:, :k]


class Int8Projection:
    def __init__(self, matrices: list[np.ndarray], threads: int = 1):
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        k = matrices[0].shape[1]
        if any(m.shape[1] != k for m in matrices):
            raise ValueError("fused matrices must share their input size")
        self.splits = np.cumsum([m.shape[0] for m in matrices])[:-1]
        n = sum(m.shape[0] for m in matrices)
        parts = [quantize_int8(m) for m in matrices]
        codes = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        scales = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        del parts
        self.nbytes = codes.nbytes + scales.nbytes
        node = helper.make_node("MatMulNBits", ["x", "codes", "scales"], ["y"], domain="com.microsoft",
                                K=k, N=n, bits=8, block_size=INT8_BLOCK, accuracy_level=4)
        graph = helper.make_graph(
            [node], "projection",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])],
            initializer=[numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scales")])
        del codes, scales
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        y = self.session.run(None, {"x": np.ascontiguousarray(x, dtype=np.float32)})[0]
        return np.split(y, self.splits, axis=1) if len(self.splits) else [y]


def make_projection(matrices: list[np.ndarray], fmt: str, threads: int = 1):
    if fmt == "fp32":
        return DenseProjection(matrices)
    if fmt == "int8":
        return Int8Projection(matrices, threads)
    raise ConfigError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
