"""Weight formats: how a block's projection matrices are stored and multiplied.

A `Projection` holds one or more matrices that read the same input (q/k/v, gate/up) and returns
one output per matrix. Two formats:

- "fp32": the float32 arrays as loaded (memory maps stay memory maps: zero-copy), numpy BLAS.
- "int8": per-block symmetric int8 weights (128 inputs per block, one float32 scale each: 1.03
  bytes per weight), run by onnxruntime's MatMulNBits kernel with int8 activations
  (accuracy_level 4), which streams the quantized weights at memory speed on x86 (AVX2/AVX-512
  VNNI) and Arm (NEON dot-product). Matrices that share an input are fused into one kernel call.
"""

from __future__ import annotations

import math
import tempfile

import numpy as np

from .errors import ConfigError
from .memory import release_freed_heap, release_pages

FORMATS = ("fp32", "int8")
INT8_BLOCK = 128  # inputs per scale; 128 streams ~10 % faster than 64 in MatMulNBits here
MIN_INT8_BLOCK = 16  # MatMulNBits' smallest block


def int8_block_for(column_group: int) -> int:
    """The largest block (<= INT8_BLOCK) that divides a column group, so that a shard holding some of
    the groups quantizes them exactly as the whole matrix does (W_o columns come in heads)."""
    return max(MIN_INT8_BLOCK, math.gcd(INT8_BLOCK, column_group))


class DenseProjection:
    def __init__(self, matrices: list[np.ndarray]):
        self.matrices = matrices
        self.nbytes = sum(m.nbytes for m in matrices)

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        # x: [T, in] -> [T, out_i] for each matrix
        return [x @ m.T for m in self.matrices]


def quantize_int8(w: np.ndarray, block: int = INT8_BLOCK, rows_per_chunk: int = 1024, out=None):
    """Symmetric per-block int8, stored as uint8 with zero point 128 (MatMulNBits' default).

    Returns (codes [N, K/block, block] uint8, scales [N, K/block] float32). Works through the rows in
    chunks and releases each chunk's pages of a memory-mapped source, so a large float32 matrix is
    never resident whole. `out` = (codes, scales) writes into given arrays (e.g. a file mapping).
    """
    n, k = w.shape
    blocks = -(-k // block)
    codes, scales = out if out is not None else (np.empty((n, blocks, block), np.uint8), np.empty((n, blocks), np.float32))
    for start in range(0, n, rows_per_chunk):
        rows = w[start:start + rows_per_chunk]
        chunk = np.zeros((len(rows), blocks * block), dtype=np.float32)
        chunk[:, :k] = rows
        release_pages(rows)
        chunk = chunk.reshape(len(rows), blocks, block)
        scale = np.abs(chunk).max(axis=-1) / 127.0
        scale[scale == 0] = 1.0
        chunk /= scale[..., None]
        np.rint(chunk, out=chunk)
        chunk += 128.0
        codes[start:start + len(rows)] = chunk  # |values| <= 127 by construction of the scale
        scales[start:start + len(rows)] = scale
    return codes, scales


def dequantize_int8(codes: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    n = codes.shape[0]
    return ((codes.astype(np.float32) - 128.0) * scales[..., None]).reshape(n, -1)[:, :k]


class Int8Projection:
    """Matrices sharing an input, quantized and fused into MatMulNBits calls.

    The int8 codes are written to an unlinked temporary file and handed to onnxruntime as external
    initializers: the kernel repacks them into its own layout at session start, after which the
    file pages are released from this process (they re-read from disk if ever touched again).
    Rows are split into kernels of at most MAX_KERNEL_BYTES, so the repacking's transient copy
    stays small next to the model. Peak memory stays near one copy of the int8 weights.
    """

    MAX_KERNEL_BYTES = 32 << 20

    def __init__(self, matrices: list[np.ndarray], threads: int = 1, block: int = INT8_BLOCK):
        k = matrices[0].shape[1]
        if any(m.shape[1] != k for m in matrices):
            raise ValueError("fused matrices must share their input size")
        while block > MIN_INT8_BLOCK and -k % block > k // 16:
            block //= 2  # small inputs (tiny models): a smaller block instead of > 6 % zero padding
        bounds = np.concatenate([[0], np.cumsum([m.shape[0] for m in matrices])]).tolist()
        self.outputs = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        n = bounds[-1]
        blocks = -(-k // block)
        rows_per_kernel = max(1, self.MAX_KERNEL_BYTES // (blocks * block))
        stacked = _RowStack(matrices)
        self.kernels = [_Int8Kernel(stacked, start, min(n, start + rows_per_kernel), k, threads, block)
                        for start in range(0, n, rows_per_kernel)]
        self.nbytes = sum(kernel.nbytes for kernel in self.kernels)

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        outputs = [kernel(x) for kernel in self.kernels]
        y = outputs[0] if len(outputs) == 1 else np.concatenate(outputs, axis=1)
        return [y[:, s] for s in self.outputs]


class _RowStack:
    """Rows start..stop of several matrices stacked on top of each other, without copying them all."""

    def __init__(self, matrices: list[np.ndarray]):
        self.matrices = matrices
        self.offsets = np.concatenate([[0], np.cumsum([m.shape[0] for m in matrices])])

    def pieces(self, start: int, stop: int):
        for m, first in zip(self.matrices, self.offsets[:-1]):
            a, b = max(start, first), min(stop, first + m.shape[0])
            if a < b:
                yield a - start, m[a - first:b - first]


class _Int8Kernel:
    """One onnxruntime MatMulNBits session over rows start..stop of a row stack."""

    def __init__(self, stack: _RowStack, start: int, stop: int, k: int, threads: int, block: int):
        import onnxruntime as ort
        from onnx import TensorProto, helper

        n, blocks = stop - start, -(-k // block)
        self._file = tempfile.TemporaryFile(prefix="halo-int8-")
        self._file.truncate(n * blocks * block)
        codes = np.memmap(self._file, dtype=np.uint8, mode="r+", shape=(n, blocks, block))
        scales = np.empty((n, blocks), dtype=np.float32)
        for offset, rows in stack.pieces(start, stop):
            quantize_int8(rows, block, out=(codes[offset:offset + len(rows)], scales[offset:offset + len(rows)]))
        self.nbytes = codes.nbytes + scales.nbytes
        initializers = []
        for name, array, dtype in (("codes", codes, TensorProto.UINT8), ("scales", scales, TensorProto.FLOAT)):
            tensor = TensorProto(name=name, data_type=dtype, dims=array.shape, data_location=TensorProto.EXTERNAL)
            tensor.external_data.add(key="location", value="in-memory")  # supplied below as OrtValues
            initializers.append(tensor)
        node = helper.make_node("MatMulNBits", ["x", "codes", "scales"], ["y"], domain="com.microsoft",
                                K=k, N=n, bits=8, block_size=block, accuracy_level=4)
        graph = helper.make_graph([node], "projection", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])],
                                  initializer=initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        # onnxruntime reads these buffers without owning them: keep them alive as long as the session
        self._buffers = (codes, scales, ort.OrtValue.ortvalue_from_numpy(codes), ort.OrtValue.ortvalue_from_numpy(scales))
        options.add_external_initializers(["codes", "scales"], list(self._buffers[2:]))
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        codes.flush()
        release_pages(codes)
        release_freed_heap()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"x": x})[0]


def make_projection(matrices: list[np.ndarray], fmt: str, threads: int = 1, int8_block: int = INT8_BLOCK):
    if fmt == "fp32":
        return DenseProjection(matrices)
    if fmt == "int8":
        return Int8Projection(matrices, threads, int8_block)
    raise ConfigError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
