"""The UDP wire format: one datagram = a 24-byte little-endian header, a payload, a 16-byte tag.

    offset  size  field
    0       2     magic b"HL"
    2       1     version (1)
    3       1     kind: 0 data, 1 parity (XOR of a chunk group), 2 NACK (payload: missing indices),
                  3 probe (index 0 request, 1 echo; for loss/latency/bandwidth probes)
    4       1     dtype: 0 float32, 1 float16, 2 int8 blocks (64 values + float32 scale each)
    5       1     sender id (0 = master)
    6       4     session id
    10      8     epoch: orders a sender's vectors (halo/sync/framing.py gives it a meaning)
    18      2     chunk index
    20      2     chunk count
    22      2     payload length
    24      n     payload
    24+n    16    tag: keyed BLAKE2b over header and payload (the cluster key)

A datagram never exceeds 1472 bytes (a 1500-byte MTU less IPv4 and UDP headers), so a chunk carries at
most 1432 payload bytes; data chunks use 1430 (a parity chunk prefixes its XOR with the 2-byte size of
its group): 357 float32, 715 float16 or 21 int8 blocks (1344 values). `unpack` rejects
anything malformed, oversized, from another version or session, or with a wrong tag, by raising
`WireError` with a reason the receiver counts; it never raises anything else.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"HL"
VERSION = 1
HEADER = struct.Struct("<2sBBBBIQHHH")
TAG_BYTES = 16
MAX_DATAGRAM = 1472
MAX_PAYLOAD = MAX_DATAGRAM - HEADER.size - TAG_BYTES  # 1432
DATA_PAYLOAD = MAX_PAYLOAD - 2  # data chunks leave room for a parity chunk's 2-byte group size

DATA, PARITY, NACK, PROBE = 0, 1, 2, 3
FLOAT32, FLOAT16, INT8 = 0, 1, 2
INT8_BLOCK = 64
INT8_BLOCK_BYTES = INT8_BLOCK + 4
KEY_BYTES = 32


class WireError(Exception):
    """A datagram the receiver must discard; `reason` names the counter it goes to."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Header:
    kind: int
    dtype: int
    sender: int
    session: int
    epoch: int
    index: int
    count: int
    length: int


def values_per_chunk(dtype: int) -> int:
    if dtype == FLOAT32:
        return DATA_PAYLOAD // 4
    if dtype == FLOAT16:
        return DATA_PAYLOAD // 2
    if dtype == INT8:
        return (DATA_PAYLOAD // INT8_BLOCK_BYTES) * INT8_BLOCK
    raise ValueError(f"unknown dtype {dtype}")


def chunk_count(n_values: int, dtype: int) -> int:
    return -(-n_values // values_per_chunk(dtype))


def payload_bytes(n_values: int, dtype: int) -> int:
    """Payload size of a chunk holding n_values values."""
    if dtype == FLOAT32:
        return 4 * n_values
    if dtype == FLOAT16:
        return 2 * n_values
    return -(-n_values // INT8_BLOCK) * INT8_BLOCK_BYTES


def encode_values(values: np.ndarray, dtype: int) -> bytes:
    """One chunk's values as payload bytes (int8: blockwise with a float32 scale per 64 values)."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == FLOAT32:
        return values.astype("<f4").tobytes()
    if dtype == FLOAT16:
        return values.astype("<f2").tobytes()
    blocks = -(-len(values) // INT8_BLOCK)
    padded = np.zeros(blocks * INT8_BLOCK, dtype=np.float32)
    padded[:len(values)] = values
    padded = padded.reshape(blocks, INT8_BLOCK)
    scale = np.abs(padded).max(axis=1) / 127.0
    scale[scale == 0] = 1.0
    codes = np.clip(np.rint(padded / scale[:, None]), -127, 127).astype(np.int8)
    out = np.empty((blocks, INT8_BLOCK_BYTES), dtype=np.uint8)
    out[:, :4] = scale.astype("<f4").view(np.uint8).reshape(blocks, 4)
    out[:, 4:] = codes.view(np.uint8)
    return out.tobytes()


def decode_values(payload: bytes | memoryview, dtype: int, n_values: int) -> np.ndarray:
    """Inverse of encode_values for a chunk holding n_values values."""
    if dtype == FLOAT32:
        expected = 4 * n_values
        if len(payload) != expected:
            raise WireError("bad_length")
        return np.frombuffer(payload, dtype="<f4")
    if dtype == FLOAT16:
        if len(payload) != 2 * n_values:
            raise WireError("bad_length")
        return np.frombuffer(payload, dtype="<f2").astype(np.float32)
    blocks = -(-n_values // INT8_BLOCK)
    if len(payload) != blocks * INT8_BLOCK_BYTES:
        raise WireError("bad_length")
    raw = np.frombuffer(payload, dtype=np.uint8).reshape(blocks, INT8_BLOCK_BYTES)
    scale = raw[:, :4].copy().view("<f4")[:, 0]
    codes = raw[:, 4:].view(np.int8).astype(np.float32)
    return (codes * scale[:, None]).reshape(-1)[:n_values]


def tag(key: bytes, data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, key=key, digest_size=TAG_BYTES).digest()


def pack(header: Header, payload: bytes, key: bytes) -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    body = HEADER.pack(MAGIC, VERSION, header.kind, header.dtype, header.sender, header.session, header.epoch,
                       header.index, header.count, len(payload)) + payload
    return body + tag(key, body)


def unpack(datagram: bytes | memoryview, key: bytes, session: int | None = None) -> tuple[Header, memoryview]:
    """Validate and split a datagram; raises WireError(reason) for anything that must be discarded."""
    size = len(datagram)
    if size > MAX_DATAGRAM:
        raise WireError("oversized")
    if size < HEADER.size + TAG_BYTES:
        raise WireError("truncated")
    view = memoryview(datagram)
    magic, version, kind, dtype, sender, sess, epoch, index, count, length = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise WireError("bad_magic")
    if version != VERSION:
        raise WireError("bad_version")
    if HEADER.size + length + TAG_BYTES != size:
        raise WireError("bad_length")
    body = view[:HEADER.size + length]
    if not hmac.compare_digest(tag(key, body), bytes(view[HEADER.size + length:])):
        raise WireError("bad_tag")
    if session is not None and sess != session:
        raise WireError("other_session")
    if kind not in (DATA, PARITY, NACK, PROBE) or dtype not in (FLOAT32, FLOAT16, INT8) or count == 0 or index >= count:
        raise WireError("malformed")
    return Header(kind, dtype, sender, sess, epoch, index, count, length), view[HEADER.size:HEADER.size + length]
