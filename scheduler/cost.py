"""Expected time per output token of a tensor-parallel plan in a sync mode, packet loss included.

Eq. 1 (objective.py) is the paper's planning objective. This is the model of what the runtime does
(halo/distributed/master.py, rounds.py), used to choose plans and checked against measured runs
(eval/bench_cost_model.py). A token is 2L + 1 rounds (attention and MLP of every layer, the LM head);
in a round the master

1. sends the block's input to every agent holding groups of it, one vector after another
   (`message_s / 2` of the master's CPU each, and the bytes queue on the master's link),
2. computes its own share (`overhead_s + FLOPs / compute_flops`),
3. takes in the partials (`message_s / 2` each) once the last one is there.

An agent's partial is back after: its input's send slot + one-way latency + input bytes / its link's
bandwidth + its own `message_s` + its share's compute + latency + partial bytes / bandwidth. The round
lasts max(the master's sends + own share, every agent's partial) + the master's receive time.

Loss (PLR p per datagram and direction, the agent's link combined with the master's) adds, per agent
and vector, a recovery with some probability, and the round waits for its slowest agent, so the
expected round time is E[max] over the agents' (independent) recovery outcomes, computed exactly.
What a lost datagram costs follows the runtime's policy table (halo/sync/modes.py):

| path | a vector needs recovery when | it then costs |
|---|---|---|
| UDP, recovered (exact; critical partials; halo's others) | a parity group lost more of its datagrams than it has parity chunks | a NACK: the gap timer (GatherPolicy.gap_s) + a round trip |
| the same | every datagram of it was lost | the chase: 0.6 x the deadline + a round trip |
| UDP, not recovered (lossy's other partials) | any datagram lost | waiting out the deadline (the partial is dropped) |
| TCP (tcp; halo-tcp's inputs and critical partials) | any segment lost | TCP's retransmission timeout (Linux: >= 200 ms) |

Critical partials in halo / halo-tcp: layer 0, the LM head, and agents whose Algorithm-3 rank range
starts inside the top `critical_fraction`. "ideal" ignores loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from halo.errors import ConfigError
from halo.sync.deadline import CHASE_FRACTION
from halo.sync.framing import PREFIX
from halo.sync.modes import POLICIES, SYNC_MODES, ModePolicy, SyncSettings, Transport
from halo.transport.erasure import groups
from halo.transport.udp import GatherPolicy
from halo.transport.wire import DATA_PAYLOAD, MAX_DATAGRAM

from halo.scheduler.plan import SYNC_BYTES_PER_VALUE, TP_KINDS, TensorParallelPlan

TCP_MIN_RTO_S = 0.200
TCP_SEGMENT_BYTES = 1448
NACK_GAP_S = GatherPolicy.gap_s
ESTIMATE_MODES = ("ideal",) + SYNC_MODES
VALUES_PER_DATAGRAM = DATA_PAYLOAD // SYNC_BYTES_PER_VALUE


@dataclass(frozen=True)
class Estimate:
    compute_s: float  # the slowest device's compute, summed over the rounds
    comm_s: float  # the rest of the loss-free time: transfers, latency, framing
    loss_s: float  # expected extra time from lost packets

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.loss_s

    def to_json(self) -> dict:
        return {"ms_per_token": 1e3 * self.total_s, "compute_ms": 1e3 * self.compute_s, "comm_ms": 1e3 * self.comm_s,
                "loss_ms": 1e3 * self.loss_s}


@dataclass(frozen=True)
class Outcome:
    """A discrete random delay: values (seconds) with their probabilities."""

    values: tuple[float, ...]
    probs: tuple[float, ...]

    @staticmethod
    def never() -> "Outcome":
        return Outcome((0.0,), (1.0,))

    @staticmethod
    def maybe(prob: float, price: float) -> "Outcome":
        return Outcome((0.0, price), (1.0 - prob, prob)) if prob > 0 else Outcome.never()

    def plus(self, other: "Outcome") -> "Outcome":
        """The sum of two independent delays."""
        return Outcome(tuple(a + b for a in self.values for b in other.values),
                       tuple(p * q for p in self.probs for q in other.probs))


def expected_max(fixed: float, arrivals: list[tuple[float, Outcome]]) -> float:
    """E[max(fixed, base_i + X_i)] for independent discrete delays X_i: exact, from the product of the
    distribution functions at every possible value."""
    points = sorted({fixed, *(base + v for base, o in arrivals for v in o.values)})
    expected, below = 0.0, 0.0
    for y in points:
        if y < fixed:
            continue
        cdf = 1.0
        for base, o in arrivals:
            cdf *= sum(p for v, p in zip(o.values, o.probs) if base + v <= y + 1e-15)
        expected += y * (cdf - below)
        below = cdf
    return expected


def datagrams(n_values: int) -> int:
    return max(1, math.ceil(n_values / VALUES_PER_DATAGRAM))


def p_needs_nack(p: float, chunks: int, parity_group: int, parity_chunks: int = 2) -> float:
    """Probability that parity cannot complete a vector by itself (some group lost more of its data + parity
    datagrams than it has parity chunks), given at least one datagram arrives."""
    if parity_group <= 0:
        return 1 - (1 - p) ** chunks
    ok = 1.0
    for _, data, parity in groups(chunks, parity_group, parity_chunks):
        ok *= sum(math.comb(data + parity, k) * p ** k * (1 - p) ** (data + parity - k) for k in range(parity + 1))
    return 1 - ok


def parity_datagrams(chunks: int, parity_group: int, parity_chunks: int) -> int:
    """Parity datagrams a vector of `chunks` data chunks goes out with (udp/send.py's groups)."""
    return sum(parity for _, _, parity in groups(chunks, max(parity_group, 0), parity_chunks))


@dataclass(frozen=True)
class Link:
    """One agent's path to the master for one block: what a vector costs and risks each way."""

    latency_s: float
    bandwidth_bps: float
    plr: float

    def transfer_s(self, n_values: int) -> float:
        return self.latency_s + datagrams(n_values) * MAX_DATAGRAM * 8 / self.bandwidth_bps

    def lost_vector(self, n_values: int, transport: Transport, recovered: bool, parity_group: int,
                    deadline_s: float, base_s: float, parity_chunks: int = 2) -> Outcome:
        """The extra delay one vector may suffer on this link."""
        # a NACK goes back, the missing datagrams (about two) come again
        p, round_trip = self.plr, 2 * self.latency_s + 2 * MAX_DATAGRAM * 8 / self.bandwidth_bps
        if p <= 0:
            return Outcome.never()
        if transport is Transport.TCP:
            segments = max(1, math.ceil(n_values * SYNC_BYTES_PER_VALUE / TCP_SEGMENT_BYTES))
            return Outcome.maybe(1 - (1 - p) ** segments, TCP_MIN_RTO_S)
        chunks = datagrams(n_values)
        total = chunks + (parity_datagrams(chunks, parity_group, parity_chunks) if recovered else 0)
        gone = p ** total  # nothing of it arrives: nobody can NACK, the master chases
        if not recovered:
            return Outcome.maybe(1 - (1 - p) ** chunks, max(deadline_s - base_s, 0.0))
        nack = p_needs_nack(p, chunks, parity_group, parity_chunks) - gone
        return Outcome((0.0, NACK_GAP_S + round_trip, CHASE_FRACTION * deadline_s + round_trip),
                       (1 - nack - gone, nack, gone))


class RoundModel:
    """The rounds of one plan in one sync mode (see the module docstring)."""

    def __init__(self, plan: TensorParallelPlan, mode: str, sync: SyncSettings):
        self.plan, self.mode, self.sync = plan, mode, sync
        self.policy: ModePolicy | None = POLICIES.get(mode)
        profiles = plan.profiles()
        master = plan.cluster.devices[plan.cluster.master]
        self.compute = np.array([d.compute_flops for d in profiles])
        self.overhead = {k: np.array([d.overhead_s[i] for d in profiles]) for i, k in enumerate(TP_KINDS + ("lm_head",))}
        self.message = np.array([d.message_s for d in profiles])
        self.master_bps = master.bandwidth_bps
        self.links = [Link(d.latency_s, min(d.bandwidth_bps, master.bandwidth_bps),
                           0.0 if mode == "ideal" else 1 - (1 - d.plr) * (1 - master.plr)) for d in profiles]
        self.ranks = ({k: plan.priority_ranks(k) for k in TP_KINDS} if self.policy is not None and self.policy.remap
                      else {})

    def block_time(self, kind: str, counts: np.ndarray, layer: int) -> tuple[float, float, float]:
        """(slowest compute, loss-free round time, expected round time) of one block with these counts."""
        m = self.plan.model
        block = getattr(m, kind)
        work = np.where(counts > 0, self.overhead[kind] + block.flops * counts / self.compute, 0.0)
        holders = [j for j in range(1, len(counts)) if counts[j] > 0]
        if not holders:
            return work[0], work[0], work[0]
        n_in = PREFIX + m.rows * m.dim  # (an LM head's flops count its rows already)
        width = counts * (block.flops / (2 * m.dim)) if kind == "lm_head" else np.full(len(counts), m.rows * m.dim)
        send, receive = self.message[0] / 2, self.message[0] / 2 * len(holders)
        arrivals, queued = [], 0.0
        for k, j in enumerate(holders):
            link = self.links[j]
            queued += datagrams(n_in) * MAX_DATAGRAM * 8 / self.master_bps
            n_out = int(PREFIX + width[j])
            base = (send * (k + 1) + queued + link.transfer_s(n_in) + self.message[j] + work[j]
                    + link.transfer_s(n_out))
            arrivals.append((j, base, n_in, n_out))
        own = send * len(holders) + work[0]
        clean = max(own, *(a[1] for a in arrivals)) + receive
        if self.policy is None:
            return float(work.max()), clean, clean
        deadline = float(np.clip(self.sync.deadline_slack * np.median([a[1] for a in arrivals]),
                                 self.sync.deadline_floor_ms / 1e3, self.sync.deadline_ceiling_ms / 1e3))
        outcomes = []
        for j, base, n_in, n_out in arrivals:
            link = self.links[j]
            critical = self._critical(kind, layer, j)
            out_transport = self.policy.critical if critical else self.policy.other
            recovered = critical or self.policy.recover_other
            parity = self.sync.parity_group, self.sync.parity_chunks
            x = link.lost_vector(n_in, self.policy.input, True, parity[0], deadline, base, parity[1]).plus(
                link.lost_vector(n_out, out_transport, recovered, parity[0], deadline, base, parity[1]))
            outcomes.append((base, x))
        return float(work.max()), clean, expected_max(own, outcomes) + receive

    def _critical(self, kind: str, layer: int, j: int) -> bool:
        if self.policy.all_critical or kind == "lm_head" or layer == 0:
            return True
        if not self.policy.remap:
            return False
        ranks = self.ranks[kind][j, layer]
        return ranks[0] < math.ceil(self.sync.critical_fraction * getattr(self.plan.model, kind).count)

    def token(self) -> Estimate:
        compute = clean = expected = 0.0
        seen: dict[tuple, tuple[float, float, float]] = {}  # layers with the same counts cost the same
        for kind in TP_KINDS + ("lm_head",):
            counts = self.plan.counts[kind]
            columns = counts[:, None] if counts.ndim == 1 else counts
            for layer in range(columns.shape[1]):
                key = (kind, tuple(columns[:, layer].tolist()), layer == 0)
                if key not in seen:
                    seen[key] = self.block_time(kind, columns[:, layer], layer)
                c, t, e = seen[key]
                compute, clean, expected = compute + c, clean + t, expected + e
        return Estimate(float(compute), float(clean - compute), float(expected - clean))


def estimate(plan: TensorParallelPlan, mode: str = "ideal", deadline_s: float | None = None,
             sync: SyncSettings | None = None) -> Estimate:
    """The expected time per token of `plan` in sync `mode` ("ideal": no loss). deadline_s: a fixed
    deadline for droppable partials instead of the adaptive rule's (kept for callers of the old model)."""
    if mode not in ESTIMATE_MODES:
        raise ConfigError(f"unknown sync mode {mode!r}; choose one of {', '.join(ESTIMATE_MODES)}")
    sync = sync or SyncSettings(mode=mode if mode in SYNC_MODES else "exact")
    if deadline_s is not None:
        sync = SyncSettings(**{**sync.to_json(), "deadline_floor_ms": 1e3 * deadline_s,
                               "deadline_ceiling_ms": 1e3 * deadline_s})
    return RoundModel(plan, mode, sync).token()
