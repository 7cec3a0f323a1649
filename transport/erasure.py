"""Two parity chunks per group of data chunks: any two lost chunks of the group are rebuilt at the receiver.

RAID-6's P + Q over GF(2^8): P is the XOR of the group's chunks, Q = sum over i of g^i * chunk_i (g = 2,
the field of polynomial x^8 + x^4 + x^3 + x^2 + 1). One lost chunk comes back from P (or from Q when P
is lost too), two from both. Chunks of different lengths count as zero-padded to the longest. Why: at
5 % loss a group of 6 data + 1 XOR chunk lacks two or more of its 7 datagrams 4 % of the time, and each
such vector waits a NACK round trip; with P + Q a group of 6 + 2 needs three losses (0.6 %).
"""

from __future__ import annotations

import numpy as np

try:  # the encoder in C (transport/_datagrams.c: 8 bytes at a time), where the package was built with a compiler
    from halo.transport._datagrams import parities as _parities_in_c
except ImportError:  # pragma: no cover - a build without a C compiler
    _parities_in_c = None

MAX_GROUP = 255  # g^i must differ for every chunk of a group
Q_FROM = 2  # data chunks from which a group gets Q as well as P (parity_chunks_for)

_EXP = np.zeros(512, dtype=np.int64)
_LOG = np.zeros(256, dtype=np.int64)
_value = 1
for _i in range(255):
    _EXP[_i], _LOG[_value] = _value, _i
    _value <<= 1
    if _value & 0x100:
        _value ^= 0x11D
_EXP[255:510] = _EXP[:255]
# MUL[a] is the table of a * b for every byte b (row 0: all zero)
MUL = np.zeros((256, 256), dtype=np.uint8)
MUL[1:, 1:] = _EXP[_LOG[1:, None] + _LOG[None, 1:]]
_MUL_FLAT = MUL.ravel()


def parity_chunks_for(data_chunks: int, wanted: int) -> int:
    """Parity chunks a group of `data_chunks` gets when `wanted` (1 or 2) are asked for: Q only from Q_FROM data
    chunks on; a lone chunk's P is its copy, and a Q would be another. A 2-chunk group (a SmolLM2 vector) with P
    alone lacks two of its 3 datagrams 0.7 % of the time at 5 % loss, with P + Q three of 4 0.05 %. On the test
    bed the fourth datagram costs about what the NACK round trips it saves cost (SmolLM2 at 5 %, 4 interleaved
    runs, eval/results/halo_speed_smollm2_parity_q.md: `exact` 22.7 -> 21.9 ms a token, `halo` 27.9 -> 28.3),
    and a token waits on a NACK a fifth as often (1.7 -> 0.3 a forward pass): fewer stalls of a round trip or two,
    the same mean. (An earlier build, whose datagrams cost more in Python, was slower with it.)"""
    return wanted if data_chunks >= Q_FROM else min(wanted, 1)


def groups(chunks: int, group: int, wanted: int) -> list[tuple[int, int, int]]:
    """How a vector of `chunks` data chunks is protected: (first chunk, data chunks, parity chunks) per group of
    `group` (0: none), `wanted` (1 or 2) parity chunks asked for. The sender's groups and the cost model's."""
    if group == 0:
        return []
    if not 0 < group <= MAX_GROUP or wanted not in (1, 2):
        raise ValueError(f"parity groups of 1..{MAX_GROUP} chunks with 1 or 2 parity chunks, not {group} and {wanted}")
    return [(start, min(group, chunks - start), parity_chunks_for(min(group, chunks - start), wanted))
            for start in range(0, chunks, group)]


def _inverse(a: int) -> int:
    return int(_EXP[255 - _LOG[a]])


def _times(coefficients: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Row i of rows [k, width] times coefficients[i] (one table lookup for all of them)."""
    return np.take(_MUL_FLAT, (coefficients.astype(np.uint16)[:, None] << 8) | rows)


def _rows(chunks, width: int) -> np.ndarray:
    """Chunks as the rows of a [k, width] byte matrix, zero-padded."""
    return np.frombuffer(b"".join(bytes(c).ljust(width, b"\0") for c in chunks), dtype=np.uint8).reshape(-1, width)


def parities(chunks: list[bytes], count: int = 2, native: bool = True) -> tuple[bytes, ...]:
    """P, and Q when count is 2, of a group (as long as its longest chunk); native=False: numpy's, the reference
    (the C encoder gives the same bytes, ~10x faster: every vector a lossy link carries is encoded)."""
    if not 0 < len(chunks) <= MAX_GROUP:
        raise ValueError(f"a parity group holds 1 to {MAX_GROUP} chunks, not {len(chunks)}")
    if native and _parities_in_c is not None and all(type(c) is bytes for c in chunks):
        return _parities_in_c(chunks, count)
    rows = _rows(chunks, max(len(c) for c in chunks))
    p = np.bitwise_xor.reduce(rows, axis=0).tobytes()
    if count == 1:
        return (p,)
    return p, np.bitwise_xor.reduce(_times(_EXP[:len(chunks)], rows), axis=0).tobytes()


def rebuild(present: dict[int, bytes], size: int, p: bytes | None, q: bytes | None) -> dict[int, bytes] | None:
    """The missing chunks of a group of `size` (position -> bytes, as wide as the parity: the caller cuts each
    to its length), or None when the parity at hand cannot: more missing than parity chunks, or two missing
    without both. `present`: position -> chunk for the chunks that arrived."""
    missing = [i for i in range(size) if i not in present]
    if not missing:
        return {}
    if len(missing) > (p is not None) + (q is not None):
        return None
    width = len(p if p is not None else q)
    if any(len(c) > width for c in present.values()) or (p is not None and q is not None and len(p) != len(q)):
        return None  # a chunk longer than its parity, or P and Q of different widths: not this group's
    positions = np.array(sorted(present), dtype=np.int64)
    rows = _rows([present[i] for i in positions], width)
    # what the missing chunks add up to: P' = P ^ (the others), Q' = Q ^ (g^i * the others)
    p_rest = None if p is None else np.frombuffer(p, dtype=np.uint8) ^ np.bitwise_xor.reduce(rows, axis=0)
    if len(missing) == 1 and p_rest is not None:
        return {missing[0]: p_rest.tobytes()}
    q_rest = np.frombuffer(q, dtype=np.uint8) ^ np.bitwise_xor.reduce(_times(_EXP[positions], rows), axis=0)
    if len(missing) == 1:
        x = missing[0]
        return {x: MUL[_inverse(int(_EXP[x]))][q_rest].tobytes()}  # Q' = g^x * D_x
    x, y = missing  # P' = D_x ^ D_y, Q' = g^x D_x ^ g^y D_y  =>  D_x = (Q' ^ g^y P') / (g^x ^ g^y)
    gx, gy = int(_EXP[x]), int(_EXP[y])
    d_x = MUL[_inverse(gx ^ gy)][q_rest ^ MUL[gy][p_rest]]
    return {x: d_x.tobytes(), y: (p_rest ^ d_x).tobytes()}
