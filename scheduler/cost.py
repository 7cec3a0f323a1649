"""Estimated time per output token of a tensor-parallel plan in a sync mode, packet loss included.

Eq. 1 (objective.py) is the loss-free part. Loss (PLR) adds, per synchronization round, the chance
that any packet of the round's inputs, or of its partial sums, is lost (1 - prod (1 - p)^packets, p
combining the participant's link and the master's) times the price of such a loss in the sync mode
(the runtime's modes, halo/sync/modes.py):

| mode | a lost input costs | a lost partial costs |
|---|---|---|
| exact | a NACK-driven UDP retransmission: two link latencies + a 1 ms timer | the same |
| tcp | TCP's retransmission timeout (Linux's minimum RTO, 200 ms) | the same |
| lossy | a NACK-driven retransmission | waiting out the deadline |
| halo | a NACK-driven retransmission | the same (recovered while the deadline allows) |
| halo-tcp | TCP's RTO | a NACK-driven retransmission |

"ideal" ignores loss: exactly Eq. 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from halo.errors import ConfigError
from halo.sync.modes import POLICIES, SYNC_MODES, Transport
from halo.transport.wire import DATA_PAYLOAD

from .objective import comm_seconds, compute_seconds, sync_rounds
from .plan import SYNC_BYTES_PER_VALUE, TensorParallelPlan

TCP_MIN_RTO_S = 0.200
FAST_RETRY_TIMER_S = 0.001
ESTIMATE_MODES = ("ideal",) + SYNC_MODES


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


def loss_prices(plan: TensorParallelPlan, mode: str, deadline_s: float) -> tuple[float, float]:
    """(price of a lost input packet, of a lost partial packet) in seconds, for a sync mode."""
    policy = POLICIES[mode]
    fast = FAST_RETRY_TIMER_S + 2 * max(d.latency_s for d in plan.profiles())
    price_in = TCP_MIN_RTO_S if policy.input is Transport.TCP else fast
    if policy.all_critical:
        price_out = TCP_MIN_RTO_S if policy.critical is Transport.TCP else fast
    elif policy.other is Transport.TCP:
        price_out = TCP_MIN_RTO_S
    else:
        price_out = fast if policy.recover_other else deadline_s
    return price_in, price_out


def estimate(plan: TensorParallelPlan, mode: str = "ideal", deadline_s: float = 0.010) -> Estimate:
    if mode not in ESTIMATE_MODES:
        raise ConfigError(f"unknown sync mode {mode!r}; choose one of {', '.join(ESTIMATE_MODES)}")
    loss = 0.0
    if mode != "ideal" and plan.n > 1:
        master = plan.cluster.devices[plan.cluster.master]
        packets = math.ceil(plan.model.dim * SYNC_BYTES_PER_VALUE / DATA_PAYLOAD)  # each way, per participant
        clean = 1.0
        for d in plan.profiles()[1:]:
            p = 1 - (1 - d.plr) * (1 - master.plr)
            clean *= (1 - p) ** packets
        price_in, price_out = loss_prices(plan, mode, deadline_s)
        loss = sync_rounds(plan.model) * (1 - clean) * (price_in + price_out)
    return Estimate(compute_seconds(plan), comm_seconds(plan), loss)
