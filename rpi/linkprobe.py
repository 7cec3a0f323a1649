"""Measure a test-bed link with its own probes: one-way delay, jitter, loss and loss bursts, one direction.

    python -m halo.rpi.linkprobe recv PORT COUNT TIMEOUT_S      # in the receiving namespace: prints a JSON summary
    python -m halo.rpi.linkprobe send HOST PORT COUNT INTERVAL_US

Every probe carries its sequence number and the sender's CLOCK_MONOTONIC time; namespaces share the machine's
clock, so the receiver reads the one-way delay directly. Loss bursts are runs of consecutive missing sequence
numbers.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

import numpy as np

PROBE = struct.Struct("<QQ")  # sequence number, send time (ns, CLOCK_MONOTONIC)


def send(host: str, port: int, count: int, interval_us: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    start = time.monotonic_ns()
    for seq in range(count):
        due = start + int(seq * interval_us * 1e3)
        while time.monotonic_ns() < due:
            pass
        sock.sendto(PROBE.pack(seq, time.monotonic_ns()), (host, port))


def receive(port: int, count: int, timeout_s: float) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("0.0.0.0", port))
    print("listening", flush=True)
    sock.settimeout(timeout_s)
    delays, seen = [], np.zeros(count, bool)
    try:
        while True:
            data = sock.recv(64)
            now = time.monotonic_ns()
            seq, sent = PROBE.unpack_from(data)
            if seq < count:
                seen[seq] = True
                delays.append(now - sent)
            if seq == count - 1:
                sock.settimeout(0.5)  # stragglers behind the last one
    except socket.timeout:
        pass
    return summarize(seen, np.asarray(delays, np.float64) / 1e6)


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
