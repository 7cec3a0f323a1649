"""Where a token's time goes on the master: per round, its compute, the agents' compute, and the rest.

A round (one block's synchronization) runs: send the input -> compute the own share -> predict the next
layer (HALO) -> collect the partials -> merge. Its *overhead* is what it takes beyond the slowest
device's compute: round wall time - max(own compute, slowest agent's reported compute). That is the
price of distributing, which the transport work tries to bring down to what a packet costs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

KEPT_ROUNDS = 20_000  # recent rounds kept for the overhead's percentiles


@dataclass
class RoundTime:
    wall_ms: float
    send_ms: float
    own_ms: float  # the master's own compute
    predict_ms: float
    wait_ms: float  # collecting the partials
    merge_ms: float
    agents_ms: float  # the slowest agent's compute, as it reports it (0: no agent held groups)

    @property
    def overhead_ms(self) -> float:
        return max(0.0, self.wall_ms - max(self.own_ms, self.agents_ms))


FIELDS = ("wall_ms", "send_ms", "own_ms", "predict_ms", "wait_ms", "merge_ms", "agents_ms")
PHASES = ("send", "own", "predict", "wait", "merge")  # what a round's data path does, in RoundTime's terms


class RoundClock:
    """A round's stopwatch, beside its data path: each step of the round ends with `mark(phase)`, the time since the
    previous mark going to that phase; `time(agents_ms)` is the round as a RoundTime."""

    __slots__ = ("started", "last", "ms")

    def __init__(self):
        self.started = self.last = time.perf_counter()
        self.ms = dict.fromkeys(PHASES, 0.0)

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.ms[phase] += 1e3 * (now - self.last)
        self.last = now

    def time(self, agents_ms: float = 0.0) -> RoundTime:
        return RoundTime(1e3 * (self.last - self.started), self.ms["send"], self.ms["own"], self.ms["predict"],
                         self.ms["wait"], self.ms["merge"], agents_ms)


@dataclass
class Timings:
    totals: dict = field(default_factory=lambda: dict.fromkeys(FIELDS + ("overhead_ms",), 0.0))
    overheads: deque = field(default_factory=lambda: deque(maxlen=KEPT_ROUNDS))  # recent rounds, for percentiles
    per_agent_ms: dict = field(default_factory=dict)  # node id -> its reported compute, summed
    rounds: int = 0
    synced: int = 0  # rounds that went over the network (a block held by the master alone sends nothing)
    forwards: int = 0

    def record(self, r: RoundTime, agent_compute: dict[int, float], synced: bool = True) -> None:
        """synced False: the master held the whole block; its time counts, but not among the rounds' overheads
        (their percentiles describe synchronization)."""
        self.rounds += 1
        self.synced += synced
        for node_id, ms in agent_compute.items():
            self.per_agent_ms[node_id] = self.per_agent_ms.get(node_id, 0.0) + ms
        for f in FIELDS:
            self.totals[f] += getattr(r, f)
        self.totals["overhead_ms"] += r.overhead_ms
        if synced:
            self.overheads.append(r.overhead_ms)

    def to_json(self) -> dict:
        """Per token (mean over the forward passes) and per round (percentiles of the overhead)."""
        if not self.rounds or not self.forwards:
            return {}
        t, per = self.totals, self.forwards
        overhead = np.array(self.overheads) if self.overheads else np.zeros(1)
        return {"per_token_ms": {"rounds": round(t["wall_ms"] / per, 3), "own_compute": round(t["own_ms"] / per, 3),
                                 "slowest_agent_compute": round(t["agents_ms"] / per, 3),
                                 "send": round(t["send_ms"] / per, 3), "sync_wait": round(t["wait_ms"] / per, 3),
                                 "prediction": round(t["predict_ms"] / per, 3), "merge": round(t["merge_ms"] / per, 3),
                                 "overhead": round(t["overhead_ms"] / per, 3)},
                "agent_compute_per_token_ms": {str(i): round(ms / per, 3) for i, ms in sorted(self.per_agent_ms.items())},
                "rounds_per_token": round(self.rounds / per, 2),
                "sync_rounds_per_token": round(self.synced / per, 2),
                # percentiles over the rounds that synchronized
                "round_overhead_ms": {"p50": round(float(np.percentile(overhead, 50)), 3),
                                      "p90": round(float(np.percentile(overhead, 90)), 3),
                                      "p99": round(float(np.percentile(overhead, 99)), 3)}}
