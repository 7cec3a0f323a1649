"""Weight formats: how a block's projection matrices are stored and multiplied.

A `Projection` holds one or more matrices that read the same input (q/k/v, gate/up) and returns
one output per matrix. Three formats:

- "native" (the default): the model file's own format. Float32/float16/bfloat16 checkpoints run as
  "fp32"; GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks (halo/model/quant.py) run exactly as stored: 4/8-bit codes,
  one scale per 32 (Q6_K: 16) weights, plus minimums where the type has them, never expanded to
  float32. Activations are quantized per block to int8 in two terms (x = hi + lo: within ~1/64516 of each
  block's range) and multiplied with integer dot products: by halo's C kernel (halo/_nbits.c: AVX-512 VNNI or
  AVX2) where the package was built with a compiler and the CPU has one of those, else by onnxruntime's
  MatMulNBits (`projection_kernel`).
- "fp32": float32 arrays (memory maps stay memory maps: zero-copy; compact weights dequantized at
  load: the exact reference), numpy BLAS.
- "int8": per-block symmetric int8 weights (128 inputs per block, one float32 scale each: 1.03
  bytes per weight), run with int8 activations in one term (accuracy_level 4), by the same kernels.

Matrices that share an input are fused into one kernel call.
"""

from __future__ import annotations

import math
import mmap
import tempfile
from dataclasses import dataclass
from itertools import groupby

import numpy as np

from halo.errors import ConfigError
from halo.host.memory import memory_limit, release_freed_heap, release_pages, weight_pages
from halo.model.quant import QuantizedMatrix, as_float32

FORMATS = ("native", "fp32", "int8")
PREFER_C_KERNEL = True  # False: MatMulNBits sessions even where halo._nbits is built (bench_engine's comparison)
NATIVE_SPLIT_ACTIVATIONS = True  # False: one int8 pass (the ablation in eval/accuracy_gguf.py --single-pass)
INT8_BLOCK = 128  # inputs per scale; 128 streams ~10 % faster than 64 in MatMulNBits here
MIN_INT8_BLOCK = 16  # MatMulNBits' smallest block


def int8_block_for(column_group: int) -> int:
    """The largest block (<= INT8_BLOCK) that divides a column group, so that a shard holding some of
    the groups quantizes them exactly as the whole matrix does (W_o columns come in heads)."""
    return max(MIN_INT8_BLOCK, math.gcd(INT8_BLOCK, column_group))


