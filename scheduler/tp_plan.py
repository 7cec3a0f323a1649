"""Tensor-parallel plans: integer neuron-group counts per device, layer and block, and priority ranks.

From ratios (ratios.py) to a plan:
1. Integer counts. Device i should take r_i * N groups of each layer. Per layer, the cumulative
   targets are rounded with a phase that shifts from layer to layer, so every layer sums exactly to
   N and every device's total over the layers is within one group of r_i * N * L.
2. Memory repair. A device whose groups, KV cache, predictors (and, on the master, embeddings)
   exceed its budget hands groups, one at a time, to the device with room that would finish that
   layer's block soonest. When nobody has room, planning fails naming the shortfall.
3. Priority ranks (Algorithm 3). Within every layer and block, devices sorted by packet loss rate
   take consecutive ranks: the most reliable link gets ranks 0, 1, ... (the most important groups),
   the least reliable the last ranks.

Device selection (`plan_tp` default): every participant adds synchronizations, so the default
planner also chooses who takes part, minimizing Eq. 1 over candidate subsets (see `select_devices`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from halo.errors import ConfigError

from .profiles import Cluster, ModelProfile
from .ratios import ALGORITHMS, InsufficientMemory, check_capacity

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

    def priority_ranks(self, kind: str) -> np.ndarray:
        """Algorithm 3: [n, L, 2] half-open rank ranges (lm_head: [n, 1, 2]); rank 0 = most important."""
        counts = self.counts[kind]
        counts = counts[:, None] if counts.ndim == 1 else counts
        plr = np.array([d.plr for d in self.profiles()])
        order = np.argsort(plr, kind="stable")
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


def round_counts(ratios: np.ndarray, n_groups: int, n_layers: int) -> np.ndarray:
    """[n, L] integer counts: each layer sums to n_groups; device totals within one group of r*N*L."""
    cumulative = np.cumsum(ratios) * n_groups
    cumulative[-1] = n_groups
    phases = (np.arange(n_layers) + 0.5) / n_layers
    edges = np.floor(cumulative[:, None] + phases[None, :] + 1e-9)  # [n, L]
    edges = np.vstack([np.zeros((1, n_layers)), edges])
    return np.diff(edges, axis=0).astype(np.int64)


def repair_memory(plan: TensorParallelPlan) -> None:
    """Move groups off devices over budget onto devices with room (in place); raises if impossible."""
    budgets = np.array([d.memory_bytes for d in plan.profiles()])
    compute = np.array([d.compute_flops for d in plan.profiles()])
    m, ctx = plan.model, plan.cluster.context
    kinds = sorted(TP_KINDS + ("lm_head",), key=lambda k: -m.group_bytes(getattr(m, k), ctx))
    used = plan.memory_used()
    for _ in range(100_000):
        over = used - budgets
        i = int(np.argmax(over))
        if over[i] <= 0:
            return
        moved = False
        for kind in kinds:  # biggest groups first: fewest moves
            block = getattr(m, kind)
            size = m.group_bytes(block, ctx)
            counts = plan.counts[kind]
            layered = counts.ndim == 2
            if layered:
                held = counts[i]
                if held.max() == 0:
                    continue
                layer = int(np.argmax(held))  # the layer where it holds the most groups
                column = counts[:, layer]
            else:
                if counts[i] == 0:
                    continue
                column = counts
            room = budgets - used >= size
            room[i] = False
            if not room.any():
                continue
            finish = np.where(room, block.flops * (column + 1) / compute, np.inf)
            j = int(np.argmin(finish))
            if layered:
                counts[i, layer] -= 1
                counts[j, layer] += 1
            else:
                counts[i] -= 1
                counts[j] += 1
            used[i] -= size
            used[j] += size
            moved = True
            break
        if not moved:
            raise InsufficientMemory(
                f"device {plan.profiles()[i].name!r} needs {over[i] / 1e6:.1f} MB more than its budget and no other "
                f"participant has room for one more neuron group: add memory or devices, or shorten the context")
    raise ConfigError("memory repair did not converge")  # pragma: no cover - bounded by the group count


def build_plan(cluster: Cluster, model: ModelProfile, algorithm: str = "minmax",
               devices: list[int] | None = None) -> TensorParallelPlan:
    """Ratios from `algorithm` over `devices` (default: all), rounded, repaired, as a plan."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    devices = list(range(len(cluster.devices))) if devices is None else list(devices)
    if cluster.master not in devices:
        raise ConfigError("the master must take part in every plan")
    devices.sort(key=lambda i: (i != cluster.master, i))
    profiles = [cluster.devices[i] for i in devices]
    fixed = fixed_bytes(cluster, model, devices)
    usable = np.array([d.memory_bytes for d in profiles]) - fixed
    compute = np.array([d.compute_flops for d in profiles])
    ctx = cluster.context
    demand = model.total_bytes(ctx) - model.embedding_bytes
    if algorithm != "vanilla":
        check_capacity(np.maximum(usable, 0), demand)
    ratios = ALGORITHMS[algorithm](np.maximum(usable, 0), compute, demand)
    counts = {kind: round_counts(ratios, getattr(model, kind).count, model.n_layers) for kind in TP_KINDS}
    counts["lm_head"] = round_counts(ratios, model.lm_head.count, 1)[:, 0]
    plan = TensorParallelPlan(cluster, model, algorithm, devices, counts)
    if algorithm == "vanilla":  # the baseline ignores memory: report, do not fix
        over = plan.memory_used() > np.array([d.memory_bytes for d in profiles])
        plan.oom = [p.name for p, o in zip(profiles, over) if o]
    else:
        repair_memory(plan)
    return prune_idle(plan)


