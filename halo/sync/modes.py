"""Sync modes: one vocabulary for the runtime and the scheduler, and what each mode does with a block.

A *round* is one block's synchronization: the master sends the block's input (the residual stream)
to the agents that need it, every holder computes its partial output, the partials come back and
are summed. A mode decides, per round, how the input travels, how each partial comes back, which
partials are *critical* (recovered until complete) and what happens to the others. `plan_round`
turns a mode and a block into a `RoundPlan`: plain data that tests read without sockets.

| mode | input | critical partials | other partials | groups |
|---|---|---|---|---|
| exact (default) | UDP until complete | every partial, UDP until complete | – | plan's, fixed |
| tcp | TCP | every partial, TCP | – | plan's, fixed |
| lossy | UDP until complete | layer 0 and the LM head, UDP until complete | UDP until the deadline, no recovery | fixed |
| halo | UDP until complete | + any holding a predicted-top group | UDP, recovered while the deadline allows, then zero-filled | MLP re-mapped per token |
| halo-tcp | TCP | TCP | as halo | as halo |

"UDP until complete" is the fast reliable path of transport/udp/ (gather.py): parity (P + Q: any two losses of a
group rebuilt at the receiver) and NACKs, so a lost packet costs at most a round trip instead of TCP's
200 ms minimum retransmission timeout; exact and tcp give at any loss the logits of a lossless run, bit for bit,
which are one device's up to float summation order (a split block's partial sums add in another grouping: a
greedy near-tie can go the other way, 1 of 50 held-out SmolLM2 chat answers did). Agents
that hold no groups of a block but need its input (they predict the next layer from it) are
*listeners*: they acknowledge the input with an empty partial, which is critical.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from enum import Enum

from halo.errors import ConfigError
from halo.transport import wire
from halo.transport.erasure import MAX_GROUP


class Transport(str, Enum):
    TCP = "tcp"  # the control connection (ZeroMQ): exact, a lost packet costs TCP's retransmission timeout
    UDP = "udp"  # chunked datagrams (transport/udp/)


@dataclass(frozen=True)
class ModePolicy:
    """What one sync mode does with a round's traffic."""

    input: Transport  # how a block's input reaches the agents
    critical: Transport  # how critical partials come back (always recovered until complete)
    other: Transport  # how the other partials come back
    all_critical: bool  # every partial is critical: the mode is exact
    recover_other: bool  # NACK / parity / re-sent inputs for non-critical partials while the deadline allows
    remap: bool  # MLP groups re-mapped per token by the predictors; criticality from their ranking

    @property
    def uses_udp(self) -> bool:
        """Whether any of a round's traffic can travel over UDP."""
        return Transport.UDP in (self.input, self.critical) or (not self.all_critical and self.other is Transport.UDP)


POLICIES: dict[str, ModePolicy] = {
    "exact": ModePolicy(Transport.UDP, Transport.UDP, Transport.UDP, all_critical=True, recover_other=True,
                        remap=False),
    "tcp": ModePolicy(Transport.TCP, Transport.TCP, Transport.TCP, all_critical=True, recover_other=True, remap=False),
    "lossy": ModePolicy(Transport.UDP, Transport.UDP, Transport.UDP, all_critical=False, recover_other=False,
                        remap=False),
    "halo": ModePolicy(Transport.UDP, Transport.UDP, Transport.UDP, all_critical=False, recover_other=True, remap=True),
    "halo-tcp": ModePolicy(Transport.TCP, Transport.TCP, Transport.UDP, all_critical=False, recover_other=True,
                           remap=True),
}
SYNC_MODES = tuple(POLICIES)
WIRE_PARTIALS = {"fp32": wire.FLOAT32, "fp16": wire.FLOAT16}
MAX_COPIES = 4
# The modes that read each sync knob (the CLI and the lm-eval plugin refuse one set where none reads it: --inject-plr
# under tcp measured a lossless run as "at 50 % loss"). auto may pick either, so what one of them reads. busy_poll
# (how a wait for datagrams waits) is the process's, not SyncSettings'.
KNOB_MODES: dict[str, tuple[str, ...]] = {
    "critical_fraction": ("halo", "halo-tcp"), "pred_overlap": ("halo", "halo-tcp"), "load_overlap": ("halo", "halo-tcp"),
    "wire_partials": ("lossy", "halo", "halo-tcp"),
    **{k: ("exact", "lossy", "halo", "halo-tcp", "auto")  # tcp sends no datagrams: nothing to drop, copy or wait for
       for k in ("inject_plr", "copies", "deadline_floor_ms", "deadline_ceiling_ms", "udp_gso", "busy_poll")}}
UNKNOWN_SETTINGS = "unknown sync settings"  # how an agent refuses a hello's settings it does not know (a newer master's)
RENAMED = {"reliable": "--sync reliable was renamed: use --sync exact (UDP, every packet recovered, the default) or "
                       "--sync tcp (the control connection)"}