def resolve_format(fmt: str, weights) -> str:
    """The weight format a --weights value means for these weights: "native" on a model without quantized
    blocks is "fp32" (what every float checkpoint computes in), so the cluster and reports say so."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return "fp32" if fmt == "native" and not weights.compact else fmt


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


@dataclass(frozen=True)
class KernelSpec:
    """How a MatMulNBits kernel stores and computes: `bits`-wide codes in blocks of `block` inputs, one float32
    scale each (+ an offset per block: Q4_1's minimums); accuracy_level 4 = int8 activations (what halo's C kernel
    computes, `_NBitsKernel.in_c`), 1 = float32 ones (MatMulNBits only: the tests' reference). With
    split_activations, x = hi + lo: hi is x quantized per block as the kernel quantizes it (so the kernel
    reproduces it exactly) and lo the residual, run as 2T rows of one call (the weights stream once) and
    added: the activations' rounding error falls from 1/254 to ~1/64516 of each block's range."""

    bits: int
    block: int
    with_offsets: bool = False
    accuracy_level: int = 4
    split_activations: bool = False


class KernelProjection:
    """Matrices sharing an input, fused into MatMulNBits calls: rows stacked, split into kernels of at most
    MAX_KERNEL_BYTES of codes, so a kernel's transient copy while onnxruntime repacks it stays small next to
    the model. `fill(rows, codes, scales, offsets)` writes a run of rows in the kernel's terms.

    open_session=False prepares the kernels' weights without opening their sessions: a block graph
    (halo/compute/block_graph.py) takes a projection with one kernel into its own session; `open()` opens them."""

    MAX_KERNEL_BYTES = 32 << 20

    def __init__(self, matrices: list, threads: int, spec: KernelSpec, fill, open_session: bool = True):
        k = matrices[0].shape[1]
        if any(m.shape[1] != k for m in matrices):
            raise ValueError("fused matrices must share their input size")
        bounds = np.concatenate([[0], np.cumsum([m.shape[0] for m in matrices])]).tolist()
        self.outputs = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        n = bounds[-1]
        row_bytes = -(-k // spec.block) * spec.block * spec.bits // 8
        rows_per_kernel = max(1, self.MAX_KERNEL_BYTES // row_bytes)
        stacked = _RowStack(matrices)
        self.kernels = [_NBitsKernel(stacked, start, min(n, start + rows_per_kernel), k, spec, fill, threads)
                        for start in range(0, n, rows_per_kernel)]
        if open_session:
            self.open()

    @property
    def nbytes(self) -> int:
        """The weights' bytes as held: as prepared until opened, then what the C kernel keeps (float16 scales where
        exact) or what was handed to onnxruntime (which holds its own packed copy)."""
        return sum(kernel.nbytes for kernel in self.kernels)

    def open(self) -> None:
        """Open each kernel's own session (once)."""
        for kernel in self.kernels:
            kernel.open()

    @property
    def row_by_row(self) -> bool:
        """Whether each row of x gets the bits it would get alone (halo's C kernel: activations quantized per row)."""
        return all(kernel.in_c for kernel in self.kernels)

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        outputs = [kernel(x) for kernel in self.kernels]
        y = outputs[0] if len(outputs) == 1 else np.concatenate(outputs, axis=1)
        return [y[:, s] for s in self.outputs]


class Int8Projection(KernelProjection):
    """Float32 matrices (or compact ones, dequantized a chunk at a time) quantized to per-block int8,
    run with int8 activations (accuracy_level 4)."""

    def __init__(self, matrices: list, threads: int = 1, block: int = INT8_BLOCK, open_session: bool = True):
        k = matrices[0].shape[1]
        while block > MIN_INT8_BLOCK and -k % block > k // 16:
            block //= 2  # small inputs (tiny models): a smaller block instead of > 6 % zero padding

        def fill(rows, codes, scales, offsets):
            quantize_int8(rows, block, out=(codes, scales))

        super().__init__(matrices, threads, KernelSpec(8, block), fill, open_session)


