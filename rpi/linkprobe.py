"""Measure a test-bed link with its own probes: one-way delay, jitter, loss and loss bursts, one direction.

    python -m halo.rpi.linkprobe recv PORT COUNT TIMEOUT_S      # in the receiving namespace: prints a JSON summary
    python -m halo.rpi.linkprobe send HOST PORT COUNT INTERVAL_US

Every probe carries its sequence number and the sender's clock (CLOCK_REALTIME, taken just before the send);
namespaces share the machine's clock, and the receiver takes the kernel's arrival time of each datagram
(SO_TIMESTAMPNS), so the one-way delay read is the link's, not how late the receiving process woke up (on a busy
2-core machine that added half a millisecond). Loss bursts are runs of consecutive missing sequence numbers.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

import numpy as np

PROBE = struct.Struct("<QQ")  # sequence number, send time (ns, CLOCK_REALTIME)
TIMESPEC = struct.Struct("@ll")  # SO_TIMESTAMPNS: seconds, nanoseconds (C longs)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's number (Python's socket module does not name it)
SPIN_NS = 300_000  # the sender sleeps until this close to a probe's time, then spins: exact, without a core busy


def send(host: str, port: int, count: int, interval_us: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    start = time.monotonic_ns()
    for seq in range(count):
        due = start + int(seq * interval_us * 1e3)
        ahead = due - time.monotonic_ns() - SPIN_NS
        if ahead > 0:
            time.sleep(ahead / 1e9)
        while time.monotonic_ns() < due:
            pass
        sock.sendto(PROBE.pack(seq, time.time_ns()), (host, port))


def receive(port: int, count: int, timeout_s: float) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.bind(("0.0.0.0", port))
    print("listening", flush=True)
    sock.settimeout(timeout_s)
    delays, seen = [], np.zeros(count, bool)
    try:
        while True:
            data, ancillary, _, _ = sock.recvmsg(64, 64)
            now = arrival_ns(ancillary)
            seq, sent = PROBE.unpack_from(data)
            if seq < count:
                seen[seq] = True
                delays.append(now - sent)
            if seq == count - 1:
                sock.settimeout(0.5)  # stragglers behind the last one
    except socket.timeout:
        pass
    return summarize(seen, np.asarray(delays, np.float64) / 1e6)


def arrival_ns(ancillary: list) -> int:
    """The kernel's arrival time of a datagram (CLOCK_REALTIME ns); now where the kernel gave none."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= TIMESPEC.size:
            seconds, nanoseconds = TIMESPEC.unpack_from(data)
            return seconds * 1_000_000_000 + nanoseconds
    return time.time_ns()


def summarize(seen: np.ndarray, delays_ms: np.ndarray) -> dict:
    """Loss over the probes up to the last one received (what never came at the end is not a burst we can see)."""
    last = int(np.flatnonzero(seen)[-1]) + 1 if seen.any() else 0
    missing = ~seen[:last]
    edges = np.diff(np.concatenate([[0], missing.astype(np.int8), [0]]))
    bursts = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
    return {"sent_seen": last, "received": int(seen.sum()), "loss": float(missing.mean()) if last else None,
            "bursts": int(len(bursts)), "mean_burst": float(bursts.mean()) if len(bursts) else None,
            "delay_ms": {"mean": float(delays_ms.mean()), "std": float(delays_ms.std()), "min": float(delays_ms.min()),
                         **{f"p{q}": float(np.percentile(delays_ms, q)) for q in (10, 50, 90)},
                         "max": float(delays_ms.max())} if len(delays_ms) else None}


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if args[:1] == ["recv"] and len(args) == 4:
        print(json.dumps(receive(int(args[1]), int(args[2]), float(args[3]))), flush=True)
    elif args[:1] == ["send"] and len(args) == 5:
        send(args[1], int(args[2]), int(args[3]), float(args[4]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