@dataclass
class SyncSettings:
    mode: str = "exact"
    deadline_floor_ms: float = 5.0
    deadline_ceiling_ms: float = 100.0
    deadline_slack: float = 2.0
    critical_fraction: float = 0.25
    # in halo/lossy sync, each measured agent's own deadlines: its mean turnaround plus this many mean deviations, for
    # a partial with a hole (parity's tail) and for one with no sign of loss (halo/sync/deadline.py)
    loss_deviations: float = 2.0
    late_deviations: float = 6.0
    predict: bool = True  # False: static ranking, groups loaded once (the ablation's upper bound)
    pred_overlap: bool = True  # run prediction while partial sums are in flight
    load_overlap: bool = True  # load the next layer's groups in a background thread
    # parity chunks per this many data chunks (0: none), once a link has shown loss: P (XOR) rebuilds one lost chunk of
    # the group, P + Q (erasure.py) any two. Groups of 8 with 2: a TinyLlama vector (6 chunks) lacks 3 of its 8
    # datagrams 0.6 % of the time at 5 % loss; with one XOR per 4 chunks (the same 8 datagrams) a NACK was due 3 %.
    # A lone data chunk gets P alone (erasure.Q_FROM); SmolLM2's 2-chunk vectors go out as 2 + P + Q
    parity_group: int = 8
    parity_chunks: int = 2
    # once a link has shown loss, every vector (and its parity) sent this many times in a row: a burst of losses
    # (radio links lose frames in runs) that takes a chunk and its parity rarely reaches its copy a vector later,
    # where recovering costs a NACK's round trip (milliseconds on Wi-Fi); twice the bytes
    copies: int = 0  # 0: not set (one copy; --sync auto may pick more)
    inject_plr: float = 0.0  # drop this fraction of UDP datagrams at every sender (seeded, for accuracy runs)
    seed: int = 0
    # agents' partial sums over UDP as fp16: half the datagrams, so fewer of them at risk on a lossy link (relative
    # rounding 2e-4, eval/results/transport_compression.md); lossy sync modes only: exact promises one device's tokens
    wire_partials: str = "fp32"
    # a vector's datagrams to one peer handed to the kernel as one segmented send (UDP GSO, transport/_datagrams.c):
    # the same datagrams on the wire for ~40 % less of the sender's system time; False: one send a datagram
    udp_gso: bool = True
    # a read batch that is whole vectors (every chunk once, in order: what arrives when nothing was lost) is taken a
    # vector at a time, not a datagram at a time (~3 us of Python each): the same state, checks and statistics;
    # False: every datagram through the general path (for comparisons)
    whole_vectors: bool = True

    def __post_init__(self):
        self._check_types()
        if not 0 <= self.seed < 2 ** 64:  # (--seed's range: one seed drives the sampler and the loss injection)
            raise ConfigError(f"--seed must be an integer from 0 to 2^64 - 1, got {self.seed}")
        if self.mode in RENAMED:
            raise ConfigError(RENAMED[self.mode])
        if self.mode not in POLICIES:
            raise ConfigError(f"unknown sync mode {self.mode!r}; choose one of {', '.join(SYNC_MODES)}")
        if not 0 < self.deadline_floor_ms <= self.deadline_ceiling_ms:
            raise ConfigError(f"deadline floor {self.deadline_floor_ms} ms must be positive and at most the ceiling "
                              f"{self.deadline_ceiling_ms} ms")
        if not 0 <= self.loss_deviations <= self.late_deviations:  # (finite: _check_types)
            raise ConfigError(f"loss_deviations ({self.loss_deviations:g}) must lie in [0, late_deviations "
                              f"({self.late_deviations:g})]: a partial with a hole is cut no later than one without")
        if not 0.0 <= self.critical_fraction <= 1.0 or not 0.0 <= self.inject_plr < 1.0:
            raise ConfigError("critical_fraction must lie in [0, 1] and inject_plr in [0, 1)")
        if not 0 <= self.parity_group <= MAX_GROUP or self.parity_chunks not in (1, 2) or self.deadline_slack <= 0:
            raise ConfigError(f"parity_group must lie in [0, {MAX_GROUP}], parity_chunks be 1 or 2 and deadline_slack "
                              "> 0")
        if not 0 <= self.copies <= MAX_COPIES:
            raise ConfigError(f"copies must lie in [1, {MAX_COPIES}] (every vector sent that many times on a lossy link; "
                              "0: not set, one)")
        if self.wire_partials not in WIRE_PARTIALS:
            raise ConfigError(f"unknown partial-sum wire format {self.wire_partials!r}; choose one of {', '.join(WIRE_PARTIALS)}")
        if self.wire_partials != "fp32" and self.policy.all_critical:
            raise ConfigError(f"--sync {self.mode} gives the single-device tokens, which fp16 partial sums would round "
                              "away: use --wire-partials fp32 (the default), or --sync lossy / halo")

    def _check_types(self) -> None:
        """Each field of the type its default has (an int for a float; a bool is no number): the settings come from a
        master's hello too, and a wrong type must be refused there, not fail later inside the agent."""
        for name, field in self.__dataclass_fields__.items():
            value, kind = getattr(self, name), type(field.default)
            number = {int: numbers.Integral, float: numbers.Real}.get(kind)  # (numpy's too)
            ok = (isinstance(value, bool) if kind is bool else isinstance(value, kind) if number is None
                  else isinstance(value, number) and not isinstance(value, bool))
            if not ok:
                raise ConfigError(f"sync setting {name} must be {kind.__name__}, not {value!r}")
            if kind is float and not math.isfinite(value):
                raise ConfigError(f"sync setting {name} must be finite, not {value!r}")

    @property
    def policy(self) -> ModePolicy:
        return POLICIES[self.mode]

    def protection(self, lossy: bool) -> dict:
        """send_vector's redundancy for a vector to peers whose link has shown loss (lossy) or not: parity and
        copies only where it has (at 0 % loss they are datagrams for nothing)."""
        if not lossy:
            return {"parity_group": 0, "copies": 1}
        return {"parity_group": self.parity_group, "parity_chunks": self.parity_chunks, "copies": self.copies_sent}

    @property
    def copies_sent(self) -> int:
        """Copies of each vector on a lossy link (`copies`, one where it is not set)."""
        return max(1, self.copies)

    @property
    def partial_dtype(self) -> int:
        """The wire dtype of agents' partial sums over UDP."""
        return WIRE_PARTIALS[self.wire_partials]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, fields: dict) -> "SyncSettings":
        known = set(cls.__dataclass_fields__)
        unknown = set(fields) - known
        if unknown:
            raise ConfigError(f"{UNKNOWN_SETTINGS} {sorted(unknown)}")
        return cls(**fields)


