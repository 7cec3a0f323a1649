"""Relaxed synchronization: the sync modes, what travels how, when the master stops waiting, and what was lost.

Sync modes (`--sync`):
- reliable: every message over the control connection (ZeroMQ/TCP): exact; a lost packet costs a TCP
  retransmission timeout (~200 ms). The paper's "TCP" baseline.
- lossy: broadcasts over UDP on the fast reliable path (parity + NACK until complete); every agent's
  partial sum over UDP with the deadline, no recovery; groups mapped statically (rank r = group r).
  The baseline HALO compares against.
- halo: semantic-aware. The trained predictors rank the next layer's groups from the hidden state
  entering the current layer, on the master and on every agent; MLP ranks map to devices through
  the plan's priority ranges (Algorithm 3), so the most reliable links (the master's own share first)
  carry the most important groups. A partial sum is *critical* when it holds a group in the top
  `critical_fraction` of the predicted ranking: critical partials are recovered until complete;
  the others are recovered (parity, NACK) while the deadline allows, and only what is still missing
  then is zero-filled ("recover first, drop last").
- halo-tcp: as halo, but broadcasts and critical partials go over TCP, as the paper did.

Always reliable in every mode: layer 0, every broadcast (it feeds the KV caches), the LM head. An
agent handles attention inputs in order and never skips one (it asks for one it never saw a
datagram of); one that still never comes marks its caches incomplete and it answers STATUS_KV_GAP
until the next reset, which stops the master with an error. An agent that has sent nothing for the
master's timeout is reported as gone, even when all its partials were droppable.

Attention heads stay where the plan put them (their KV caches cannot move per token); in halo mode
their predicted ranking decides which attention partials are critical. MLP groups are re-mapped per
token.

The deadline rule (`AdaptiveDeadline`): per agent, block kind and input size (tokens, in powers of
two: a prefill is not a decode step), an exponentially weighted mean (alpha 0.2) of its turnaround, i.e. the time from the master sending a block's input to that agent's partial being
complete (its compute + the link round trip + recovery). A block's lossy partials get
    deadline = clamp(floor, ceiling, slack * median(turnaround of the block's holders))
measured from the moment the input was sent. The median, not the maximum: one straggling agent
does not stretch everyone's deadline (defaults: floor 5 ms, ceiling 100 ms, slack 2), its low-importance share is what gets dropped. Before any
measurement the ceiling applies. An agent that has sent nothing
gets its input again (it may have lost the whole broadcast; it re-sends its partial if it had it)
after 0.6 x the deadline (with slack 2: when it is 20 % later than usual).

Framing: UDP vectors carry a 4-float prefix. Broadcast: [tokens, start position, ranking digest, 0],
padded to whole chunks (the receiver learns the size from the chunk count). Partial: [compute ms,
ranking digest, status, 0]. Floats hold integers exactly below 2^24, so digests are 24-bit.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np

from .errors import ConfigError

SYNC_MODES = ("reliable", "lossy", "halo", "halo-tcp")
PREFIX = 4
ATTENTION, MLP, LM_HEAD = 0, 2, 4  # sync points of a layer's broadcasts; a partial is point + 1
POINTS = {"attention": ATTENTION, "mlp": MLP, "lm_head": LM_HEAD}
STATUS_OK, STATUS_RANKING_MISMATCH, STATUS_KV_GAP = 1.0, 2.0, 3.0


@dataclass
class SyncSettings:
    mode: str = "reliable"
    deadline_floor_ms: float = 5.0
    deadline_ceiling_ms: float = 100.0
    deadline_slack: float = 2.0
    critical_fraction: float = 0.25
    predict: bool = True  # False: static ranking, groups loaded once (the ablation's upper bound)
    pred_overlap: bool = True  # run prediction while partial sums are in flight
    load_overlap: bool = True  # load the next layer's groups in a background thread
    parity_group: int = 4  # one XOR parity chunk per this many data chunks (0: none)
    inject_plr: float = 0.0  # drop this fraction of UDP datagrams at every sender (seeded, for accuracy runs)
    seed: int = 0

    def __post_init__(self):
        if self.mode not in SYNC_MODES:
            raise ConfigError(f"unknown sync mode {self.mode!r}; choose one of {', '.join(SYNC_MODES)}")
        if not 0 < self.deadline_floor_ms <= self.deadline_ceiling_ms:
            raise ConfigError(f"deadline floor {self.deadline_floor_ms} ms must be positive and at most the ceiling "
                              f"{self.deadline_ceiling_ms} ms")
        if not 0.0 <= self.critical_fraction <= 1.0 or not 0.0 <= self.inject_plr < 1.0:
            raise ConfigError("critical_fraction must lie in [0, 1] and inject_plr in [0, 1)")
        if self.parity_group < 0 or self.deadline_slack <= 0:
            raise ConfigError("parity_group must be >= 0 and deadline_slack > 0")

    @property
    def udp(self) -> bool:
        return self.mode != "reliable"

    @property
    def semantic(self) -> bool:
        """Predictor-driven group mapping (halo, halo-tcp)."""
        return self.mode in ("halo", "halo-tcp")

    @property
    def udp_broadcast(self) -> bool:
        return self.mode in ("lossy", "halo")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, fields: dict) -> "SyncSettings":
        known = set(cls.__dataclass_fields__)
        unknown = set(fields) - known
        if unknown:
            raise ConfigError(f"unknown sync settings {sorted(unknown)}")
        return cls(**fields)


def frame(prefix: list[float], array: np.ndarray, per_chunk: int | None = None) -> np.ndarray:
    """prefix + array as one float32 vector; padded to whole chunks of per_chunk values when given."""
    body = np.concatenate([np.asarray(prefix, dtype=np.float32), np.asarray(array, dtype=np.float32).reshape(-1)])
    if per_chunk:
        body = np.concatenate([body, np.zeros(-len(body) % per_chunk, dtype=np.float32)])
    return body


def ranking_digest(ranking: np.ndarray | None) -> int:
    """24 bits of CRC-32 over a ranking (int16): every device must hold the same one."""
    if ranking is None:
        return 0
    return zlib.crc32(np.ascontiguousarray(ranking, dtype="<i2").tobytes()) & 0xFFFFFF


class AdaptiveDeadline:
    """The master's deadline for a block's lossy partials (rule in the module docstring)."""

    ALPHA = 0.2

    def __init__(self, settings: SyncSettings):
        self.floor = settings.deadline_floor_ms / 1e3
        self.ceiling = settings.deadline_ceiling_ms / 1e3
        self.slack = settings.deadline_slack
        self.turnaround: dict[tuple[str, int], float] = {}  # (block kind, agent) -> EWMA seconds

    @staticmethod
    def _key(kind: str, agent: int, tokens: int) -> tuple:
        return kind, agent, max(0, int(tokens) - 1).bit_length()  # work grows with tokens: powers of two

    def observe(self, kind: str, agent: int, seconds: float, tokens: int = 1) -> None:
        key = self._key(kind, agent, tokens)
        old = self.turnaround.get(key)
        self.turnaround[key] = seconds if old is None else old + self.ALPHA * (seconds - old)

    def deadline_s(self, kind: str, agents, tokens: int = 1) -> float:
        keys = [self._key(kind, a, tokens) for a in agents]
        known = [self.turnaround[k] for k in keys if k in self.turnaround]
        if not known:
            return self.ceiling
        return float(np.clip(self.slack * np.median(known), self.floor, self.ceiling))


@dataclass
class LossLedger:
    """What relaxed synchronization gave up, per generation: visible in --json and `halo-master status`."""

    blocks: int = 0  # block merges with at least one agent partial
    partials: int = 0
    partials_dropped: int = 0  # partial sums with at least one chunk zero-filled
    chunks_expected: int = 0
    chunks_missing: int = 0
    groups_offered: int = 0  # groups whose contribution travelled over a lossy path
    groups_dropped: float = 0.0  # groups x missing fraction of their partial
    by_layer: dict = field(default_factory=lambda: defaultdict(lambda: {"attention": 0.0, "mlp": 0.0}))
    dropped_ranks: list = field(default_factory=list)  # predicted rank (0 = most important) of each dropped group
    dropped_norm_fraction: list = field(default_factory=list)  # |dropped part| / |block output|, where measurable

    def record(self, kind: str, layer: int, groups: int, missing: int, chunks: int, ranks=None,
               norm_fraction: float | None = None) -> None:
        self.partials += 1
        self.chunks_expected += chunks
        self.chunks_missing += missing
        self.groups_offered += groups
        if missing:
            fraction = missing / chunks
            self.partials_dropped += 1
            self.groups_dropped += groups * fraction
            self.by_layer[layer][kind] += groups * fraction
            if ranks is not None:
                self.dropped_ranks.extend(int(r) for r in ranks)
            if norm_fraction is not None:
                self.dropped_norm_fraction.append(float(norm_fraction))

    def to_json(self) -> dict:
        ranks = np.asarray(self.dropped_ranks)
        return {"blocks": self.blocks, "partials": self.partials, "partials_dropped": self.partials_dropped,
                "chunks_expected": self.chunks_expected, "chunks_missing": self.chunks_missing,
                "groups_offered_lossy": self.groups_offered, "groups_dropped": round(self.groups_dropped, 3),
                "dropped_by_layer": {str(k): {kk: round(vv, 3) for kk, vv in v.items()}
                                     for k, v in sorted(self.by_layer.items())},
                "dropped_rank_mean": float(ranks.mean()) if len(ranks) else None,
                "dropped_rank_min": int(ranks.min()) if len(ranks) else None,
                "dropped_norm_fraction_mean": (float(np.mean(self.dropped_norm_fraction))
                                               if self.dropped_norm_fraction else None)}
