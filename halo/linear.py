"""Weight formats: how a block's projection matrices are stored and multiplied.

A `Projection` holds one or more matrices that read the same input (q/k/v, gate/up) and returns
one output per matrix. Three formats:

- "native" (the default): the model file's own format. Float32/float16/bfloat16 checkpoints run as
  "fp32"; GGUF Q4_0/Q4_1/Q8_0 blocks (halo/quant.py) run on onnxruntime's MatMulNBits exactly as
  stored: 4/8-bit codes, one scale per 32 weights (Q4_1: plus its minimums), never expanded to float32.
- "fp32": float32 arrays (memory maps stay memory maps: zero-copy; compact weights dequantized at
  load: the exact reference), numpy BLAS.
- "int8": per-block symmetric int8 weights (128 inputs per block, one float32 scale each: 1.03
  bytes per weight), run by MatMulNBits with int8 activations (accuracy_level 4), which streams the
  quantized weights at memory speed on x86 (AVX2/AVX-512 VNNI) and Arm (NEON dot-product).

Matrices that share an input are fused into one kernel call.
"""

from __future__ import annotations

import math
import tempfile
from itertools import groupby

import numpy as np

from .errors import ConfigError
from .memory import release_freed_heap, release_pages
from .quant import QuantizedMatrix, as_float32

FORMATS = ("native", "fp32", "int8")
NATIVE_ACCURACY_LEVEL = 4  # MatMulNBits with int8 activations: measured faster than level 1 (fp32) at equal agreement
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


