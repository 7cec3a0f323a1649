"""Compact weights: a matrix kept in a GGUF block format, as the file's own bytes.

GGUF quantizes every row in blocks along the input dimension: 32 weights share a float16 scale d.
Q8_0 stores int8 codes c (w = d * c); Q4_0 4-bit codes q (w = d * (q - 8)); Q4_1 4-bit codes, the
scale and a minimum m (w = d * q + m). A `QuantizedMatrix` keeps those blocks where they lie (a view
of the memory-mapped file) and selects rows and whole blocks of columns lazily, so a device's neuron
groups are cut without copying: rows of W_q/W_k/W_v/W_gate/W_up and of the LM head are free,
columns of W_o/W_down are taken in whole blocks.

`kernel_blocks()` restates a selection exactly in onnxruntime's MatMulNBits terms (halo/linear.py):
codes in its packing (offset binary: the kernel subtracts 2^(bits-1)), float32 scales, and for Q4_1
an offset per block that multiplies the block's input sum:
    Q8_0: w = d * c            -> 8-bit code c + 128, scale d
    Q4_0: w = d * (q - 8)      -> 4-bit code q, scale d
    Q4_1: w = d * q + m        =  d * (q - 8) + (m + 8d): 4-bit code q, scale d, offset m + 8d
Other GGUF types (K-quants, Q5_*, IQ*) have no exact MatMulNBits form here: they dequantize through
the gguf package (llama.cpp's reference code), for the fp32 and int8 formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError
from .memory import release_mapping


@dataclass(frozen=True)
class Codec:
    """A GGUF block type: `block` weights in `type_size` bytes; `bits` is its MatMulNBits width (0: none)."""

    name: str
    block: int
    type_size: int
    bits: int = 0
    has_offsets: bool = False

    @property
    def native(self) -> bool:
        return self.bits > 0


KERNEL_CODECS = {c.name: c for c in (Codec("Q8_0", 32, 34, 8), Codec("Q4_0", 32, 18, 4), Codec("Q4_1", 32, 20, 4, True))}


def codec_for(name: str) -> Codec:
    """The codec of a GGUF type name (block geometry from the gguf package for the dequantize-only types)."""
    if name in KERNEL_CODECS:
        return KERNEL_CODECS[name]
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    return Codec(name, block, type_size)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of every block, as float32 [N, nb]."""
    return blocks[..., at:at + 2].view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """GGUF's 4-bit layout -> codes in weight order: byte j holds weight j (low) and weight j + 16 (high)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Codes in weight order -> MatMulNBits' 4-bit packing: byte j holds weight 2j (low) and 2j + 1 (high)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


class QuantizedMatrix:
    """An (N, K) weight matrix in a GGUF block format, read-only; indexing it gives float32 rows."""

    ndim = 2
    dtype = np.dtype(np.float32)  # what it stands for: indexing dequantizes

    def __init__(self, codec: Codec, blocks: np.ndarray, rows: np.ndarray | None = None,
                 block_ids: np.ndarray | None = None, name: str = ""):
        if blocks.ndim != 3 or blocks.shape[2] != codec.type_size or blocks.dtype != np.uint8:
            raise ValueError(f"{codec.name} blocks must be uint8 [N, blocks, {codec.type_size}], got "
                             f"{blocks.dtype} {blocks.shape}")
        self.codec, self.blocks, self.rows, self.block_ids = codec, blocks, rows, block_ids
        self.name = name  # the tensor it came from, for messages

    @property
    def shape(self) -> tuple[int, int]:
        n = self.blocks.shape[0] if self.rows is None else len(self.rows)
        nb = self.blocks.shape[1] if self.block_ids is None else len(self.block_ids)
        return n, nb * self.codec.block

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        n, k = self.shape
        return n * (k // self.codec.block) * self.codec.type_size

    def __repr__(self) -> str:
        return f"QuantizedMatrix({self.codec.name}, shape={self.shape})"

    def take_rows(self, rows) -> "QuantizedMatrix":
        """Rows of the matrix, lazily (no bytes move until they are used)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 1 or (len(rows) and (rows.min() < 0 or rows.max() >= len(self))):
            raise IndexError(f"rows must be a 1-D selection within 0..{len(self) - 1}")
        return QuantizedMatrix(self.codec, self.blocks, rows if self.rows is None else self.rows[rows], self.block_ids,
                               self.name)

    def take_cols(self, cols) -> "QuantizedMatrix":
        """Columns of the matrix, which must be whole quantization blocks (lazily)."""
        cols = np.asarray(cols, dtype=np.int64)
        b = self.codec.block
        starts = cols[::b]
        if len(cols) == 0 or len(cols) % b or np.any(starts % b) \
                or np.any(cols.reshape(-1, b) != starts[:, None] + np.arange(b)):
            raise ConfigError(f"{self.name or 'a matrix'}: these {len(cols)} columns split {self.codec.name} blocks "
                              f"of {b}: a neuron group boundary must fall on a block boundary (run this layout with "
                              "--weights fp32 or int8)")
        ids = starts // b
        return QuantizedMatrix(self.codec, self.blocks, self.rows, ids if self.block_ids is None else self.block_ids[ids],
                               self.name)

    def columns_float32(self, cols) -> np.ndarray:
        """Float32 columns (any selection): dequantizes only the blocks they touch."""
        cols = np.asarray(cols, dtype=np.int64)
        b = self.codec.block
        touched = np.unique(cols // b)
        whole = (touched[:, None] * b + np.arange(b)).ravel()
        return np.ascontiguousarray(self.take_cols(whole).dequantize()[:, np.searchsorted(whole, cols)])

    def selected(self) -> np.ndarray:
        """The selected blocks [n, nb, type_size]: a view without a row selection, else a copy of them."""
        blocks = self.blocks if self.rows is None else self.blocks[_as_index(self.rows)]
        return blocks if self.block_ids is None else blocks[:, _as_index(self.block_ids)]

    def dequantize(self) -> np.ndarray:
        """The float32 matrix (llama.cpp's dequantization: d * c, d * (q - 8), d * q + m)."""
        n, k = self.shape
        out = np.empty((n, k), dtype=np.float32)
        for start in range(0, n, 4096):  # bounded temporaries for large matrices
            out[start:start + 4096] = _dequantize(self.codec, self.take_rows(np.arange(start, min(n, start + 4096)))
                                                  .selected())
        return out

    def __getitem__(self, index) -> np.ndarray:
        """Float32 rows (an embedding lookup dequantizes only the rows it reads)."""
        rows = np.arange(len(self))[index]
        if np.ndim(rows) == 0:
            return self.take_rows([rows]).dequantize()[0]
        return self.take_rows(np.ravel(rows)).dequantize().reshape(*np.shape(rows), -1)

    def kernel_blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(codes [n, nb, block * bits / 8] uint8, scales [n, nb] float32, offsets [n, nb] float32 or None):
        the selection exactly as MatMulNBits computes it (see the module docstring)."""
        c = self.codec
        if not c.native:
            raise ConfigError(f"unsupported type {c.name} in tensor {self.name or '?'} for --weights native: halo's "
                              "4/8-bit kernels run Q4_0, Q4_1 and Q8_0 blocks; use --weights int8 or fp32 "
                              "(dequantized at load), or re-quantize the file to Q4_0, Q4_1 or Q8_0")
        blocks = self.selected()
        scales = _f16(blocks, 0)
        if c.name == "Q8_0":
            return blocks[..., 2:] ^ np.uint8(0x80), scales, None  # int8 two's complement -> offset binary
        header = 4 if c.has_offsets else 2
        codes = _pack_nibbles(_nibbles(blocks[..., header:]))
        offsets = _f16(blocks, 2) + np.float32(8.0) * scales if c.has_offsets else None
        return codes, scales, offsets

    def release(self) -> None:
        """Drop the model file's pages from this process once a kernel holds its copy (they re-read from the
        page cache or disk on use: norms and embedding rows come back as they are read)."""
        release_mapping(self.blocks)


def _as_index(ids: np.ndarray):
    """A slice for a contiguous run (numpy then returns a view), else the index array."""
    if len(ids) and ids[-1] - ids[0] + 1 == len(ids) and np.all(np.diff(ids) == 1):
        return slice(int(ids[0]), int(ids[-1]) + 1)
    return ids


def _dequantize(codec: Codec, blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    if codec.name == "Q8_0":
        return (_f16(blocks, 0)[..., None] * blocks[..., 2:].view(np.int8)).reshape(n, -1)
    if codec.name == "Q4_0":
        return (_f16(blocks, 0)[..., None] * (_nibbles(blocks[..., 2:]).astype(np.int8) - 8)).reshape(n, -1)
    if codec.name == "Q4_1":
        return (_f16(blocks, 0)[..., None] * _nibbles(blocks[..., 4:]) + _f16(blocks, 2)[..., None]).reshape(n, -1)
    import gguf.quants

    flat = np.ascontiguousarray(blocks).reshape(n, -1)
    return gguf.quants.dequantize(flat, gguf.GGMLQuantizationType[codec.name]).astype(np.float32, copy=False)


Weight = np.ndarray | QuantizedMatrix


def as_float32(w: Weight) -> np.ndarray:
    """A float32 matrix for either kind of weight (compact ones dequantized)."""
    return w.dequantize() if isinstance(w, QuantizedMatrix) else w
