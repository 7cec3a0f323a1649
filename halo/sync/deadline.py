"""When the master stops waiting for a round's droppable partials.

Per agent, block kind and input size (tokens, in powers of two: a prefill is not a decode step),
an exponentially weighted mean (alpha 0.2) of its turnaround: the time from the master sending a
block's input to that agent's partial being complete (its compute + the link round trip + recovery).
A round's droppable partials get

    deadline = clamp(floor, ceiling, slack * median(turnaround of the round's holders))

measured from the moment the input was sent. The median, not the maximum: one straggling agent does
not stretch everyone's deadline (defaults: floor 5 ms, ceiling 100 ms, slack 2); its low-importance
share is what gets dropped. Before any measurement the ceiling applies. The ceiling is per token of the
round's input: a 64-token prefill does ~64x a decode step's work, and a fixed 100 ms cut every prefill
round (non-critical partials dropped as late, agents chased while still computing).

That deadline is for partials that showed loss (holes, NACKs, a chase): what HALO saves is the
retransmission wait. A partial with no sign of loss (arriving in order, or not yet sent: its agent
is computing) is only late, and gets the looser

    late deadline = clamp(max(floor, late floor), ceiling, late slack * median)   (20 ms, 4 x)

so a busy or descheduled device is not cut off for timing alone (at 0 % loss nothing is dropped
that arrives within 4 x the usual turnaround). Drops are counted by cause (loss / late).

In the modes that drop (not exact), each non-critical agent also gets deadlines of its own, from its turnaround's
mean m and mean deviation v (both exponentially weighted, as TCP estimates a retransmission timeout, RFC 6298):

    loss deadline = clamp(floor, ceiling, m + 2 v)        late deadline = clamp(20 ms, ceiling, m + 6 v)

A partial with a hole is complete on time only if parity rebuilds it with the vector's tail, which arrives within
the link's usual spread (m + 2 v); a NACK's answer costs a round trip more, which is what HALO does not wait for. A
partial with no sign of loss is cut only far out in its own spread. Over a Wi-Fi link (m ~ 15 ms, v ~ 3 ms) that is
21 / 33 ms, where the round-wide rule gives 30 / 60; on a busy 2-core bed (m ~ 2, v ~ 1) the floors hold, as
before. Until an agent's turnaround is known the round-wide rule applies to it. A partial cut at its deadline counts
as a turnaround of that long (as TCP backs its timeout off): counting only the partials that came in time would
pull m and v down and the deadlines with them. What the paragraphs below say of the late deadline and the chase
holds for the round-wide rule: a measured agent silent past its own late deadline is dropped, chased or not, once
no other agent is awaited (a gather cuts no peer while it waits for another: transport/udp/gather.py _hold).

An agent that has sent nothing is chased (halo/sync/modes.py: its input sent again) after 0.6 x the
late deadline: when it takes 2.4 x its usual turnaround (at least 12 ms). Chasing at 0.6 x the loss
deadline sent inputs again to agents that were only computing on a busy machine. A chased agent keeps
the late deadline (silence is no hole): it had been cut at the chase itself, past its loss deadline.
"""

from __future__ import annotations

from halo.sync.modes import SyncSettings
from halo.transport.udp import PeerDeadline

CHASE_FRACTION = 0.6
LATE_SLACK = 4.0
LATE_FLOOR_S = 0.020
DEVIATION_BETA = 0.25  # RFC 6298's weight of a new sample in the mean deviation


def clip(value: float, low: float, high: float) -> float:
    """np.clip for one float (every round computes two deadlines: np.clip on scalars cost ~5 us each)."""
    return float(min(max(value, low), high))


class AdaptiveDeadline:
    ALPHA = 0.2

    def __init__(self, settings: SyncSettings):
        self.floor = settings.deadline_floor_ms / 1e3
        self.ceiling = settings.deadline_ceiling_ms / 1e3
        self.slack = settings.deadline_slack
        self.loss_deviations, self.late_deviations = settings.loss_deviations, settings.late_deviations
        self.turnaround: dict[tuple, float] = {}  # (block kind, agent, size class) -> EWMA seconds
        self.deviation: dict[tuple, float] = {}  # the same key -> EWMA of |sample - turnaround| (seconds)

    @staticmethod
    def _key(kind: str, agent: int, tokens: int) -> tuple:
        return kind, agent, max(0, int(tokens) - 1).bit_length()  # work grows with tokens: powers of two

    def observe(self, kind: str, agent: int, seconds: float, tokens: int = 1) -> None:
        key = self._key(kind, agent, tokens)
        old = self.turnaround.get(key)
        if old is None:  # RFC 6298's first sample: the spread taken as half of it until others come
            self.turnaround[key], self.deviation[key] = seconds, seconds / 2
            return
        self.deviation[key] += DEVIATION_BETA * (abs(seconds - old) - self.deviation[key])
        self.turnaround[key] = old + self.ALPHA * (seconds - old)

    def _median(self, kind: str, agents, tokens: int) -> float | None:
        known = sorted(self.turnaround[k] for k in (self._key(kind, a, tokens) for a in agents) if k in self.turnaround)
        if not known:
            return None
        middle = len(known) // 2  # a few agents: plain Python beats numpy's per-call cost here (every round)
        return known[middle] if len(known) % 2 else (known[middle - 1] + known[middle]) / 2

    def ceiling_s(self, tokens: int = 1) -> float:
        return self.ceiling * max(1, int(tokens))

    def deadline_s(self, kind: str, agents, tokens: int = 1) -> float:
        """For partials that showed loss."""
        median, ceiling = self._median(kind, agents, tokens), self.ceiling_s(tokens)
        return ceiling if median is None else clip(self.slack * median, self.floor, ceiling)

    def late_deadline_s(self, kind: str, agents, tokens: int = 1) -> float:
        """For partials with no sign of loss (in order, or not sent yet)."""
        median, ceiling = self._median(kind, agents, tokens), self.ceiling_s(tokens)
        floor = max(self.floor, LATE_FLOOR_S)
        return ceiling if median is None else clip(LATE_SLACK * median, floor, max(floor, ceiling))

    def per_peer(self, kind: str, agents, tokens: int = 1) -> dict[int, PeerDeadline]:
        """Each agent's own deadlines, from its turnaround's mean and spread (agents not measured yet: none)."""
        ceiling, late_floor = self.ceiling_s(tokens), max(self.floor, LATE_FLOOR_S)
        out = {}
        for agent in agents:
            key = self._key(kind, agent, tokens)
            if key in self.turnaround:
                mean, spread = self.turnaround[key], self.deviation[key]
                out[agent] = PeerDeadline(loss_s=clip(mean + self.loss_deviations * spread, self.floor, ceiling),
                                          late_s=clip(mean + self.late_deviations * spread, late_floor,
                                                      max(late_floor, ceiling)))
        return out

    @staticmethod
    def chase_after_s(deadline_s: float) -> float:
        return max(CHASE_FRACTION * deadline_s, 0.001)
