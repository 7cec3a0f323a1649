"""Running estimates: what every device and link really delivers, updated from every token.

The master feeds `RunningEstimates.observe` once per forward pass (master.py); it reads counters the
runtime keeps anyway (the master's own compute, each agent's compute as its partials report it, the
UDP endpoint's per-peer chunk counters), so it adds nothing to the rounds. Per device: compute time
per decode token, the median over the last `window` tokens (robust to a preempted token), and from it
the time per group and the effective FLOP/s of its share. Per link: the share of UDP chunks that were
lost (zero-filled, or rebuilt from parity; chunks that came after a NACK are not counted: on a slow link
the NACK gap timer fires while chunks are merely queued) over the last `loss_window` tokens (a windowed
rate, not a median: at 1-5 % loss most tokens lose nothing, so a median of per-token rates would say
0), and the median gather time involving the agent.

`updated_cluster` turns the estimates into the scheduler's profiles for re-planning (the measured
profile with compute speed and loss replaced where enough was observed). Exposed in `--json`
(`estimates`) and, on the agents' side, in `halo-master status`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from halo.runtime.measure import MedianWindow

WINDOW = 15  # tokens (the dynamic-partitioning thesis keeps a ring of 15 and takes the median)
LOSS_WINDOW = 200  # tokens of chunk counts behind a link's loss rate
MIN_CHUNKS = 200  # chunks observed before a link's loss rate replaces the probe's


@dataclass
class DeviceEstimate:
    node_id: int
    name: str
    groups: int  # groups it computes per token (all blocks)
    blocks: int  # blocks it computes per token
    flops: float  # FLOPs of its share per token
    compute: MedianWindow = field(default_factory=lambda: MedianWindow(WINDOW))
    chunks: deque = field(default_factory=lambda: deque(maxlen=LOSS_WINDOW))  # (expected, lost) per token
    last: tuple = (0.0, 0, 0)  # counters at the previous token: compute ms, chunks expected, chunks lost

    def loss_rate(self) -> tuple[float | None, int]:
        expected = sum(e for e, _ in self.chunks)
        return (sum(lost for _, lost in self.chunks) / expected if expected else None), expected

    def to_json(self, sync_ms: list[float] | None = None) -> dict:
        ms = self.compute.median()
        loss, chunks = self.loss_rate()
        out = {"node_id": self.node_id, "name": self.name, "tokens": len(self.compute.values), "groups": self.groups,
               "compute_ms_per_token": ms, "ms_per_group": ms / self.groups if ms is not None and self.groups else None,
               "gflops": self.flops / ms / 1e6 if ms else None, "link_plr": loss, "link_chunks": chunks}
        if sync_ms:
            out["sync_ms_p50"] = float(np.median(sync_ms[-WINDOW:]))
        return out


class RunningEstimates:
    def __init__(self, worker, agents: dict, udp, config, layout):
        import time

        from halo.scheduler.profiles import model_profile

        self.clock = time.perf_counter
        self.token_ms = MedianWindow(WINDOW)  # wall time between consecutive decode steps
        self.last_token: float | None = None
        # for the FLOPs of each share (the weight format does not change them)
        profile = model_profile(config, "fp32", mlp_group_size=layout.mlp_group_size, vocab_group_size=layout.vocab_group_size)
        self.worker, self.agents, self.udp = worker, agents, udp
        shares = {0: ("master", worker.share), **{i: (a.name, a.share) for i, a in agents.items()}}
        self.devices = {i: self._device(i, name, share, profile) for i, (name, share) in shares.items()}

    @staticmethod
    def _device(node_id: int, name: str, share, profile) -> DeviceEstimate:
        sizes = {"attention": [len(g) for g in share.attention], "mlp": [len(g) for g in share.mlp],
                 "lm_head": [len(share.lm_head)]}
        flops = sum(getattr(profile, kind).flops * sum(n) for kind, n in sizes.items())
        return DeviceEstimate(node_id, name, sum(sum(n) for n in sizes.values()),
                              sum(1 for n in sizes.values() for g in n if g), flops)

    def _counters(self, node_id: int) -> tuple:
        compute = self.worker.compute_ms if node_id == 0 else self.agents[node_id].stats.compute_ms
        if node_id == 0 or self.udp is None or node_id not in self.udp.stats:
            return compute, 0, 0
        s = self.udp.stats[node_id]
        # lost: zero-filled or rebuilt from parity (sent after the data: a FIFO link delivers it last). Not the
        # chunks that arrived after a NACK: on a slow link the NACK gap fires while chunks are only queued
        return compute, s.chunks_expected, s.chunks_missing + s.chunks_recovered_parity

    def observe(self, tokens: int = 1) -> None:
        """After a forward pass of `tokens` tokens: the new compute and chunk counts of every device, and the
        time since the previous decode step (a token as the caller sees it, sampling included)."""
        now = self.clock()
        if tokens == 1 and self.last_token is not None:
            self.token_ms.add(1e3 * (now - self.last_token))
        self.last_token = now if tokens == 1 else None
        for node_id, device in self.devices.items():
            now = self._counters(node_id)
            compute, expected, lost = (a - b for a, b in zip(now, device.last))
            device.last = now
            if expected:
                device.chunks.append((expected, lost))
            if tokens == 1:  # decode steps only: a prefill's compute is not a token's
                device.compute.add(compute)

    def to_json(self) -> dict:
        rows = []
        for node_id, device in sorted(self.devices.items()):
            sync = list(self.udp.stats[node_id].sync_ms) if self.udp is not None and node_id in self.udp.stats else None
            rows.append(device.to_json(sync))
        return {"window_tokens": WINDOW, "loss_window_tokens": LOSS_WINDOW, "ms_per_token": self.token_ms.median(),
                "devices": rows}

    def updated_cluster(self, plan, mode: str | None = None, sync=None):
        """The plan's cluster with each participant's compute speed (the median, less its blocks' measured
        overheads) and link loss (once MIN_CHUNKS chunks were seen) from what was observed: for re-planning.
        Given the sync mode, the software cost of a message (framing, polling, bookkeeping: what the
        benchmark cannot see) is then calibrated so that the cost model gives the median time per token
        observed for this plan (`calibrate_messages`). Participant j of the plan is node j (the master 0)."""
        cluster = self._observed_cluster(plan)
        if mode is None or self.token_ms.median() is None:
            return cluster
        return calibrate_messages(plan, cluster, mode, sync, self.token_ms.median() / 1e3)

    def _observed_cluster(self, plan):
        devices = list(plan.cluster.devices)
        kinds = ("attention", "mlp", "lm_head")
        for j, index in enumerate(plan.devices):
            device, profile = self.devices.get(j), devices[index]
            if device is None:
                continue
            ms, (loss, chunks) = device.compute.median(), device.loss_rate()
            changes = {}
            if ms and device.flops:
                blocks = {k: int(np.count_nonzero(plan.counts[k][j])) for k in kinds}  # lm_head: one entry
                fixed = sum(profile.overhead_s[i] * blocks[k] for i, k in enumerate(kinds))
                changes["compute_flops"] = device.flops / max(ms / 1e3 - fixed, 0.1 * ms / 1e3)
            if loss is not None and chunks >= MIN_CHUNKS and j > 0:
                changes["plr"] = min(loss, 0.99)
            devices[index] = replace(profile, **changes)
        return replace(plan.cluster, devices=tuple(devices))


def calibrate_messages(plan, cluster, mode: str, sync, seconds_per_token: float):
    """The cluster with one extra time x added to every device's message_s (x >= -the smallest) such that the
    cost model's estimate of `plan` equals the observed time per token (bisection: the estimate grows with x)."""
    from halo.scheduler.cost import estimate
    from halo.scheduler.plan import TensorParallelPlan

    def with_extra(x: float):
        return replace(cluster, devices=tuple(replace(d, message_s=max(d.message_s + x, 0.0)) for d in cluster.devices))

    def predicted(x: float) -> float:
        return estimate(TensorParallelPlan(with_extra(x), plan.model, plan.algorithm, plan.devices, plan.counts), mode,
                        sync=sync).total_s

    low, high = -max(d.message_s for d in cluster.devices), 0.05
    if predicted(low) >= seconds_per_token or predicted(high) <= seconds_per_token:
        return cluster  # not explained by message costs alone: keep the measured ones
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if predicted(mid) < seconds_per_token else (low, mid)
    return with_extra((low + high) / 2)
