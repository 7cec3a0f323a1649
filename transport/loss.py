"""A seeded loss injector for tests and demos: impairs datagrams as an endpoint sends them.

Install with `endpoint.send_hook = LossInjector(...)`. Each datagram is independently dropped,
duplicated, held back and sent after the next one (reordered), delayed, corrupted (one byte
flipped) or followed by a forgery (same header, random tag), with the given probabilities.
Real loss on real sockets is rpi/'s namespace test bed; this one is deterministic for unit tests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LossInjector:
    seed: int = 0
    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    delay_s: float = 0.0
    delay: float = 0.0  # probability of delaying a datagram by delay_s
    corrupt: float = 0.0
    forge: float = 0.0
    counts: dict = field(default_factory=lambda: {k: 0 for k in ("sent", "dropped", "duplicated", "reordered",
                                                                  "delayed", "corrupted", "forged")})

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)
        self.held = None

    def __call__(self, sock, datagram: bytes, address) -> None:
        r = self.rng.random(7)
        self.counts["sent"] += 1
        if r[0] < self.drop:
            self.counts["dropped"] += 1
            return
        if r[1] < self.corrupt:
            data = bytearray(datagram)
            data[int(self.rng.integers(len(data)))] ^= 0xFF
            datagram = bytes(data)
            self.counts["corrupted"] += 1
        if r[2] < self.forge:
            forged = datagram[:-16] + self.rng.bytes(16)
            sock.sendto(forged, address)
            self.counts["forged"] += 1
        if r[3] < self.reorder and self.held is None:
            self.held = (datagram, address)
            self.counts["reordered"] += 1
            return
        if r[4] < self.delay and self.delay_s > 0:
            threading.Timer(self.delay_s, _send_quietly, (sock, datagram, address)).start()
            self.counts["delayed"] += 1
        else:
            sock.sendto(datagram, address)
        if r[5] < self.duplicate:
            sock.sendto(datagram, address)
            self.counts["duplicated"] += 1
        if self.held is not None and self.held[0] is not datagram:
            held, self.held = self.held, None
            sock.sendto(*held)

    def flush(self, sock) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            sock.sendto(*held)


def _send_quietly(sock, datagram, address) -> None:
    try:
        sock.sendto(datagram, address)
    except OSError:
        pass  # the socket closed meanwhile: the datagram is lost, as it would be on a real link
