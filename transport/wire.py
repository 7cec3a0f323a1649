"""The UDP wire format: one datagram = a 32-byte little-endian header, a payload, a 16-byte tag.

    offset  size  field
    0       2     magic b"HL"
    2       1     version (4)
    3       1     kind: 0 data, 1 parity P (XOR of a chunk group), 2 NACK (payload: missing indices),
                  3 probe (index 0 request, 1 echo; for loss/latency/bandwidth probes),
                  4 parity Q (Reed-Solomon over GF(2^8), erasure.py: with P, any two lost chunks of the group)
    4       1     dtype: 0 float32, 1 float16, 2 int8 blocks (64 values + float32 scale each)
    5       1     sender id (0 = master)
    6       4     session id
    10      8     epoch: orders a sender's vectors (halo/sync/framing.py gives it a meaning)
    18      8     counter: the sender's datagram count in this session, never reused (replays are refused)
    26      2     chunk index
    28      2     chunk count
    30      2     payload length
    32      n     payload
    32+n    16    tag: keyed BLAKE2b over header and payload (the session's key: session_key)

A datagram never exceeds 1472 bytes (a 1500-byte MTU less IPv4 and UDP headers), so a chunk carries at
most 1424 payload bytes; data chunks use 1422 (a parity chunk prefixes its bytes with its group's size and
how many parity chunks the group has, one byte each): 355 float32, 711 float16 or 20 int8 blocks (1280 values). `Codec.unpack` rejects
anything malformed, oversized, from another version or session, or with a wrong tag, by raising
`WireError` with a reason the receiver counts; it never raises anything else. The tag covers the
counter, so a captured datagram sent again is recognised (`ReplayWindow`) and changes nothing.

Where the package was built with a C compiler, `transport/_datagrams.c` packs and tags (`Codec.pack`,
`Codec.pack_chunks`) and reads and checks (the UDP endpoint's receive path) the same bytes in C; `Codec.unpack` here, and
`Codec(key, fast=False)` for packing, are the Python reference the tests and the fuzzer hold the C path to.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple

import numpy as np

try:  # the same packing and checks in C (transport/_datagrams.c), where the package was built with a compiler
    from halo.transport import _datagrams
except ImportError:  # pragma: no cover - a build without a C compiler
    _datagrams = None

MAGIC = b"HL"
VERSION = 5  # 3: parity Q (kind 4), parity prefix = group size + parity chunks per group; 4: a key per session;
# 5: an MLP input may carry the next layer's ranking (halo/sync/framing.py)
HEADER = struct.Struct("<2sBBBBIQQHHH")
TAG_BYTES = 16
MAX_DATAGRAM = 1472
MAX_PAYLOAD = MAX_DATAGRAM - HEADER.size - TAG_BYTES  # 1424
DATA_PAYLOAD = MAX_PAYLOAD - 2  # data chunks leave room for a parity chunk's 2-byte prefix

DATA, PARITY, NACK, PROBE, PARITY_Q = 0, 1, 2, 3, 4
PARITIES = (PARITY, PARITY_Q)
FLOAT32, FLOAT16, INT8 = 0, 1, 2
INT8_BLOCK = 64
INT8_BLOCK_BYTES = INT8_BLOCK + 4
KEY_BYTES = 32
NONCE_BYTES = 32  # the per-session nonce (session_key)
REPLAY_WINDOW = 4096  # counters below the newest that are still accepted (once each): reordering slack
_WINDOW_MASK = (1 << REPLAY_WINDOW) - 1  # built once: a 4096-bit integer per datagram was measurable


def session_key(cluster_udp_key: bytes, nonce: bytes, session: int) -> bytes:
    """The key a session's datagrams are tagged with: the cluster's UDP key (ClusterKey.udp_key; 32 zero bytes in
    plaintext mode) and a random nonce the master sends each agent over the authenticated control channel at hello.
    No two sessions share a key, so nothing captured in one (or computed from an old session's traffic) is valid in
    another, and without the cluster key nobody can derive it."""
    if len(cluster_udp_key) != KEY_BYTES or len(nonce) != NONCE_BYTES or not 0 <= session < 1 << 32:
        raise ValueError(f"a session key needs a {KEY_BYTES}-byte key, a {NONCE_BYTES}-byte nonce and a 32-bit session")
    return hashlib.blake2b(nonce + session.to_bytes(4, "little"), key=cluster_udp_key, digest_size=KEY_BYTES,
                           person=b"halo-udp-sess").digest()


class WireError(Exception):
    """A datagram the receiver must discard; `reason` names the counter it goes to."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Header(NamedTuple):
    kind: int
    dtype: int
    sender: int
    session: int
    epoch: int
    counter: int
    index: int
    count: int
    length: int


class Codec:
    """Packs and checks datagrams with one cluster key (the keyed hash state is prepared once)."""

    def __init__(self, key: bytes, fast: bool = True):
        if len(key) != KEY_BYTES:
            raise ValueError(f"the cluster key must be {KEY_BYTES} bytes")
        self._mac = hashlib.blake2b(key=key, digest_size=TAG_BYTES)
        # the C path's keyed BLAKE2b state (None: pack in Python; fast=False: the reference, for tests)
        self.state = _datagrams.keyed(key) if fast and _datagrams is not None else None

    def pack(self, kind: int, dtype: int, sender: int, session: int, epoch: int, counter: int, index: int, count: int,
             payload: bytes) -> bytes:
        if self.state is not None:
            return _datagrams.pack(self.state, kind, dtype, sender, session, epoch, counter, index, count, payload)
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
        header = HEADER.pack(MAGIC, VERSION, kind, dtype, sender, session, epoch, counter, index, count, len(payload))
        mac = self._mac.copy()
        mac.update(header)
        mac.update(payload)
        return b"".join((header, payload, mac.digest()))

    def pack_chunks(self, kind: int, dtype: int, sender: int, session: int, epoch: int, first_counter: int,
                    payloads: list[bytes]) -> list[bytes]:
        """A vector's chunks (chunk i: index i of len(payloads), counter first_counter + i), in one call."""
        count = len(payloads)
        if self.state is not None:
            return _datagrams.pack_many(self.state, kind, dtype, sender, session, epoch, first_counter, count, payloads)
        return [self.pack(kind, dtype, sender, session, epoch, first_counter + i, i, count, p)
                for i, p in enumerate(payloads)]

    def unpack(self, datagram: bytes | memoryview, session: int | None = None) -> tuple[Header, memoryview]:
        """Validate and split a datagram; raises WireError(reason) for anything that must be discarded."""
        size = len(datagram)
        if size > MAX_DATAGRAM:
            raise WireError("oversized")
        if size < HEADER.size + TAG_BYTES:
            raise WireError("truncated")
        view = memoryview(datagram)
        magic, version, kind, dtype, sender, sess, epoch, counter, index, count, length = HEADER.unpack_from(view, 0)
        if magic != MAGIC:
            raise WireError("bad_magic")
        if version != VERSION:
            raise WireError("bad_version")
        end = HEADER.size + length
        if end + TAG_BYTES != size:
            raise WireError("bad_length")
        mac = self._mac.copy()
        mac.update(view[:end])
        if not hmac.compare_digest(mac.digest(), view[end:]):
            raise WireError("bad_tag")
        if session is not None and sess != session:
            raise WireError("other_session")
        if kind > PARITY_Q or dtype > INT8 or count == 0 or index >= count:
            raise WireError("malformed")
        return Header(kind, dtype, sender, sess, epoch, counter, index, count, length), view[HEADER.size:end]


def pack(header: Header, payload: bytes, key: bytes) -> bytes:
    """One datagram (convenience for tests and tools; endpoints keep a Codec)."""
    h = header
    return Codec(key).pack(h.kind, h.dtype, h.sender, h.session, h.epoch, h.counter, h.index, h.count, payload)


def unpack(datagram: bytes | memoryview, key: bytes, session: int | None = None) -> tuple[Header, memoryview]:
    return Codec(key).unpack(datagram, session)


class ReplayWindow:
    """The counters seen from one sender in one session: the newest, and which of the REPLAY_WINDOW before
    it. A counter seen before, or too old to tell, is a replay (or a duplicate) and is refused."""

    __slots__ = ("top", "seen")

    def __init__(self):
        self.top, self.seen = -1, 0  # seen: bit i = counter top - i arrived

    def accept(self, counter: int) -> bool:
        if counter > self.top:
            shift = counter - self.top
            self.seen = ((self.seen << shift) | 1) & _WINDOW_MASK if shift < REPLAY_WINDOW else 1
            self.top = counter
            return True
        offset = self.top - counter
        if offset >= REPLAY_WINDOW or (self.seen >> offset) & 1:
            return False
        self.seen |= 1 << offset
        return True

    def accept_ascending(self, counters: list[int]) -> None:
        """Take counters known to be fresh, each above the one before and the first above `top`: as accept() on
        each, in one shift."""
        newest, bits = counters[-1], 0
        for counter in counters:
            if newest - counter < REPLAY_WINDOW:  # (older ones fall out of the window, as accept() drops them)
                bits |= 1 << (newest - counter)
        shift = newest - self.top
        self.seen = ((self.seen << shift) | bits) & _WINDOW_MASK if shift < REPLAY_WINDOW else bits & _WINDOW_MASK
        self.top = newest


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


def chunk_payloads(values: np.ndarray, dtype: int) -> list[bytes]:
    """A float32 vector as the payloads of its chunks, in order."""
    per = values_per_chunk(dtype)
    if dtype in (FLOAT32, FLOAT16):
        raw = np.asarray(values, dtype="<f4" if dtype == FLOAT32 else "<f2").tobytes()
        step = per * (4 if dtype == FLOAT32 else 2)
        return [raw[i:i + step] for i in range(0, len(raw), step)]
    return [encode_values(values[i * per:(i + 1) * per], dtype) for i in range(chunk_count(len(values), dtype))]