def prune_idle(plan: TensorParallelPlan) -> TensorParallelPlan:
    """Drop participants left with no groups (Computation-Greedy's unused devices); the master stays."""
    busy = [j for j, i in enumerate(plan.devices)
            if i == plan.cluster.master or any(plan.counts[k][j].sum() > 0 for k in plan.counts)]
    if len(busy) == plan.n:
        return plan
    plan.devices = [plan.devices[j] for j in busy]
    plan.counts = {k: v[busy] for k, v in plan.counts.items()}
    return plan


def _threshold(usable: np.ndarray, compute: np.ndarray, demand: float) -> float:
    """Exact Min-Max threshold T: sum(min(u_i, T c_i)) = demand (piecewise linear in T)."""
    order = np.argsort(usable / compute)
    filled, rate = 0.0, compute.sum()
    for i in order:
        t = (demand - filled) / rate
        if t <= usable[i] / compute[i]:
            return t
        filled += usable[i]
        rate -= compute[i]
    return float("inf")


def _fractional_objective(cluster: Cluster, model: ModelProfile, devices: list[int], t_c: float) -> float:
    """Eq. 1 for Min-Max ratios before rounding: cheap enough to score many subsets."""
    profiles = [cluster.devices[i] for i in devices]
    usable = np.maximum(np.array([d.memory_bytes for d in profiles]) - fixed_bytes(cluster, model, devices), 0)
    compute = np.array([d.compute_flops for d in profiles])
    demand = model.total_bytes(cluster.context) - model.embedding_bytes
    if usable.sum() < demand:
        return float("inf")
    t = _threshold(usable, compute, demand)
    share = np.minimum(usable, t * compute)
    slowest = float(np.max(share / share.sum() / compute))
    work = model.n_layers * sum(b.flops * b.count for b in model.tp_blocks) + model.lm_head.flops * model.lm_head.count
    return work * slowest + (2 * model.n_layers + 1) * (len(devices) - 1) * t_c


def candidate_subsets(cluster: Cluster, model: ModelProfile, keep: int = 3) -> list[list[int]]:
    """Participant sets worth rounding: the best `keep` found by growing the set fastest-first,
    by greedy addition and by greedy removal, scored with the fractional Eq. 1."""
    from .cost import TCP_MIN_RTO_S  # noqa: F401  (cost's constants document the model this mirrors)

    master = cluster.master
    master_profile = cluster.devices[master]
    t_c = master_profile.latency_s + model.dim * SYNC_BYTES_PER_VALUE * 8 / master_profile.bandwidth_bps
    score_cache: dict[tuple[int, ...], float] = {}

    def score(subset) -> float:
        key = tuple(sorted(subset))
        if key not in score_cache:
            score_cache[key] = _fractional_objective(cluster, model, list(key), t_c)
        return score_cache[key]

    everyone = list(range(len(cluster.devices)))
    others = sorted((i for i in everyone if i != master), key=lambda i: -cluster.devices[i].compute_flops)
    for k in range(len(others) + 1):  # fastest-first prefixes
        score([master] + others[:k])
    current = [master]  # greedy addition
    while True:
        options = [current + [i] for i in everyone if i not in current]
        if not options:
            break
        best = min(options, key=score)
        if score(best) >= score(current) and score(current) < float("inf"):
            break
        current = best
    current = everyone  # greedy removal
    while len(current) > 1:
        best = min(([i for i in current if i != drop] for drop in current if drop != master), key=score)
        if score(best) >= score(current):
            break
        current = best
    ranked = sorted((s for s in score_cache.items() if s[1] < float("inf")), key=lambda s: s[1])
    return [list(subset) for subset, _ in ranked[:keep]]


def plan_tp(cluster: Cluster, model: ModelProfile, algorithm: str = "minmax", select: bool = True) -> TensorParallelPlan:
    """The default planner: Min-Max over the participant set that minimizes Eq. 1.

    With select=False (or any algorithm but minmax) every device takes part, as in the paper's algorithms."""
    from .cost import eq1_objective

    if not select or algorithm != "minmax":
        return build_plan(cluster, model, algorithm)
    plans = []
    for subset in candidate_subsets(cluster, model) or [list(range(len(cluster.devices)))]:
        try:
            plans.append(build_plan(cluster, model, "minmax", subset))
        except InsufficientMemory:
            continue  # rounding left no room on this subset; another may fit
    if not plans:
        return build_plan(cluster, model, "minmax")  # raises the informative shortfall
    best = min(plans, key=eq1_objective)
    best.algorithm = "minmax+select"
    return best
