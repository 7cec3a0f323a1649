"""A tensor-parallel plan: how many neuron groups of each block every participant computes, and its memory.

Plain data shared by the planner (tp_plan.py), the objective (objective.py), the cost model
(cost.py), the exact solver (milp.py) and plan files (plan_io.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from halo.scheduler.profiles import Cluster, ModelProfile

TP_KINDS = ("attention", "mlp")
SYNC_BYTES_PER_VALUE = 4  # partial sums and broadcasts travel as float32


@dataclass
class TensorParallelPlan:
    cluster: Cluster
    model: ModelProfile
    algorithm: str
    devices: list[int]  # indices into cluster.devices of the participants, master first
    counts: dict[str, np.ndarray]  # "attention"/"mlp": [n, L]; "lm_head": [n]
    oom: list[str] = field(default_factory=list)  # devices over budget (only for algorithms that ignore memory)

    @property
    def n(self) -> int:
        return len(self.devices)

    def profiles(self):
        return [self.cluster.devices[i] for i in self.devices]

    def memory_used(self) -> np.ndarray:
        """Bytes each participant holds: its groups, their KV cache, predictors, embeddings on the master."""
        m, ctx = self.model, self.cluster.context
        used = np.zeros(self.n)
        for kind in TP_KINDS:
            block = getattr(m, kind)
            used += self.counts[kind].sum(axis=1) * m.group_bytes(block, ctx)
        used += self.counts["lm_head"] * m.lm_head.bytes
        used += fixed_bytes(self.cluster, m, self.devices)
        return used

    def whole_on_master(self, kind: str) -> bool:
        """Every group of a block kind on the master while agents take part (tp_plan.on_master): no sync round."""
        return self.n > 1 and not self.counts[kind][1:].any()

    @property
    def heads_on_master(self) -> bool:
        return self.whole_on_master("attention")

    @property
    def lm_head_on_master(self) -> bool:
        return self.whole_on_master("lm_head")

    def sync_rounds(self) -> int:
        """Rounds a token syncs over the network: blocks in which an agent holds groups (the master's alone send
        nothing)."""
        remote = [self.counts[kind][1:].any(axis=0) for kind in TP_KINDS]
        return int(sum(r.sum() for r in remote) + self.counts["lm_head"][1:].any())

    def reliability_order(self) -> list[int]:
        """Participants (plan positions) from the most reliable to the least: the master first (its own
        share never crosses the network), then by the packet loss rate of their links (Algorithm 3)."""
        plr = [d.plr for d in self.profiles()]
        return sorted(range(self.n), key=lambda j: (self.devices[j] != self.cluster.master, plr[j]))

    def priority_ranks(self, kind: str) -> np.ndarray:
        """Algorithm 3: [n, L, 2] half-open rank ranges (lm_head: [n, 1, 2]); rank 0 = most important."""
        counts = self.counts[kind]
        counts = counts[:, None] if counts.ndim == 1 else counts
        order = self.reliability_order()
        ranges = np.zeros(counts.shape + (2,), dtype=np.int64)
        start = np.zeros(counts.shape[1], dtype=np.int64)
        for i in order:
            ranges[i, :, 0] = start
            start = start + counts[i]
            ranges[i, :, 1] = start
        return ranges


def fixed_bytes(cluster: Cluster, model: ModelProfile, devices: list[int]) -> np.ndarray:
    """Memory a participant needs whatever its share: predictors, and the embeddings on the master."""
    fixed = np.full(len(devices), model.predictor_bytes, dtype=float)
    for j, i in enumerate(devices):
        if i == cluster.master:
            fixed[j] += model.embedding_bytes
    return fixed
