"""What an agent tells the master about its device: cores, frequency, memory, measured compute speed."""

from __future__ import annotations

import os
import platform
import time

import numpy as np


def measure_flops(dim: int = 512, seconds: float = 0.2) -> float:
    """FLOP/s of float32 matrix-vector products (the work halo does per token), one thread of BLAS."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((dim * 8, dim), dtype=np.float32)
    x = rng.standard_normal(dim, dtype=np.float32)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        w @ x
        n += 1
    return 2.0 * w.size * n / (time.perf_counter() - start)


def device_profile() -> dict:
    import psutil

    freq = psutil.cpu_freq()
    memory = psutil.virtual_memory()
    return {"host": platform.node(), "machine": platform.machine(), "cores": os.cpu_count(),
            "cpu_mhz": float(freq.current) if freq else None, "memory_total_bytes": memory.total,
            "memory_available_bytes": memory.available, "compute_flops": measure_flops()}
