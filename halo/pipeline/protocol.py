"""Stage messages: what the coordinator and a stage worker say to each other.

Native workers speak halo's control-plane codec (transport/reliable.py: versioned multipart frames,
validated on receipt) over CURVE-authenticated ZeroMQ; browser workers get the same messages over a
WebSocket, one binary message each: the codec's frames, each prefixed by its length (`ws_pack`).

coordinator -> worker                                worker -> coordinator
  probe {model_sha256, bench_tokens}                   probe {engine, memory_bytes, layer_s, overhead_s, ...}
  ping  [payload uint8]                                pong  [payload]            (RTT, bandwidth)
  hello {protocol, model_sha256, context, start,       ready {name, engine, weight_bytes, load_ms}
         stop, weights, session}                       refused {reason}
  forward {session, start_pos, head} [tokens | x]      output {compute_ms} [x] | [ids, values] | [logits]
  reset {session} / bye {session}                      ok
  status                                               status {...}
Anything else, or a malformed message, is answered with error {reason}.
"""

from __future__ import annotations

import struct

from halo.transport.reliable import Message, MessageError, decode, encode

STAGE_PROTOCOL = 1  # the stage message set (the frame codec has its own version)
MAX_PING_BYTES = 8 << 20


def ws_pack(message: Message) -> bytes:
    """One WebSocket binary message: [u32 frame count] then [u32 length, bytes] per frame (little endian)."""
    frames = encode(message)
    parts = [struct.pack("<I", len(frames))]
    for frame in frames:
        parts += [struct.pack("<I", len(frame)), frame]
    return b"".join(parts)


def ws_unpack(data: bytes) -> Message:
    """The inverse of ws_pack, then the codec's own validation; MessageError on anything malformed."""
    view = memoryview(data)
    if len(view) < 4:
        raise MessageError("WebSocket message shorter than its frame count")
    (count,), offset, frames = struct.unpack_from("<I", view), 4, []
    if not 2 <= count <= 64:
        raise MessageError(f"{count} frames in one message (expected 2..64)")
    for _ in range(count):
        if offset + 4 > len(view):
            raise MessageError("truncated frame table")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > len(view):
            raise MessageError(f"frame of {length} bytes runs past the end of the message")
        frames.append(bytes(view[offset:offset + length]))
        offset += length
    if offset != len(view):
        raise MessageError(f"{len(view) - offset} stray bytes after the last frame")
    return decode(frames)


def message_bytes(frames: list[bytes]) -> int:
    return sum(len(f) for f in frames)
