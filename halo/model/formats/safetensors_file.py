"""A memory-mapped, validating reader for .safetensors files (F32, F16, BF16).

Hand-written rather than `safetensors.numpy` because numpy has no bfloat16 (that loader refuses
BF16 files) and because agents slice rows/columns of a memory map to load only their neuron
groups, reading only those pages.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from halo.errors import ModelFormatError

DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
MAX_HEADER = 100 << 20


class SafetensorsFile:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            if not self.path.is_file():
                raise ModelFormatError(self.path, "no such safetensors file")
            size = os.path.getsize(self.path)
            if size < 8:
                raise ModelFormatError(self.path, f"truncated: {size} bytes, shorter than the 8-byte header length")
            with open(self.path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > min(MAX_HEADER, size - 8):
                    raise ModelFormatError(self.path, f"header length {header_len} exceeds the file ({size} bytes): "
                                           "truncated or not a safetensors file")
                try:
                    header = json.loads(f.read(header_len))
                except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, deep nesting
                    raise ModelFormatError(self.path, f"header is not valid JSON: {type(e).__name__}: {e}") from e
        except OSError as e:  # unreadable, a directory, a name too long for the file system ...
            raise ModelFormatError(self.path, f"cannot read it: {e.strerror or e}") from None
        if not isinstance(header, dict):
            raise ModelFormatError(self.path, "header is not a JSON object")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + header_len
        data_len = size - self.data_start
        self.entries: dict[str, tuple[str, tuple[int, ...], int]] = {}  # name -> (dtype, shape, offset)
        for name, entry in header.items():
            try:
                dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError) as e:
                raise ModelFormatError(self.path, f"tensor {name}: malformed header entry {entry!r:.200}") from e
            if not all(type(v) is int and v >= 0 for v in (*shape, begin, end)):
                raise ModelFormatError(self.path, f"tensor {name}: shape {list(shape)!r:.100} and data_offsets "
                                       f"[{begin!r:.20}, {end!r:.20}] must be non-negative integers")
            if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
                raise ModelFormatError(self.path, f"tensor {name}: dtype {str(dtype_name)[:40]} is not supported",
                                       "halo reads F32, F16 and BF16 checkpoints")
            dtype = DTYPES[dtype_name]
            expected = math.prod(shape) * dtype.itemsize
            if end - begin != expected or begin < 0 or end > data_len:
                raise ModelFormatError(self.path, f"tensor {name}: data_offsets [{begin}, {end}) do not fit shape "
                                       f"{shape} {dtype_name} ({expected} bytes) inside {data_len} data bytes "
                                       "(truncated file?)")
            self.entries[name] = (dtype_name, shape, begin)
        self._check_tiling([(entry["data_offsets"][0], entry["data_offsets"][1], name) for name, entry in header.items()],
                           data_len)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    def _check_tiling(self, ranges: list[tuple[int, int, str]], data_len: int) -> None:
        """The tensors' byte ranges cover the data exactly, each byte once, as the format requires (safetensors' own
        loader refuses the rest): a header that re-types a tensor over part of its bytes, or gives two tensors the
        same bytes, ran and printed garbage."""
        at = 0
        for begin, end, name in sorted(ranges):
            if begin != at:
                raise ModelFormatError(self.path, f"tensor {name}: its data starts at byte {begin}, the one before it "
                                       f"ends at {at} ({'overlapping' if begin < at else 'a gap'}: a damaged header)")
            at = end
        if at != data_len:
            raise ModelFormatError(self.path, f"the tensors cover {at} of the {data_len} data bytes (a damaged header, "
                                   "or bytes appended)")

    def names(self) -> list[str]:
        return list(self.entries)

    def raw(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only memory map (bfloat16 shows as uint16)."""
        dtype_name, shape, begin = self.entries[name]
        stored = DTYPES[dtype_name]
        count = math.prod(shape)
        start = self.data_start + begin
        return self._map[start:start + count * stored.itemsize].view(stored).reshape(shape)

    def is_bf16(self, name: str) -> bool:
        return self.entries[name][0] == "BF16"

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32: zero-copy for F32, converted for F16/BF16."""
        raw = self.raw(name)
        if self.is_bf16(name):
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if raw.dtype == np.float32:
            return raw
        return raw.astype(np.float32)
