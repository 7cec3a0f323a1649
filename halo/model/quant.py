"""Compact weights: a matrix kept in a GGUF block format, as the file's own bytes.

GGUF quantizes every row in blocks along the input dimension. Q8_0, Q4_0 and Q4_1 blocks hold 32
weights and a float16 scale d: w = d * c (int8 c), w = d * (q - 8) (4-bit q), w = d * q + m (with a
minimum m). K-quants group 256 weights in a super-block of sub-blocks with their own scales: Q4_K has
8 sub-blocks of 32 (w = d * sc_j * q - dmin * m_j, 6-bit sc_j and m_j), Q6_K 16 sub-blocks of 16
(w = d * sc_j * (q - 32), 6-bit q, int8 sc_j). A `QuantizedMatrix` keeps the blocks where they lie (a
view of the memory-mapped file) and selects rows and whole (sub-)blocks of columns lazily, so a
device's neuron groups are cut without copying: rows of W_q/W_k/W_v/W_gate/W_up and of the LM head
are free, columns of W_o/W_down are taken in whole kernel blocks (32, or 16 for Q6_K).

`kernel_blocks()` restates a selection exactly in onnxruntime's MatMulNBits terms (halo/compute/linear.py):
codes in offset binary (the kernel subtracts 2^(bits-1)), one float32 scale per kernel block, and for
the types with minimums an offset that multiplies the block's input sum:
    Q8_0: w = d * c             -> 8-bit code c + 128, scale d
    Q4_0: w = d * (q - 8)       -> 4-bit code q, scale d
    Q4_1: w = d * q + m         =  d * (q - 8) + (m + 8d): 4-bit code q, scale d, offset m + 8d
    Q4_K: per sub-block s = d * sc_j, o = -dmin * m_j: 4-bit code q, scale s, offset o + 8s
    Q6_K: per sub-block s = d * sc_j: 8-bit code q + 96 (= q - 32 + 128), scale s, blocks of 16
Other GGUF types (Q5_*, Q2_K, Q3_K, Q5_K, IQ*) have no exact MatMulNBits form here: they dequantize
through the gguf package (llama.cpp's reference code), for the fp32 and int8 formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from halo.errors import ConfigError
from halo.host.memory import release_mapping, release_pages


@dataclass(frozen=True)
class Codec:
    """A GGUF block type: `block` weights in `type_size` bytes. `bits` is its MatMulNBits width (0: none),
    run in kernel blocks of `kernel_block` weights (a K-quant's sub-block)."""

    name: str
    block: int
    type_size: int
    bits: int = 0
    has_offsets: bool = False
    kernel_block: int = 0  # 0: the block

    @property
    def native(self) -> bool:
        return self.bits > 0

    @property
    def unit(self) -> int:
        """Columns are selected in units of this many weights."""
        return self.kernel_block or self.block


KERNEL_CODECS = {c.name: c for c in (Codec("Q8_0", 32, 34, 8), Codec("Q4_0", 32, 18, 4), Codec("Q4_1", 32, 20, 4, True),
                                     Codec("Q4_K", 256, 144, 4, True, 32), Codec("Q6_K", 256, 210, 8, False, 16))}


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


def _repack_nibbles(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF's 4-bit layout (2m bytes: byte j holds weight j low, weight j + 2m high) -> MatMulNBits' packing
    (byte i holds weight 2i low, 2i + 1 high) of the low-nibble weights and of the high-nibble weights, m bytes
    each, without unpacking to a byte per code (a share's load spent a third of its time doing that)."""
    even, odd = packed[..., 0::2], packed[..., 1::2]
    return (even & 0x0F) | (odd << 4), (even >> 4) | (odd & 0xF0)


class QuantizedMatrix:
    """An (N, K) weight matrix in a GGUF block format, read-only; indexing it gives float32 rows."""

    ndim = 2
    dtype = np.dtype(np.float32)  # what it stands for: indexing dequantizes

    def __init__(self, codec: Codec, blocks: np.ndarray, rows: np.ndarray | None = None,
                 units: np.ndarray | None = None, name: str = ""):
        """blocks: uint8 [N, K / block, type_size]; rows: selected rows; units: selected column units
        (kernel blocks) in storage order; None: all."""
        if blocks.ndim != 3 or blocks.shape[2] != codec.type_size or blocks.dtype != np.uint8:
            raise ValueError(f"{codec.name} blocks must be uint8 [N, blocks, {codec.type_size}], got "
                             f"{blocks.dtype} {blocks.shape}")
        self.codec, self.blocks, self.rows, self.units = codec, blocks, rows, units
        self.name = name  # the tensor it came from, for messages

    @property
    def shape(self) -> tuple[int, int]:
        n = self.blocks.shape[0] if self.rows is None else len(self.rows)
        k = self.blocks.shape[1] * self.codec.block if self.units is None else len(self.units) * self.codec.unit
        return n, k

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """The file bytes of the selection (a share of a super-block for a K-quant column selection)."""
        n, k = self.shape
        return n * k * self.codec.type_size // self.codec.block

    def __repr__(self) -> str:
        return f"QuantizedMatrix({self.codec.name}, shape={self.shape})"

    def take_rows(self, rows) -> "QuantizedMatrix":
        """Rows of the matrix, lazily (no bytes move until they are used)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 1 or (len(rows) and (rows.min() < 0 or rows.max() >= len(self))):
            raise IndexError(f"rows must be a 1-D selection within 0..{len(self) - 1}")
        return QuantizedMatrix(self.codec, self.blocks, rows if self.rows is None else self.rows[rows], self.units,
                               self.name)

    def take_cols(self, cols) -> "QuantizedMatrix":
        """Columns of the matrix, which must be whole kernel blocks (lazily)."""
        cols = np.asarray(cols, dtype=np.int64)
        u = self.codec.unit
        starts = cols[::u]
        if len(cols) == 0 or len(cols) % u or np.any(starts % u) \
                or np.any(cols.reshape(-1, u) != starts[:, None] + np.arange(u)):
            raise ConfigError(f"{self.name or 'a matrix'}: these {len(cols)} columns split {self.codec.name} blocks "
                              f"of {u}: a neuron group boundary must fall on a block boundary (run this layout with "
                              "--weights fp32 or int8)")
        ids = starts // u
        return QuantizedMatrix(self.codec, self.blocks, self.rows, ids if self.units is None else self.units[ids],
                               self.name)

    def columns_float32(self, cols) -> np.ndarray:
        """Float32 columns (any selection): dequantizes only the blocks they touch."""
        cols = np.asarray(cols, dtype=np.int64)
        u = self.codec.unit
        touched = np.unique(cols // u)
        whole = (touched[:, None] * u + np.arange(u)).ravel()
        return np.ascontiguousarray(self.take_cols(whole).dequantize()[:, np.searchsorted(whole, cols)])

    def _stored(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(the storage blocks the selection touches [n, nb, type_size]: a view when nothing is selected,
        the selected units' positions within them or None for all)."""
        blocks = self.blocks if self.rows is None else self.blocks[_as_index(self.rows)]
        if self.units is None:
            return blocks, None
        per = self.codec.block // self.codec.unit
        touched = np.unique(self.units // per)
        local = np.searchsorted(touched, self.units // per) * per + self.units % per
        return blocks[:, _as_index(touched)], local

    def dequantize(self) -> np.ndarray:
        """The float32 matrix (llama.cpp's dequantization of the stored blocks)."""
        n, k = self.shape
        out = np.empty((n, k), dtype=np.float32)
        u = self.codec.unit
        for start in range(0, n, 4096):  # bounded temporaries for large matrices
            part = self.take_rows(np.arange(start, min(n, start + 4096)))
            blocks, local = part._stored()
            values = _dequantize(self.codec, blocks)
            if local is not None:
                values = values.reshape(len(values), -1, u)[:, local].reshape(len(values), -1)
            out[start:start + 4096] = values
        return out

    def __getitem__(self, index) -> np.ndarray:
        """Float32 rows (an embedding lookup dequantizes only the rows it reads)."""
        rows = np.arange(len(self))[index]
        if np.ndim(rows) == 0:
            return self.take_rows([rows]).dequantize()[0]
        return self.take_rows(np.ravel(rows)).dequantize().reshape(*np.shape(rows), -1)

    def kernel_blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(codes [n, units, unit * bits / 8] uint8, scales [n, units] float32, offsets [n, units] float32 or
        None): the selection exactly as MatMulNBits computes it (see the module docstring)."""
        c = self.codec
        if not c.native:
            raise ConfigError(f"unsupported type {c.name} in tensor {self.name or '?'} for --weights native: halo's "
                              "4/8-bit kernels run Q4_0, Q4_1, Q8_0, Q4_K and Q6_K blocks; use --weights int8 or fp32 "
                              "(dequantized at load), or re-quantize the file to one of those")
        blocks, local = self._stored()
        codes, scales, offsets = _kernel_form(c, blocks)
        if local is not None:
            codes, scales = codes[:, local], scales[:, local]
            offsets = None if offsets is None else offsets[:, local]
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


def _kernel_form(codec: Codec, blocks: np.ndarray):
    """Storage blocks [n, nb, type_size] -> (codes [n, units, unit * bits / 8] uint8 as MatMulNBits packs them,
    scales [n, units], offsets [n, units] or None), per kernel block."""
    n = blocks.shape[0]
    if codec.name == "Q8_0":
        return blocks[..., 2:] ^ np.uint8(0x80), _f16(blocks, 0), None  # int8 two's complement -> offset binary
    if codec.name in ("Q4_0", "Q4_1"):
        header = 4 if codec.has_offsets else 2
        scales = _f16(blocks, 0)
        offsets = _f16(blocks, 2) + np.float32(8.0) * scales if codec.has_offsets else None
        return np.concatenate(_repack_nibbles(blocks[..., header:]), axis=-1), scales, offsets
    if codec.name == "Q4_K":
        d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
        sc, m = _k4_scales_mins(blocks[..., 4:16])  # [n, nb, 8] each
        qs = blocks[..., 16:].reshape(n, -1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low) and 2c + 1 (high)
        codes = np.stack(_repack_nibbles(qs), axis=3).reshape(n, -1, 16)
        scales = (d * sc).reshape(n, -1)
        return codes, scales, (-(dmin * m)).reshape(n, -1) + np.float32(8.0) * scales
    if codec.name == "Q6_K":
        ql, qh = blocks[..., :128].reshape(n, -1, 2, 64), blocks[..., 128:192].reshape(n, -1, 2, 32)
        low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
        high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
        q = (low | (high << 4)).reshape(n, -1, 16)  # 6-bit values, 16 sub-blocks of 16 per super-block
        scales = _f16(blocks, 208)[..., None] * blocks[..., 192:208].view(np.int8)
        return q + np.uint8(96), scales.reshape(n, -1).astype(np.float32), None
    raise ConfigError(f"{codec.name} has no kernel form")


def _k4_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> eight 6-bit scales and eight 6-bit minimums (llama.cpp's get_scale_min_k4)."""
    q = packed.astype(np.uint8)
    sc_low, m_low = q[..., 0:4] & 63, q[..., 4:8] & 63
    sc_high = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    m_high = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return (np.concatenate([sc_low, sc_high], axis=-1).astype(np.float32),
            np.concatenate([m_low, m_high], axis=-1).astype(np.float32))


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


def embed(table: Weight, tokens: np.ndarray) -> np.ndarray:
    """Float32 rows of an embedding table [len(tokens), D]. A compact table is dequantized a row at a time from the
    file mapping, and the pages that read mapped are handed back at once: the kernel maps whole page-cache folios
    around each row read, so a generation's lookups would otherwise make the table resident bit by bit (all of it
    over a long one: 30 MB for SmolLM2, whose tied LM head already holds its own copy)."""
    if isinstance(table, QuantizedMatrix):
        rows = table[tokens]
        release_pages(table.blocks)
        return rows
    return np.array(table[tokens], dtype=np.float32)


def as_float32(w: Weight) -> np.ndarray:
    """A float32 matrix for either kind of weight (compact ones dequantized)."""
    return w.dequantize() if isinstance(w, QuantizedMatrix) else w