class _KernelProjection:
    """Matrices sharing an input, fused into MatMulNBits calls: rows stacked, split into kernels of at most
    MAX_KERNEL_BYTES of codes, so a kernel's transient copy while onnxruntime repacks it stays small next to
    the model. `fill(rows, codes, scales, offsets)` writes a run of rows in the kernel's terms."""

    MAX_KERNEL_BYTES = 32 << 20

    def __init__(self, matrices: list, threads: int, bits: int, block: int, with_offsets: bool, fill,
                 accuracy_level: int):
        k = matrices[0].shape[1]
        if any(m.shape[1] != k for m in matrices):
            raise ValueError("fused matrices must share their input size")
        bounds = np.concatenate([[0], np.cumsum([m.shape[0] for m in matrices])]).tolist()
        self.outputs = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        n = bounds[-1]
        row_bytes = -(-k // block) * block * bits // 8
        rows_per_kernel = max(1, self.MAX_KERNEL_BYTES // row_bytes)
        stacked = _RowStack(matrices)
        self.kernels = [_NBitsKernel(stacked, start, min(n, start + rows_per_kernel), k, bits, block, with_offsets,
                                     fill, threads, accuracy_level)
                        for start in range(0, n, rows_per_kernel)]
        self.nbytes = sum(kernel.nbytes for kernel in self.kernels)

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        outputs = [kernel(x) for kernel in self.kernels]
        y = outputs[0] if len(outputs) == 1 else np.concatenate(outputs, axis=1)
        return [y[:, s] for s in self.outputs]


class Int8Projection(_KernelProjection):
    """Float32 matrices (or compact ones, dequantized a chunk at a time) quantized to per-block int8,
    run with int8 activations (accuracy_level 4)."""

    def __init__(self, matrices: list, threads: int = 1, block: int = INT8_BLOCK):
        k = matrices[0].shape[1]
        while block > MIN_INT8_BLOCK and -k % block > k // 16:
            block //= 2  # small inputs (tiny models): a smaller block instead of > 6 % zero padding

        def fill(rows, codes, scales, offsets):
            quantize_int8(rows, block, out=(codes, scales))

        super().__init__(matrices, threads, 8, block, False, fill, accuracy_level=4)


class CompactProjection(_KernelProjection):
    """GGUF block matrices (Q4_0, Q4_1, Q8_0) run on their own blocks: the file's codes and scales, exactly
    (halo/quant.py), never expanded to float32."""

    def __init__(self, matrices: list[QuantizedMatrix], threads: int = 1, accuracy_level: int | None = None):
        codec = matrices[0].codec
        if any(m.codec != codec for m in matrices):
            raise ValueError("fused compact matrices must share their block type")
        if not codec.native:
            matrices[0].kernel_blocks()  # raises the error that names the type and the fix

        def fill(rows: QuantizedMatrix, codes, scales, offsets):
            codes[:], scales[:], rows_offsets = rows.kernel_blocks()
            if offsets is not None:
                offsets[:] = rows_offsets
            rows.release()

        super().__init__(matrices, threads, codec.bits, codec.block, codec.has_offsets, fill,
                         NATIVE_ACCURACY_LEVEL if accuracy_level is None else accuracy_level)


class _RowStack:
    """Rows start..stop of several matrices stacked on top of each other, without copying them all."""

    def __init__(self, matrices: list):
        self.matrices = matrices
        self.offsets = np.concatenate([[0], np.cumsum([m.shape[0] for m in matrices])])

    def pieces(self, start: int, stop: int):
        for m, first in zip(self.matrices, self.offsets[:-1]):
            a, b = max(start, first), min(stop, first + m.shape[0])
            if a < b:
                rows = m.take_rows(np.arange(a - first, b - first)) if isinstance(m, QuantizedMatrix) else m[a - first:b - first]
                yield a - start, rows


class _NBitsKernel:
    """One onnxruntime MatMulNBits session over rows start..stop of a row stack.

    The codes, scales (and offsets) are written to an unlinked temporary file and handed to onnxruntime as
    external initializers: the kernel repacks them into its own layout at session start, after which the
    file pages are released from this process (they re-read from disk if ever touched again). Offsets
    (Q4_1's minimums) add offsets @ (the input's per-block sums) in the same session.
    """

    def __init__(self, stack: _RowStack, start: int, stop: int, k: int, bits: int, block: int, with_offsets: bool,
                 fill, threads: int, accuracy_level: int):
        import onnxruntime as ort
        from onnx import TensorProto, helper

        n, blocks = stop - start, -(-k // block)
        shapes = {"codes": ((n, blocks, block * bits // 8), np.uint8, TensorProto.UINT8),
                  "scales": ((n, blocks), np.float32, TensorProto.FLOAT)}
        if with_offsets:
            shapes["offsets"] = ((n, blocks), np.float32, TensorProto.FLOAT)
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype, _ in shapes.values()]
        self._file = tempfile.TemporaryFile(prefix="halo-kernel-")
        self._file.truncate(sum(sizes))
        arrays, at = {}, 0
        for (name, (shape, dtype, _)), size in zip(shapes.items(), sizes):
            arrays[name] = np.memmap(self._file, dtype=dtype, mode="r+", shape=shape, offset=at)
            at += size
        offsets = arrays.get("offsets")
        for first, rows in stack.pieces(start, stop):
            end = first + rows.shape[0]
            fill(rows, arrays["codes"][first:end], arrays["scales"][first:end],
                 None if offsets is None else offsets[first:end])
        self.nbytes = sum(sizes)

        initializers = []
        for name, (shape, dtype, proto_type) in shapes.items():
            tensor = TensorProto(name=name, data_type=proto_type, dims=shape, data_location=TensorProto.EXTERNAL)
            tensor.external_data.add(key="location", value="in-memory")  # supplied below as OrtValues
            initializers.append(tensor)
        nodes = [helper.make_node("MatMulNBits", ["x", "codes", "scales"], ["y" if offsets is None else "y_codes"],
                                  domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                                  accuracy_level=accuracy_level)]
        if offsets is not None:  # y += block_sums(x) @ offsets.T
            initializers += [helper.make_tensor("block_shape", TensorProto.INT64, [3], [-1, blocks, block]),
                             helper.make_tensor("sum_axis", TensorProto.INT64, [1], [2])]
            nodes += [helper.make_node("Reshape", ["x", "block_shape"], ["x_blocks"]),
                      helper.make_node("ReduceSum", ["x_blocks", "sum_axis"], ["block_sums"], keepdims=0),
                      helper.make_node("Gemm", ["block_sums", "offsets"], ["y_offsets"], transB=1),
                      helper.make_node("Add", ["y_codes", "y_offsets"], ["y"])]
        graph = helper.make_graph(nodes, "projection", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])],
                                  initializer=initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        # onnxruntime reads these buffers without owning them: keep them alive as long as the session
        values = [ort.OrtValue.ortvalue_from_numpy(arrays[name]) for name in shapes]
        self._buffers = (arrays, values)
        options.add_external_initializers(list(shapes), values)
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for array in arrays.values():
            array.flush()
            release_pages(array)
        release_freed_heap()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"x": x})[0]


class SplitProjection:
    """Matrices sharing an input but stored in different kinds (float32 and compact blocks, or two block
    types): one projection per run of the same kind, outputs in the original order."""

    def __init__(self, parts: list):
        self.parts = parts
        self.nbytes = sum(p.nbytes for p in parts)

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        return [y for part in self.parts for y in part(x)]


def make_projection(matrices: list, fmt: str, threads: int = 1, int8_block: int = INT8_BLOCK):
    """The projection of `matrices` (float32 arrays or QuantizedMatrix) in weight format `fmt`."""
    if fmt == "fp32":
        return DenseProjection([as_float32(m) for m in matrices])
    if fmt == "int8":
        return Int8Projection(matrices, threads, int8_block)
    if fmt == "native":
        runs = [list(run) for _, run in groupby(matrices, key=_kind)]
        parts = [CompactProjection(run, threads) if isinstance(run[0], QuantizedMatrix) else DenseProjection(run)
                 for run in runs]
        return parts[0] if len(parts) == 1 else SplitProjection(parts)
    raise ConfigError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")


def _kind(w) -> str:
    return w.codec.name if isinstance(w, QuantizedMatrix) else "float32"
