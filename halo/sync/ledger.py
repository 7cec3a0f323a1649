"""What relaxed synchronization gave up in a generation: shown by --json and `halo-master status`."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LossLedger:
    blocks: int = 0  # rounds with at least one droppable partial
    partials: int = 0
    partials_dropped: int = 0  # partial sums with at least one chunk zero-filled
    dropped_for_loss: int = 0  # ... after losing chunks the deadline left no time to recover
    dropped_late: int = 0  # ... that showed no loss but came too late (a slow or descheduled device)
    chunks_expected: int = 0
    chunks_missing: int = 0
    groups_offered: int = 0  # groups whose contribution travelled over a lossy path
    groups_dropped: float = 0.0  # groups x missing fraction of their partial
    by_layer: dict = field(default_factory=lambda: defaultdict(lambda: {"attention": 0.0, "mlp": 0.0}))
    dropped_ranks: list = field(default_factory=list)  # predicted rank (0 = most important) of each dropped group

    def record(self, kind: str, layer: int, groups: int, missing: int, chunks: int, ranks=None, lost: bool = True) -> None:
        """One partial: `missing` of its `chunks` zero-filled; lost: the cause was packet loss (else lateness)."""
        self.partials += 1
        self.chunks_expected += chunks
        self.chunks_missing += missing
        self.groups_offered += groups
        if missing:
            fraction = missing / chunks
            self.partials_dropped += 1
            self.dropped_for_loss += lost
            self.dropped_late += not lost
            self.groups_dropped += groups * fraction
            self.by_layer[layer][kind] += groups * fraction
            if ranks is not None:
                self.dropped_ranks.extend(int(r) for r in ranks)

    def to_json(self) -> dict:
        ranks = np.asarray(self.dropped_ranks)
        return {"blocks": self.blocks, "partials": self.partials, "partials_dropped": self.partials_dropped,
                "dropped_for_loss": self.dropped_for_loss, "dropped_late": self.dropped_late,
                "chunks_expected": self.chunks_expected, "chunks_missing": self.chunks_missing,
                "groups_offered_lossy": self.groups_offered, "groups_dropped": round(self.groups_dropped, 3),
                "dropped_by_layer": {str(k): {kk: round(vv, 3) for kk, vv in v.items()}
                                     for k, v in sorted(self.by_layer.items())},
                "dropped_rank_mean": float(ranks.mean()) if len(ranks) else None,
                "dropped_rank_min": int(ranks.min()) if len(ranks) else None}
