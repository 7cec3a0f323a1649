"""The exact integer program of Eq. 1 (plus the LM head), solved with scipy's MILP (HiGHS).

Variables: W[l,i,k] groups of block k in layer l on device i; V[i] LM-head groups; z[i] whether
device i takes part; t[l,k] and t_v the slowest device's time per block. Minimize
sum(t) + t_v + (2L + 1) (sum(z) - 1) T_c subject to: every block's groups all assigned; t above each
device's time; memory (groups, their KV cache, and when taking part its predictors, and the
master's embeddings) within budget; groups only on participants; the master takes part.
Ground truth for small instances; slow for large ones (a time limit returns the best found).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from halo.errors import ConfigError
from halo.scheduler.objective import transfer_seconds
from halo.scheduler.plan import TP_KINDS, TensorParallelPlan
from halo.scheduler.profiles import Cluster, ModelProfile
from halo.scheduler.tp_plan import prune_idle


@dataclass
class MilpResult:
    plan: TensorParallelPlan | None
    objective_s: float  # of the best plan found
    bound_s: float  # proven lower bound on the optimum (equals objective_s when optimal)
    optimal: bool
    message: str


class _ExactProgram:
    """The MILP's variables (W, V, z, t, t_v in one vector), objective, bounds and constraint rows."""

    def __init__(self, cluster: Cluster, model: ModelProfile):
        self.cluster, self.model = cluster, model
        self.n, self.L = len(cluster.devices), model.n_layers
        self.blocks = [getattr(model, k) for k in TP_KINDS]
        self.K = len(self.blocks)
        self.compute = np.array([d.compute_flops for d in cluster.devices])
        self.budget = np.array([d.memory_bytes for d in cluster.devices])
        self.t_c = transfer_seconds(cluster, model)
        nw = self.L * self.n * self.K
        self.v0, self.z0, self.t0 = nw, nw + self.n, nw + 2 * self.n
        self.tv = self.t0 + self.L * self.K
        self.size = self.tv + 1
        self.rows, self.lo, self.hi = [], [], []

    def w(self, l: int, i: int, k: int) -> int:
        return (l * self.n + i) * self.K + k

    def cost(self) -> np.ndarray:
        cost = np.zeros(self.size)
        cost[self.t0:self.t0 + self.L * self.K] = 1.0
        cost[self.tv] = 1.0
        cost[self.z0:self.z0 + self.n] = (2 * self.L + 1) * self.t_c
        return cost

    def bounds(self, participants: set[int] | None) -> Bounds:
        lower, upper = np.zeros(self.size), np.full(self.size, np.inf)
        for l, i, k in np.ndindex(self.L, self.n, self.K):
            upper[self.w(l, i, k)] = self.blocks[k].count
        upper[self.v0:self.v0 + self.n] = self.model.lm_head.count
        upper[self.z0:self.z0 + self.n] = 1
        lower[self.z0 + self.cluster.master] = 1
        if participants is not None:
            for i in range(self.n):
                taking_part = i in participants or i == self.cluster.master
                lower[self.z0 + i] = upper[self.z0 + i] = 1.0 if taking_part else 0.0
        return Bounds(lower, upper)

    def integrality(self, relax: bool) -> np.ndarray:
        integrality = np.zeros(self.size)
        if not relax:
            integrality[:self.t0] = 1  # W, V, z integer; t continuous
        return integrality

    def _row(self, coefficients: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append(coefficients)
        self.lo.append(lo)
        self.hi.append(hi)

    def constraints(self) -> LinearConstraint:
        m, ctx, n, K = self.model, self.cluster.context, self.n, self.K
        for l, k in np.ndindex(self.L, K):  # all groups assigned
            self._row({self.w(l, i, k): 1 for i in range(n)}, self.blocks[k].count, self.blocks[k].count)
        self._row({self.v0 + i: 1 for i in range(n)}, m.lm_head.count, m.lm_head.count)
        for l, k, i in np.ndindex(self.L, K, n):  # t >= each device's time
            self._row({self.t0 + l * K + k: 1, self.w(l, i, k): -self.blocks[k].flops / self.compute[i]}, 0, np.inf)
        for i in range(n):
            self._row({self.tv: 1, self.v0 + i: -m.lm_head.flops / self.compute[i]}, 0, np.inf)
        for i in range(n):  # memory
            row = {self.w(l, i, k): m.group_bytes(self.blocks[k], ctx) for l, k in np.ndindex(self.L, K)}
            row[self.v0 + i] = m.lm_head.bytes
            row[self.z0 + i] = m.predictor_bytes + (m.embedding_bytes if i == self.cluster.master else 0)
            self._row(row, -np.inf, self.budget[i])
        for i in range(n):  # groups only on participants (big-M: what fits in its memory at most)
            for l, k in np.ndindex(self.L, K):
                b = self.blocks[k]
                self._row({self.w(l, i, k): 1, self.z0 + i: -min(b.count, self.budget[i] // m.group_bytes(b, ctx))},
                          -np.inf, 0)
            self._row({self.v0 + i: 1, self.z0 + i: -min(m.lm_head.count, self.budget[i] // m.lm_head.bytes)},
                      -np.inf, 0)
        # cut: the participants must hold the whole model
        self._row({self.z0 + i: self.budget[i] for i in range(n)}, m.total_bytes(ctx) + m.predictor_bytes, np.inf)
        for l, k in np.ndindex(self.L - 1, K):  # layers are interchangeable: order them by time (breaks symmetry)
            self._row({self.t0 + l * K + k: 1, self.t0 + (l + 1) * K + k: -1}, 0, np.inf)
        A = lil_matrix((len(self.rows), self.size))
        for r, row in enumerate(self.rows):
            for column, value in row.items():
                A[r, column] = value
        return LinearConstraint(A.tocsr(), np.array(self.lo), np.array(self.hi))

    def plan(self, x: np.ndarray) -> TensorParallelPlan:
        x = np.rint(x).astype(np.int64)
        n, master = self.n, self.cluster.master
        counts = {kind: np.array([[x[self.w(l, i, k)] for l in range(self.L)] for i in range(n)])
                  for k, kind in enumerate(TP_KINDS)}
        counts["lm_head"] = x[self.v0:self.v0 + n]
        order = [master] + [i for i in range(n) if i != master]
        plan = TensorParallelPlan(self.cluster, self.model, "exact", order, {k: v[order] for k, v in counts.items()})
        return prune_idle(plan)


def solve_exact(cluster: Cluster, model: ModelProfile, time_limit_s: float = 10.0,
                participants: set[int] | None = None, relax: bool = False) -> MilpResult:
    """participants fixes who takes part (the master always does); relax solves the LP relaxation."""
    program = _ExactProgram(cluster, model)
    res = milp(program.cost(), integrality=program.integrality(relax), bounds=program.bounds(participants),
               constraints=program.constraints(), options={"time_limit": time_limit_s, "disp": False})
    constant = -(2 * model.n_layers + 1) * program.t_c  # the "- 1" of (sum(z) - 1): the master's transfers are free
    bound = getattr(res, "mip_dual_bound", None)
    bound_s = float(bound) + constant if bound is not None and np.isfinite(bound) else 0.0
    if res.x is None:
        return MilpResult(None, float("inf"), bound_s, False, res.message)
    optimal = res.status == 0
    objective = float(res.fun) + constant
    return MilpResult(program.plan(res.x), objective, objective if optimal else bound_s, optimal, res.message)


def exact_plan(cluster: Cluster, model: ModelProfile) -> TensorParallelPlan:
    """`--algorithm exact`: the solver's plan, or why there is none."""
    result = solve_exact(cluster, model)
    if result.plan is None:
        raise ConfigError(f"the exact solver found no plan ({result.message}): where it is infeasible the devices' "
                          "memory cannot hold the model; `--algorithm minmax` names the shortfall")
    return result.plan


def _integer_block_bound(compute: np.ndarray, flops: float, count: int) -> float:
    """Least possible finishing time of one block with integer groups and no memory limit:
    give each group to the device that would finish it soonest (exact for min-max)."""
    assigned = np.zeros(len(compute))
    for _ in range(count):
        j = int(np.argmin((assigned + 1) / compute))
        assigned[j] += 1
    return flops * float(np.max(assigned / compute))


def lower_bound(cluster: Cluster, model: ModelProfile, time_limit_s: float = 5.0) -> float:
    """A proven lower bound on Eq. 1's optimum: the least, over participant sets (with the master),
    of the larger of two relaxations for that set: the LP (memory kept, integrality dropped) and the
    integer split with memory ignored. Enumerates 2^(n-1) sets: for evaluation, not for planning."""
    import itertools

    n, master = len(cluster.devices), cluster.master
    t_c = transfer_seconds(cluster, model)
    others = [i for i in range(n) if i != master]
    best = float("inf")
    for k in range(n):
        for extra in itertools.combinations(others, k):
            subset = [master, *extra]
            if sum(cluster.devices[i].memory_bytes for i in subset) < model.total_bytes(cluster.context):
                continue
            compute = np.array([cluster.devices[i].compute_flops for i in subset])
            integer = (model.n_layers * sum(_integer_block_bound(compute, b.flops, b.count) for b in model.tp_blocks)
                       + _integer_block_bound(compute, model.lm_head.flops, model.lm_head.count)
                       + (2 * model.n_layers + 1) * (len(subset) - 1) * t_c)
            if integer >= best:
                continue
            lp = solve_exact(cluster, model, time_limit_s, participants=set(subset), relax=True)
            if lp.plan is not None:
                best = min(best, max(lp.objective_s, integer))
    return best
