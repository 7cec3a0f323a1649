"""What an agent tells the master about its device: cores, frequency, memory, measured compute speed.

`device_profile` is the quick summary every hello and status reply carries. `measured_profile` answers
a master's `profile` request before it plans: the group kernels timed in the session's weight format,
the CPU cost of a message and the memory available (halo/scheduler/measure.py, cached on the device),
and the agent's UDP endpoint joins the master's UDP session so that the master can probe the link.
"""

from __future__ import annotations

import platform
import time

import numpy as np

from halo.cores import usable_cores


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
    return {"host": platform.node(), "machine": platform.machine(), "cores": usable_cores(),
            "cpu_mhz": float(freq.current) if freq else None, "memory_total_bytes": memory.total,
            "memory_available_bytes": memory.available, "compute_flops": measure_flops()}


def measured_profile(agent, f: dict, address: str | None = None) -> dict | str:
    """The reply to a `profile` request (fields: weights, mlp_group_size, vocab_group_size, fresh,
    udp_session, node_id, udp_port), or why it cannot be served. address: the master's, from its control connection:
    its probes are echoed to (address, udp_port) only."""
    from halo.linear import FORMATS
    from halo.neuron_groups import GroupLayout
    from halo.scheduler.measure import measure_device

    layout = GroupLayout.for_model(agent.weights.config, int(f["mlp_group_size"]), int(f["vocab_group_size"]))
    fmt = f.get("weights") or agent.format
    if fmt not in FORMATS:
        return f"unknown weight format {fmt!r}; this agent computes in {', '.join(FORMATS)}"
    udp_session, node_id = int(f.get("udp_session", 0)), int(f.get("node_id", 0))
    if not 0 <= udp_session < 1 << 32:
        return f"udp_session {udp_session} is not a 32-bit session id"
    if udp_session and not 0 < node_id < 255:
        return f"node id {node_id} outside 1..254"
    measured = measure_device(agent.weights, layout, fmt, agent.threads, agent.name, fresh=bool(f.get("fresh")))
    if udp_session:  # probes of this master's session are echoed from now on, under our own sender id (each
        agent.udp.join(udp_session, node_id, agent.session_key(f))  # sender has its own replay window there)
        port = f.get("udp_port")
        if address and isinstance(port, int) and 0 < port < 65536:
            agent.udp.peers[0] = (address, port)  # the master's endpoint: the one address probes are echoed to
    return {"name": agent.name, "profile": agent.profile, "measured": measured, "udp_port": agent.udp.address[1]}


class BlockTimes:
    """The agent's running compute estimate, per kind of block: the median over the last `window` blocks
    of the time one block took and of its groups (shown by `halo-master status`)."""

    def __init__(self, window: int = 15):
        from halo.scheduler.measure import MedianWindow

        self.ms = {k: MedianWindow(window) for k in ("attention", "mlp", "lm_head")}
        self.groups = {k: MedianWindow(window) for k in self.ms}

    def observe(self, kind: str, groups: int, ms: float) -> None:
        if not groups:
            return  # a listener's acknowledgement computes nothing
        self.ms[kind].add(ms)
        self.groups[kind].add(groups)

    def to_json(self) -> dict:
        out = {}
        for kind, window in self.ms.items():
            ms, groups = window.median(), self.groups[kind].median()
            if ms is not None:
                out[kind] = {"blocks": len(window.values), "ms_per_block": ms, "groups": groups,
                             "ms_per_group": ms / groups if groups else None}
        return out
