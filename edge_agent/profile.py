"""What an agent tells the master about its device: cores, frequency, memory, measured compute speed.

`device_profile` is the quick summary every hello and status reply carries. `measured_profile` answers
a master's `profile` request before it plans: the group kernels timed in the session's weight format,
the CPU cost of a message and the memory available (halo/runtime/measure.py, cached on the device),
and the agent's UDP endpoint joins the master's UDP session so that the master can probe the link.
"""

from __future__ import annotations

import platform
import time

import numpy as np

from halo.host.cores import usable_cores


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


def measured_profile(agent, request, address: str | None = None) -> dict | str:
    """The reply to a `profile` request (transport/control.py ProfileRequest; its model and format checked by the
    agent), or why it cannot be served. address:
    the master's, from its control connection: its probes are echoed to (address, its UDP port) only."""
    from halo.compute.neuron_groups import GroupLayout
    from halo.runtime.measure import measure_device

    layout = GroupLayout.for_model(agent.weights.config, request.mlp_group_size, request.vocab_group_size)
    measured = measure_device(agent.weights, layout, request.weights, agent.threads, agent.name, fresh=request.fresh)
    measured["memory_budget_bytes"] = agent.memory_budget  # what it will hold a share to (--memory-budget), not only
    # what is free: a plan from free memory gave it a share it then refused
    if request.udp is not None:  # probes of this master's session are echoed from now on, under our own sender id
        agent.udp.join(request.udp.session, request.node_id, agent.session_key(request.udp))  # (each sender has its
        if address:  # own replay window there); the master's endpoint: the one address probes are echoed to
            agent.udp.peers[0] = (address, request.udp.port)
    return {"name": agent.name, "profile": agent.profile, "measured": measured, "udp_port": agent.udp.address[1]}


class BlockTimes:
    """The agent's running compute estimate, per kind of block: the median over the last `window` blocks
    of the time one block took and of its groups (shown by `halo-master status`)."""

    def __init__(self, window: int = 15):
        from halo.runtime.measure import MedianWindow

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
