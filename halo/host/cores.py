"""The cores this process may run on: what its thread counts and busy polling are sized from.

os.cpu_count() is the machine's; a device pinned to some of them (taskset, systemd's CPUAffinity=,
os.sched_setaffinity) must size its compute threads from its own set: two OpenMP threads time-slicing one pinned
core made a TinyLlama-shape agent's half of a token 12-14 ms instead of 8.7.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """How many cores this process may run on (its CPU affinity; the machine's count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def dedicated_cores() -> bool:
    """Whether this process was given cores of its own: its affinity is narrower than the machine. Processes left
    on every core may share them with other nodes."""
    return usable_cores() < (os.cpu_count() or 1)
