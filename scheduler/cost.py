"""Estimated time per output token of a tensor-parallel plan.

Computation is Eq. 1's: for every layer and block, the slowest participant's share
(FLOPs of its groups / its FLOP/s), plus the LM head. Communication: every layer synchronizes twice
(after attention and after the MLP) and the LM head once; in each synchronization the master sends
the hidden state to, and receives a partial sum from, each other participant over its own link,
so the (n - 1) transfers of one round queue on the master's link: T_c = latency + D * 4 bytes / bandwidth
per transfer, 2 L (n - 1) T_c per token as in Eq. 1.

Loss (PLR) adds, per round, the chance that any packet of the round is lost
(1 - prod (1 - p)^packets, with p combining the participant's link and the master's) times the
price of a loss in the chosen sync mode:
- "tcp": the retransmission timeout (Linux's minimum RTO, 200 ms);
- "deadline": waiting out the deadline (lossy sync: late or lost data is dropped);
- "fast": a NACK-driven UDP retransmission, about two link latencies plus a 1 ms timer;
- "ideal": loss ignored: exactly Eq. 1's objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from halo.errors import ConfigError

from .tp_plan import SYNC_BYTES_PER_VALUE, TP_KINDS, TensorParallelPlan

TCP_MIN_RTO_S = 0.200
FAST_RETRY_TIMER_S = 0.001
UDP_PAYLOAD = 1400  # bytes of data per packet
SYNC_MODES = ("ideal", "tcp", "deadline", "fast")


@dataclass(frozen=True)
class Estimate:
    compute_s: float
    comm_s: float
    loss_s: float  # expected extra time from lost packets

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.loss_s

    def to_json(self) -> dict:
        return {"ms_per_token": 1e3 * self.total_s, "compute_ms": 1e3 * self.compute_s, "comm_ms": 1e3 * self.comm_s,
                "loss_ms": 1e3 * self.loss_s}


def compute_seconds(plan: TensorParallelPlan) -> float:
    compute = np.array([d.compute_flops for d in plan.profiles()])
    total = 0.0
    for kind in TP_KINDS:
        per_device = getattr(plan.model, kind).flops * plan.counts[kind] / compute[:, None]  # [n, L]
        total += per_device.max(axis=0).sum()
    return total + float((plan.model.lm_head.flops * plan.counts["lm_head"] / compute).max())


def transfer_seconds(plan: TensorParallelPlan) -> float:
    """T_c: one hidden-state transfer on the master's link."""
    master = plan.cluster.devices[plan.cluster.master]
    return master.latency_s + plan.model.dim * SYNC_BYTES_PER_VALUE * 8 / master.bandwidth_bps


def estimate(plan: TensorParallelPlan, sync: str = "ideal", deadline_s: float = 0.010) -> Estimate:
    if sync not in SYNC_MODES:
        raise ConfigError(f"unknown sync mode {sync!r}; choose one of {', '.join(SYNC_MODES)}")
    rounds = 2 * plan.model.n_layers + 1
    others = plan.n - 1
    t_c = transfer_seconds(plan)
    comm = rounds * others * t_c
    loss = 0.0
    if sync != "ideal" and others:
        master = plan.cluster.devices[plan.cluster.master]
        packets = 2 * math.ceil(plan.model.dim * SYNC_BYTES_PER_VALUE / UDP_PAYLOAD)  # there and back
        clean = 1.0
        for d in plan.profiles()[1:]:
            p = 1 - (1 - d.plr) * (1 - master.plr)
            clean *= (1 - p) ** packets
        price = {"tcp": TCP_MIN_RTO_S, "deadline": deadline_s,
                 "fast": FAST_RETRY_TIMER_S + 2 * max(d.latency_s for d in plan.profiles())}[sync]
        loss = rounds * (1 - clean) * price
    return Estimate(compute_seconds(plan), comm, loss)


def eq1_objective(plan: TensorParallelPlan) -> float:
    """Eq. 1 of the HALO paper (plus the LM head), in seconds per token."""
    return estimate(plan, "ideal").total_s