def ranks_next_layer_itself(policy: ModePolicy, mlp_share, layer: int) -> bool:
    """Whether a HALO device that ranks for itself (over TCP every one; over UDP one that loads its groups ahead)
    predicts layer+1's ranking from layer's attention input. Over UDP the master's MLP input of `layer` carries the
    next layer's ranking (framing.py), so only a device holding MLP ranks of layer+1 and none of `layer` predicts;
    one that never does needs no predictors loaded. mlp_share: its MLP groups per layer."""
    if not (0 <= layer < len(mlp_share) - 1 and mlp_share[layer + 1]):
        return False
    return policy.input is not Transport.UDP or not mlp_share[layer]


@dataclass(frozen=True)
class RoundPlan:
    """One round's traffic, by peer id: who gets the input how, and how each partial comes back."""

    input_udp: frozenset[int]
    input_tcp: frozenset[int]
    partial_udp: frozenset[int]  # holders and listeners answering over UDP
    partial_tcp: frozenset[int]  # holders answering over the control connection
    critical: frozenset[int]  # partials that must arrive whole (hard deadline: the master's timeout)
    nack: frozenset[int]  # UDP partials whose holes are NACKed
    chase: frozenset[int]  # UDP partials the master chases when their sender is silent: it sends a UDP input
    # again (the peer may have lost all of it), or asks for every chunk of a partial whose input went over TCP

    @property
    def receivers(self) -> frozenset[int]:
        return self.input_udp | self.input_tcp


def plan_round(policy: ModePolicy, holders, listeners=(), critical=()) -> RoundPlan:
    """The traffic of a round whose partials come from `holders`; `listeners` need the input but hold no
    groups (they acknowledge it); `critical` are the holders whose partial must arrive whole (ignored when
    every partial is critical in this mode)."""
    holders, listeners = frozenset(holders), frozenset(listeners) - frozenset(holders)
    critical = holders if policy.all_critical else frozenset(critical) & holders
    other = holders - critical
    receivers = holders | listeners
    udp_input = policy.input is Transport.UDP
    acks = listeners if udp_input else frozenset()  # a TCP input needs no acknowledgement
    partial_tcp = (critical if policy.critical is Transport.TCP else frozenset()) | (
        other if policy.other is Transport.TCP else frozenset())
    partial_udp = (holders - partial_tcp) | acks
    must = (critical | acks) & partial_udp
    recovered = must | (other & partial_udp if policy.recover_other else frozenset())
    return RoundPlan(input_udp=receivers if udp_input else frozenset(), input_tcp=frozenset() if udp_input else receivers,
                     partial_udp=partial_udp, partial_tcp=partial_tcp, critical=critical | acks, nack=recovered, chase=recovered)