class CompactProjection(KernelProjection):
    """GGUF block matrices (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) run on their own blocks: the file's codes and scales, exactly
    (halo/model/quant.py), never expanded to float32, with int8 activations in two terms (KernelSpec; SmolLM2's logits
    stay within 0.016 of the dequantized float32 model's over 19k tokens, eval/results/accuracy_gguf_*): by halo's
    C kernel where the package has it and the CPU a vector path (DequantKernel: the file's bytes in memory), else
    by MatMulNBits sessions (one onnxruntime graph per block share). accuracy_level=1: MatMulNBits with float32
    activations (the tests' reference)."""

    def __init__(self, matrices: list[QuantizedMatrix], threads: int = 1, accuracy_level: int | None = None,
                 open_session: bool = True):
        codec = matrices[0].codec
        if any(m.codec != codec for m in matrices):
            raise ValueError("fused compact matrices must share their block type")
        if not codec.native:
            matrices[0].kernel_blocks()  # raises the error that names the type, the tensor and the fix

        def fill(rows: QuantizedMatrix, codes, scales, offsets):
            codes[:], scales[:], rows_offsets = rows.kernel_blocks()
            if offsets is not None:
                offsets[:] = rows_offsets
            rows.release()

        level = 4 if accuracy_level is None else accuracy_level
        super().__init__(matrices, threads, KernelSpec(codec.bits, codec.unit, codec.has_offsets, level,
                                                       split_activations=level == 4 and NATIVE_SPLIT_ACTIVATIONS), fill,
                         open_session)


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
    """One MatMulNBits kernel over rows start..stop of a row stack: its weights, and (once opened) what computes it:
    an onnxruntime session, or where halo's C kernel is built (`in_c`), a DequantKernel.

    The codes, scales (and offsets) are written to an unlinked temporary file; onnxruntime takes them as external
    initializers and repacks them into its own layout at session start (a DequantKernel packs them into its own
    layout, `pack`, in pages of its own), after which the file pages are released from this process (they
    re-read from disk if ever touched again).
    """

    def __init__(self, stack: _RowStack, start: int, stop: int, k: int, spec: KernelSpec, fill, threads: int):
        self.k, self.n, self.spec, self.threads = k, stop - start, spec, threads
        blocks = -(-k // spec.block)
        shapes = {"codes": ((self.n, blocks, spec.block * spec.bits // 8), np.uint8),
                  "scales": ((self.n, blocks), np.float32)}
        if spec.with_offsets:
            shapes["offsets"] = ((self.n, blocks), np.float32)
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in shapes.values()]
        with tempfile.TemporaryFile(prefix="halo-kernel-") as file:  # one mapping; its own descriptor outlives the file
            file.truncate(sum(sizes))
            self._mapping = mmap.mmap(file.fileno(), sum(sizes))
        self.weights, at = {}, 0  # onnxruntime reads these without owning them: they live as long as the kernel
        for (name, (shape, dtype)), size in zip(shapes.items(), sizes):
            self.weights[name] = np.frombuffer(self._mapping, dtype=dtype, count=size // np.dtype(dtype).itemsize,
                                               offset=at).reshape(shape)
            at += size
        offsets = self.weights.get("offsets")
        for first, rows in stack.pieces(start, stop):
            end = first + rows.shape[0]
            fill(rows, self.weights["codes"][first:end], self.weights["scales"][first:end],
                 None if offsets is None else offsets[first:end])
        self.nbytes = sum(sizes)
        self.session = None

    @property
    def in_c(self) -> bool:
        """Computed by halo's C kernel (int8 activations, and the package has it), not a MatMulNBits session;
        such a kernel never enters a block graph."""
        return self.spec.accuracy_level == 4 and projection_kernel() == "halo._nbits"

    def open(self) -> None:
        if self.session is None:
            if self.in_c:
                kernel = DequantKernel.copy_of(self)
                self.session, self._call, self.nbytes = kernel, kernel, kernel.nbytes
                self.weights = self._mapping = None  # the temporary file goes with its last view: nothing reads it
                release_freed_heap()
                return
            graph = GraphBuilder()
            self.add_to(graph, "", "x", "y")
            self.session = graph.session({"x": ("T", self.k)}, {"y": ("T", self.n)}, self.threads)
            self._call = lambda x: self.session.run({"x": x})[0]
            self.release()

    def add_to(self, graph: "GraphBuilder", prefix: str, x: str, y: str) -> None:
        """Append y = x @ W.T to a graph (weights named with `prefix`), see KernelSpec."""
        add_nbits_matmul(graph, prefix, x, y, self.k, self.n, self.spec, self.weights)

    def release(self) -> None:
        """onnxruntime has its own packed copy: drop the weights' pages from the process. No msync first: the page
        cache keeps what they hold (writeback runs in the background), and a synchronous flush made every share's
        load wait for its whole size to reach the disk (0.7 s of a 3.3 s quarter-share of a 1.1B model in Q4_0)."""
        self._mapping.madvise(mmap.MADV_DONTNEED)
        release_freed_heap()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self._call(x)


try:  # the C kernel for compact groups (built with the package where a C compiler is; numpy computes otherwise)
    from halo import _nbits
except ImportError:  # pragma: no cover - depends on how the package was built
    _nbits = None

COMPACT_KERNEL = "numpy" if _nbits is None else "halo._nbits"  # what computes compact groups (agents report it)
# Whether the C kernel has a vector path on this CPU (AVX2 or AVX-512 VNNI). Without one (aarch64 today) its plain C
# sums run ~1 GB/s of codes, and MatMulNBits' NEON / SSE kernels compute the projections instead; compact groups
# of a memory-bounded device stay on the C kernel either way (no session per group).
C_KERNEL_VECTORIZED = _nbits is not None and _nbits.paths()[-1] != "scalar"


def projection_kernel() -> str:
    """What computes compact projections built now (agents report it): halo's C kernel, or onnxruntime."""
    return "halo._nbits" if C_KERNEL_VECTORIZED and PREFER_C_KERNEL else "onnxruntime"


TILE_ROWS = 16  # rows per tile of the C kernel's layout (halo/_nbits.c)


def packed_shape(n: int, blocks: int, block_bytes: int, scale_bytes: int, offsets: bool) -> tuple[int, int, int]:
    """[tiles, blocks, unit] of `pack`'s array: a unit is one block of a 16-row tile (its codes, then its scales, then
    its offsets)."""
    return -(-n // TILE_ROWS), blocks, block_bytes * TILE_ROWS + TILE_ROWS * scale_bytes * (2 if offsets else 1)


def pack(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None,
         into: np.ndarray | None = None) -> np.ndarray:
    """MatMulNBits arrays (codes [n, blocks, block bytes] uint8; scales and offsets [n, blocks], float32 or float16)
    in the C kernel's order of reading, one array (halo/_nbits.c): [tiles, blocks, unit] uint8, a unit = one block of
    16 rows: their codes in 4-byte words (word w: bytes 4w..4w+3 of each row, row after row), then their 16 scales,
    then their 16 offsets. A matrix is then one sequential stream (a token through SmolLM2 read its codes at ~24 GB/s
    in separate arrays, ~33 packed). Rows past n in the last tile are zeros. into: a uint8 buffer of that size."""
    n, blocks, block_bytes = codes.shape
    shape = packed_shape(n, blocks, block_bytes, scales.itemsize, offsets is not None)
    tiles, whole = shape[0], n // TILE_ROWS  # whole tiles, then (n % 16 rows) a last one padded with zeros
    out = np.empty(shape, np.uint8) if into is None else into.reshape(shape)
    # strided copies into views of `out` (no temporary the size of the matrix: an LM head is ~30 MB)
    code_bytes = block_bytes * TILE_ROWS
    by_tile = out[:, :, :code_bytes].reshape(tiles, blocks, block_bytes // 4, TILE_ROWS, 4)
    by_tile[:whole] = (codes[:whole * TILE_ROWS].reshape(whole, TILE_ROWS, blocks, block_bytes // 4, 4)
                       .transpose(0, 2, 3, 1, 4))
    columns = [scales] + ([offsets] if offsets is not None else [])
    at = code_bytes
    for values in columns:
        part = out[:, :, at:at + TILE_ROWS * scales.itemsize].view(scales.dtype)  # [tiles, blocks, 16]
        part[:whole] = values[:whole * TILE_ROWS].reshape(whole, TILE_ROWS, blocks).transpose(0, 2, 1)
        at += TILE_ROWS * scales.itemsize
    if whole < tiles:
        last = slice(whole * TILE_ROWS, n)
        tail = pack(np.pad(codes[last], ((0, TILE_ROWS - (n - whole * TILE_ROWS)), (0, 0), (0, 0))),
                    *(np.pad(v[last], ((0, TILE_ROWS - (n - whole * TILE_ROWS)), (0, 0))) if v is not None else None
                      for v in (scales, offsets)))
        out[whole:] = tail
    return out


def unpack(packed: np.ndarray, n: int, block_bytes: int, dtype, offsets: bool):
    """`pack`'s inverse: (codes [n, blocks, block bytes], scales [n, blocks], offsets or None), copies."""
    tiles, blocks, _ = packed.shape
    dtype = np.dtype(dtype)
    codes = (packed[:, :, :block_bytes * TILE_ROWS].reshape(tiles, blocks, block_bytes // 4, TILE_ROWS, 4)
             .transpose(0, 3, 1, 2, 4).reshape(tiles * TILE_ROWS, blocks, block_bytes)[:n])
    values, at = [], block_bytes * TILE_ROWS
    for _ in range(2 if offsets else 1):
        tile = np.ascontiguousarray(packed[:, :, at:at + TILE_ROWS * dtype.itemsize]).view(dtype)  # [tiles, blocks, 16]
        values.append(tile.transpose(0, 2, 1).reshape(tiles * TILE_ROWS, blocks)[:n])
        at += TILE_ROWS * dtype.itemsize
    return codes, values[0], values[1] if offsets else None


class DequantKernel:
    """A kernel's weights (codes, scales and offsets in MatMulNBits terms: weight = (code - 2^(bits-1)) x scale
    [+ offset], per block) computed straight from the codes: every compact projection where the package has halo's
    C kernel (`_NBitsKernel.in_c`), and HALO's re-mapped groups on a memory-bounded device (halo/compute/remap.py). Holding
    one costs exactly its compact bytes and making one costs nothing beyond having the arrays; a one-group
    onnxruntime session takes ~10 ms to build and holds 2-3x its weights.

    It computes what its KernelSpec says MatMulNBits computes: activations quantized per block to int8, in two terms
    with split_activations (x = hi + lo, see KernelSpec), times the weights' codes as exact integer sums (halo's C
    kernel: AVX-512 VNNI, AVX2 or plain C, the same bits on each). The weights are one array in the order the kernel
    reads them (`pack`: 16-row tiles, each block's codes, scales and offsets together); scales and offsets may be
    float16 (GGUF's own: the file's bytes, not 1.2x them). Where the package was built without a C compiler, numpy
    computes the same sums in float32 (expanding the codes a few thousand rows at a time)."""

    NUMPY_ROWS = 4096  # rows per numpy step: the expanded codes of a step stay ~10 MB (an LM head whole: ~110 MB)

    def __init__(self, packed: np.ndarray, n: int, k: int, spec: KernelSpec, scale_dtype=np.float32, threads: int = 1):
        """packed: `pack`'s array of n x k weights (kept as given, e.g. a read buffer's view); scale_dtype: its scales'
        and offsets' (float32 or float16). threads: the C kernel's, splitting the rows (same results)."""
        scale_dtype = np.dtype(scale_dtype)
        if spec.bits not in (4, 8) or scale_dtype not in (np.float32, np.float16):
            raise ValueError(f"{spec} with {scale_dtype} scales: the kernel takes 4/8-bit codes, float32/16 scales")
        units = -(-k // spec.block)
        self.block_bytes = spec.block * spec.bits // 8
        want = packed_shape(n, units, self.block_bytes, scale_dtype.itemsize, spec.with_offsets)
        if packed.dtype != np.uint8 or packed.shape != want:
            raise ValueError(f"packed kernel array {packed.dtype} {packed.shape} does not hold {n} x {k} weights of "
                             f"{spec} with {scale_dtype} scales ({want} uint8)")
        if spec.accuracy_level != 4:
            raise ValueError(f"{spec}: halo's kernels compute int8 activations (accuracy_level 4)")
        self.packed, self.n, self.k, self.spec, self.scale_dtype = packed, n, k, spec, scale_dtype
        self.threads = threads
        self.terms = 2 if spec.split_activations else 1
        self.nbytes = packed.nbytes
        # what halo/_nbits.c takes (matmul, and the decode steps' projections)
        self.c_weight = (packed, n, spec.bits, spec.block, scale_dtype == np.float16, spec.with_offsets, self.terms)
        self.padded = units * spec.block != k  # the last block's padding (int8 of small models): zero inputs

    def arrays(self):
        """(codes [n, blocks, block bytes], scales [n, blocks], offsets or None): MatMulNBits' layout, copies."""
        return unpack(self.packed, self.n, self.block_bytes, self.scale_dtype, self.spec.with_offsets)

    @staticmethod
    def scale_dtype_for(kernel: "_NBitsKernel") -> np.dtype:
        """float16 where it holds every scale and offset exactly (a GGUF's Q4_0 / Q8_0 scales are float16 in the file,
        and Q4_1's MatMulNBits offsets, minimum + 8 x scale, mostly are: all but 2 of SmolLM2's 121 kernels), else
        float32."""
        values = [kernel.weights[name] for name in ("scales", "offsets") if name in kernel.weights]
        exact = all(np.array_equal(v.astype(np.float16).astype(np.float32), v) for v in values)
        return np.dtype(np.float16 if exact else np.float32)

    @staticmethod
    def nbytes_for(kernel: "_NBitsKernel", scale_dtype) -> int:
        """The bytes `copy_of(kernel)` takes with these scales."""
        codes = kernel.weights["codes"]
        return math.prod(packed_shape(kernel.n, codes.shape[1], codes.shape[2], np.dtype(scale_dtype).itemsize,
                                      "offsets" in kernel.weights))

    @classmethod
    def copy_of(cls, kernel: "_NBitsKernel", into: np.ndarray | None = None, scale_dtype=None) -> "DequantKernel":
        """The weights of a prepared (unopened) kernel, packed out of its temporary file into `into` (a uint8 buffer
        of `nbytes_for(kernel, scale_dtype)`) or pages of its own; scale_dtype None: `scale_dtype_for(kernel)`."""
        dtype = np.dtype(scale_dtype or cls.scale_dtype_for(kernel))
        w = kernel.weights
        arrays = [w["codes"], w["scales"].astype(dtype), w["offsets"].astype(dtype) if "offsets" in w else None]
        buffer = weight_pages(cls.nbytes_for(kernel, dtype)) if into is None else into
        return cls(pack(*arrays, into=buffer), kernel.n, kernel.k, kernel.spec, dtype, kernel.threads)

    def __call__(self, x: np.ndarray, native: bool = True) -> np.ndarray:
        """x [T, k] -> x @ W.T [T, n] (`native=False`: numpy's sums, whatever was built)."""
        spec, units = self.spec, -(-self.k // self.spec.block)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.padded:
            x = np.pad(x, ((0, 0), (0, units * spec.block - self.k)))
        t = len(x)
        out = np.empty((t, self.n), np.float32)
        if native and _nbits is not None:
            _nbits.matmul(self.c_weight, x, out, self.threads)
            return out
        codes, scales, offsets = self.arrays()
        zero_point = np.float32(1 << (spec.bits - 1))
        blocks = x.reshape(t, units, spec.block)
        x_sums = blocks.sum(axis=2)  # [T, blocks]: the offsets meet the inputs themselves
        blocks = quantized_activations(blocks, self.terms).transpose(1, 0, 2)  # [blocks, T, block]
        codes_by_byte = codes.transpose(1, 2, 0)  # [blocks, block bytes, n]: byte i of a block for every row
        if spec.bits == 4:  # byte i of a block: input 2i's weight in the low nibble, 2i + 1's in the high one
            even, odd = np.ascontiguousarray(blocks[..., 0::2]), np.ascontiguousarray(blocks[..., 1::2])
        else:
            blocks = np.ascontiguousarray(blocks)
        for start in range(0, self.n, self.NUMPY_ROWS):
            rows = slice(start, start + self.NUMPY_ROWS)
            chunk = codes_by_byte[..., rows]
            if spec.bits == 4:
                dots = np.matmul(even, (chunk & 0x0F).astype(np.float32))
                dots += np.matmul(odd, (chunk >> 4).astype(np.float32))
            else:
                dots = np.matmul(blocks, chunk.astype(np.float32))  # [blocks, T, rows]
            row_scales = scales[rows].T.astype(np.float32)  # [blocks, rows]
            dots *= row_scales[:, None, :]
            y = dots.sum(axis=0) - (zero_point * blocks.sum(axis=2).T) @ row_scales
            if offsets is not None:
                y += x_sums @ offsets[rows].T.astype(np.float32)
            out[:, rows] = y
        return out


def quantized_activations(blocks: np.ndarray, terms: int) -> np.ndarray:
    """x [..., block] as the kernels see it (float32): per block, q1 = rint(x / d1) with d1 = max|x| / 127, and with
    two terms the residual quantized the same way: q1 d1 + q2 d2 (see halo/_nbits.c, KernelSpec)."""
    residual, seen = blocks.astype(np.float32), np.zeros(blocks.shape, np.float32)
    for _ in range(terms):
        step = np.maximum(np.abs(residual).max(axis=-1, keepdims=True) / np.float32(127), np.float32(1e-30))
        part = np.rint(residual / step) * step
        seen += part
        residual = residual - part
    return seen


class GraphBuilder:
    """The nodes and initializers of one onnxruntime graph; weight arrays enter as in-memory external
    initializers (no copy into the model), and `session` opens it on one or `threads` CPU threads."""

    def __init__(self):
        from onnx import helper

        self.nodes, self.initializers, self.external = [], [], {}
        self._helper = helper

    def constant(self, name: str, values, dtype=np.int64) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        from onnx import TensorProto, helper

        proto_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor = TensorProto(name=name, data_type=proto_type, dims=array.shape, data_location=TensorProto.EXTERNAL)
        tensor.external_data.add(key="location", value="in-memory")  # supplied as OrtValues
        self.initializers.append(tensor)
        self.external[name] = array
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str] | str, domain: str | None = None, **attributes):
        outputs = [outputs] if isinstance(outputs, str) else outputs
        self.nodes.append(self._helper.make_node(op, inputs, outputs, domain=domain, **attributes))
        return outputs[0] if len(outputs) == 1 else outputs

    def model(self, inputs: dict, outputs: dict):
        """inputs/outputs: name -> shape (float32; strings are symbolic dimensions)."""
        from onnx import TensorProto, helper

        def info(name, shape):
            return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))

        graph = helper.make_graph(self.nodes, "halo", [info(n, s) for n, s in inputs.items()],
                                  [info(n, s) for n, s in outputs.items()], initializer=self.initializers)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                       helper.make_opsetid("com.microsoft", 1)])

    def session(self, inputs: dict, outputs: dict, threads: int = 1) -> "GraphSession":
        import onnxruntime as ort

        options = session_options(threads)
        values = [ort.OrtValue.ortvalue_from_numpy(array) for array in self.external.values()]
        options.add_external_initializers(list(self.external), values)
        session = ort.InferenceSession(self.model(inputs, outputs).SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        return GraphSession(session, values)


def session_options(threads: int = 1):
    """onnxruntime options for halo's sessions: `threads` intra-op threads that sleep between calls, quiet logs. Under
    a cgroup memory limit, no memory arena: an arena keeps its largest run's buffers for good (a 30-token prefill grew
    a SmolLM2 agent's attention, LM-head and predictor sessions by 22 MB, which its HALO group cache then gave up);
    without one, a run's buffers go back when it ends."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    options.enable_cpu_mem_arena = memory_limit() is None
    return options


class GraphSession:
    """An onnxruntime session and the OrtValues of its external weights (it reads them, it does not own them)."""

    def __init__(self, session, values):
        self._session, self._values = session, values

    def run(self, feeds: dict) -> list[np.ndarray]:
        return self._session.run(None, feeds)


def add_nbits_matmul(graph: GraphBuilder, prefix: str, x: str, y: str, k: int, n: int, spec: KernelSpec,
                     weights: dict) -> None:
    """y = x @ W.T around MatMulNBits (see KernelSpec); `weights`: "codes", "scales" (and "offsets") arrays,
    entering the graph as prefix + that name; every intermediate name starts with `prefix` too."""
    p = prefix
    codes, scales = graph.weight(p + "codes", weights["codes"]), graph.weight(p + "scales", weights["scales"])
    node, const = graph.node, graph.constant
    blocks = -(-k // spec.block)
    if spec.split_activations or spec.with_offsets:
        x_blocks = node("Reshape", [x, const(p + "block_shape", [-1, blocks, spec.block])], p + "x_blocks")
    kernel_input = x
    if spec.split_activations:  # x = hi + lo, one kernel call on [hi; lo], the two halves added
        amax = node("ReduceMax", [node("Abs", [x_blocks], p + "x_abs")], p + "x_amax", axes=[2], keepdims=1)
        step = node("Max", [node("Div", [amax, const(p + "int8_max", 127.0, np.float32)], p + "x_step"),
                            const(p + "tiny", 1e-30, np.float32)], p + "x_step_safe")
        codes_x = node("Round", [node("Div", [x_blocks, step], p + "x_steps")], p + "x_codes")
        hi = node("Reshape", [node("Mul", [codes_x, step], p + "hi_blocks"), const(p + "row_shape", [-1, k])], p + "hi")
        kernel_input = node("Concat", [hi, node("Sub", [x, hi], p + "lo")], p + "hi_lo", axis=0)
    codes_output = p + "y_codes" if spec.with_offsets else y  # x @ (scaled codes).T
    kernel_output = p + "y_halves_flat" if spec.split_activations else codes_output
    node("MatMulNBits", [kernel_input, codes, scales], kernel_output, domain="com.microsoft",
         K=k, N=n, bits=spec.bits, block_size=spec.block, accuracy_level=spec.accuracy_level)
    if spec.split_activations:
        halves = node("Reshape", [kernel_output, const(p + "halves_shape", [2, -1, n])], p + "y_halves")
        node("ReduceSum", [halves, const(p + "first_axis", [0])], codes_output, keepdims=0)
    if spec.with_offsets:  # y += block_sums(x) @ offsets.T
        sums = node("ReduceSum", [x_blocks, const(p + "sum_axis", [2])], p + "block_sums", keepdims=0)
        y_offsets = node("Gemm", [sums, graph.weight(p + "offsets", weights["offsets"])], p + "y_offsets", transB=1)
        node("Add", [codes_output, y_offsets], y)


class SplitProjection:
    """Matrices sharing an input but stored in different kinds (float32 and compact blocks, or two block
    types): one projection per run of the same kind, outputs in the original order."""

    def __init__(self, parts: list):
        self.parts = parts
        self.nbytes = sum(p.nbytes for p in parts)

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        return [y for part in self.parts for y in part(x)]


def make_projection(matrices: list, fmt: str, threads: int = 1, int8_block: int = INT8_BLOCK,
                    open_session: bool = True):
    """The projection of `matrices` (float32 arrays or QuantizedMatrix) in weight format `fmt`.
    open_session=False: a kernel projection is returned with its weights prepared and its sessions not opened
    (for a block graph; see KernelProjection); every other projection is ready to call."""
    if fmt == "fp32":
        return DenseProjection([as_float32(m) for m in matrices])
    if fmt == "int8":
        return Int8Projection(matrices, threads, int8_block, open_session)
    if fmt == "native":
        runs = [list(run) for _, run in groupby(matrices, key=_kind)]
        defer = not open_session and len(runs) == 1
        parts = [CompactProjection(run, threads, open_session=not defer) if isinstance(run[0], QuantizedMatrix)
                 else DenseProjection(run) for run in runs]
        return parts[0] if len(parts) == 1 else SplitProjection(parts)
    raise ConfigError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")


def _kind(w) -> str:
    return w.codec.name if isinstance(w, QuantizedMatrix) else "float32"
