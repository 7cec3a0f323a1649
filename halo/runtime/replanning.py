"""Re-planning a running cluster: what both runtimes share.

The tensor-parallel master (halo/distributed/survive.py) and the pipeline coordinator
(halo/pipeline/coordinator.py) survive the same events the same way: a device that fails leaves the
plan and is quarantined; one whose quarantine is over is asked (without blocking generation) whether
it is back, and taken into the next plan if the plan would change; every `rebalance_every_s` the
devices' observed speeds are planned over, and the new plan is taken only when the cost model
predicts it `rebalance_gain` faster. Each re-plan is one `Recovery` record. What differs stays with
each runtime: how it plans (neuron-group shares vs layer ranges) and how it rebuilds (both replay
the token history through the new assignment).

Hysteresis: after its k-th failure a device waits `rejoin_after_s * 2**(k-1)` (at most
`MAX_QUARANTINE_S`) before it is asked again, so a flapping device costs a re-plan every few seconds
at most, not one per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MAX_QUARANTINE_S = 300.0
STATUS_TIMEOUT_S = 0.5  # who is alive, after a failure: agents and stage workers answer status at once


@dataclass
class SurvivalSettings:
    rejoin_after_s: float = 5.0  # quarantine after a first failure (doubles with each further one)
    max_attempts: int = 4  # rebuilds within one pass before giving up
    rebalance_every_s: float = 10.0  # how often the running estimates are planned over (0: never)
    rebalance_gain: float = 0.2  # re-plan for stragglers only when the cost model predicts this much faster
    status_timeout_s: float = STATUS_TIMEOUT_S
    # tensor parallel, exact modes: a loss spreads only the lost device's groups over the others, who keep theirs
    # (and their kernels); a return takes back its own. False: every re-plan plans and builds from scratch
    sticky: bool = True
    # tensor parallel: the master keeps the residual stream entering each attention block (up to this many MB) and
    # a re-plan fills the new KV caches from it instead of replaying the history (0: always replay)
    input_log_mb: float = 256.0


@dataclass
class Recovery:
    """One re-plan: why, who left or came back, what it cost."""

    kind: str  # "lost" (a device failed), "joined" (one came back) or "rebalanced" (stragglers)
    cause: str  # the error, or what the re-plan was for
    lost: list[str]  # devices the new plan no longer has
    joined: list[str]  # devices it has again
    members: list  # the new plan: its agents' endpoints, or its stages as [worker, first unit, stop unit]
    replayed_tokens: int
    seconds: float  # from the failure (or the join) to the history replayed on the new assignment
    detected_after_s: float | None = None  # from the start of the failed call to the failure, where known
    sticky: bool = False  # survivors kept their groups (only what moved was built)
    refilled: bool = False  # the KV caches were filled from the recorded inputs (no replay through every block)
    kept_groups: int | None = None  # groups whose built kernels the devices kept (tensor parallel)
    moved_groups: int | None = None  # groups built anew

    def to_json(self) -> dict:
        out = {"kind": self.kind, "cause": self.cause, "lost": self.lost, "joined": self.joined, "members": self.members,
               "replayed_tokens": self.replayed_tokens, "seconds": round(self.seconds, 3)}
        if self.detected_after_s is not None:
            out["detected_after_s"] = round(self.detected_after_s, 4)
        if self.sticky:
            out["sticky"] = True
        if self.refilled:
            out["refilled"] = True
        if self.kept_groups is not None:
            out.update(kept_groups=self.kept_groups, moved_groups=self.moved_groups)
        return out


def recovery_kind(cause: str) -> str:
    return "joined" if cause == "joined" else "rebalanced" if cause.startswith("rebalanced") else "lost"


@dataclass
class Absent:
    """A device outside the current plan, and when to ask it again."""

    not_before: float = 0.0
    probe: object = None  # a zmq socket with a status request in flight
    asked_at: float = 0.0


@dataclass
class Membership:
    """The devices out of the plan: quarantine after a failure, non-blocking status probes after it.

    `ask(name)` sends a status request and returns the socket it waits on (anything with poll(timeout_ms)
    and close(linger)); `returning()` is called between passes and never blocks."""

    settings: SurvivalSettings
    ask: object  # name -> socket with a status request in flight
    absent: dict[str, Absent] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # kept when a device returns: each failure after it
    # doubles its quarantine (they were dropped on return, and an agent that answered status but refused every hello
    # was taken back every rejoin_after_s: 39 re-plans in one generation)

    def fail(self, name: str) -> None:
        """`name` failed (again): out of the plan, asked again after its quarantine."""
        absent = self.absent.setdefault(name, Absent())
        self._drop_probe(absent)
        self.failures[name] = self.failures.get(name, 0) + 1
        absent.not_before = time.monotonic() + min(MAX_QUARANTINE_S,
                                                   self.settings.rejoin_after_s * 2 ** (self.failures[name] - 1))

    def returning(self) -> list[str]:
        """Devices that answered a status request since the last call (they leave the absent set); probes
        devices whose quarantine is over, and gives up on a probe nobody answered (asked again later)."""
        now, back = time.monotonic(), []
        for name, absent in self.absent.items():
            if absent.probe is None:
                if now >= absent.not_before:
                    absent.probe, absent.asked_at = self.ask(name), now
            elif absent.probe.poll(0):
                back.append(name)
            elif now - absent.asked_at > max(1.0, self.settings.rejoin_after_s):
                self._drop_probe(absent)  # nobody there yet: ask again later
                absent.not_before = now + self.settings.rejoin_after_s
        for name in back:
            self._drop_probe(self.absent.pop(name))
        return back

    def report(self) -> dict:
        now = time.monotonic()
        return {name: {"failures": self.failures[name], "asked_again_in_s": round(max(0.0, a.not_before - now), 1)}
                for name, a in self.absent.items()}

    def close(self) -> None:
        for absent in self.absent.values():
            self._drop_probe(absent)

    @staticmethod
    def _drop_probe(absent: Absent) -> None:
        if absent.probe is not None:
            absent.probe.close(linger=0)
            absent.probe = None


@dataclass
class RebalanceClock:
    """When to plan over the observed speeds again, and whether the result is worth a replay."""

    settings: SurvivalSettings
    last: float = field(default_factory=time.monotonic)

    def due(self) -> bool:
        every = self.settings.rebalance_every_s
        return bool(every) and time.monotonic() - self.last >= every

    def checked(self) -> None:
        self.last = time.monotonic()

    def worth_it(self, now_s: float, new_s: float) -> bool:
        """A re-plan costs a replay: only a persistent difference of at least `rebalance_gain` pays for it (a
        transient stall is the deadline's business)."""
        return new_s <= (1 - self.settings.rebalance_gain) * now_s


def status_probe(context, endpoint: str, key, insecure: bool):
    """A socket to `endpoint` with a status request in flight: agents and stage workers both answer one
    between messages, at once."""
    import zmq

    from halo.transport.reliable import Message, client_socket, encode

    sock = client_socket(context, key, insecure, endpoint)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(encode(Message("status")))
    return sock
