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

from .profiles import Cluster, ModelProfile
from .tp_plan import SYNC_BYTES_PER_VALUE, TP_KINDS, TensorParallelPlan, prune_idle


@dataclass
class MilpResult:
    plan: TensorParallelPlan | None
    objective_s: float  # of the best plan found
    bound_s: float  # proven lower bound on the optimum (equals objective_s when optimal)
    optimal: bool
    message: str


def solve_exact(cluster: Cluster, model: ModelProfile, time_limit_s: float = 10.0,
                participants: set[int] | None = None, relax: bool = False) -> MilpResult:
    """participants fixes who takes part (the master always does); relax solves the LP relaxation."""
    n, L = len(cluster.devices), model.n_layers
    master = cluster.master
    blocks = [getattr(model, k) for k in TP_KINDS]
    K = len(blocks)
    ctx = cluster.context
    compute = np.array([d.compute_flops for d in cluster.devices])
    budget = np.array([d.memory_bytes for d in cluster.devices])
    md = cluster.devices[master]
    t_c = md.latency_s + model.dim * SYNC_BYTES_PER_VALUE * 8 / md.bandwidth_bps

    def w(l, i, k):
        return (l * n + i) * K + k

    nw = L * n * K
    v0, z0, t0 = nw, nw + n, nw + 2 * n
    tv = t0 + L * K
    nvar = tv + 1
    cost = np.zeros(nvar)
    cost[t0:t0 + L * K] = 1.0
    cost[tv] = 1.0
    cost[z0:z0 + n] = (2 * L + 1) * t_c
    lower, upper = np.zeros(nvar), np.full(nvar, np.inf)
    integrality = np.zeros(nvar)
    for l in range(L):
        for i in range(n):
            for k, b in enumerate(blocks):
                upper[w(l, i, k)] = b.count
    upper[v0:v0 + n] = model.lm_head.count
    upper[z0:z0 + n] = 1
    lower[z0 + master] = 1
    if participants is not None:
        for i in range(n):
            lower[z0 + i] = upper[z0 + i] = 1.0 if (i in participants or i == master) else 0.0
    if not relax:
        integrality[:tv - L * K] = 1  # W, V, z integer; t continuous
    lo, hi = [], []
    A = lil_matrix((L * K + 1 + L * n * K + n + n + n * (L * K + 1) + L * K + 1, nvar))
    r = 0
    for l in range(L):  # all groups assigned
        for k, b in enumerate(blocks):
            for i in range(n):
                A[r, w(l, i, k)] = 1
            lo.append(b.count); hi.append(b.count); r += 1
    for i in range(n):
        A[r, v0 + i] = 1
    lo.append(model.lm_head.count); hi.append(model.lm_head.count); r += 1
    for l in range(L):  # t >= each device's time
        for k, b in enumerate(blocks):
            for i in range(n):
                A[r, t0 + l * K + k] = 1
                A[r, w(l, i, k)] = -b.flops / compute[i]
                lo.append(0); hi.append(np.inf); r += 1
    for i in range(n):
        A[r, tv] = 1
        A[r, v0 + i] = -model.lm_head.flops / compute[i]
        lo.append(0); hi.append(np.inf); r += 1
    for i in range(n):  # memory
        for l in range(L):
            for k, b in enumerate(blocks):
                A[r, w(l, i, k)] = model.group_bytes(b, ctx)
        A[r, v0 + i] = model.lm_head.bytes
        A[r, z0 + i] = model.predictor_bytes + (model.embedding_bytes if i == master else 0)
        lo.append(-np.inf); hi.append(budget[i]); r += 1
    for i in range(n):  # groups only on participants (big-M: what fits in its memory at most)
        for l in range(L):
            for k, b in enumerate(blocks):
                A[r, w(l, i, k)] = 1
                A[r, z0 + i] = -min(b.count, budget[i] // model.group_bytes(b, ctx))
                lo.append(-np.inf); hi.append(0); r += 1
        A[r, v0 + i] = 1
        A[r, z0 + i] = -min(model.lm_head.count, budget[i] // model.lm_head.bytes)
        lo.append(-np.inf); hi.append(0); r += 1
    for i in range(n):  # cut: the participants must hold the whole model
        A[r, z0 + i] = budget[i]
    lo.append(model.total_bytes(ctx) + model.predictor_bytes); hi.append(np.inf); r += 1
    for l in range(L - 1):  # layers are interchangeable: order them by time (breaks symmetry)
        for k in range(K):
            A[r, t0 + l * K + k] = 1
            A[r, t0 + (l + 1) * K + k] = -1
            lo.append(0); hi.append(np.inf); r += 1
    A = A[:r].tocsr()
    res = milp(cost, integrality=integrality, bounds=Bounds(lower, upper),
               constraints=LinearConstraint(A, np.array(lo), np.array(hi)),
               options={"time_limit": time_limit_s, "disp": False})
    constant = -(2 * L + 1) * t_c  # the "- 1" of (sum(z) - 1): the master's own transfers are free
    bound = getattr(res, "mip_dual_bound", None)
    bound_s = float(bound) + constant if bound is not None and np.isfinite(bound) else 0.0
    if res.x is None:
        return MilpResult(None, float("inf"), bound_s, False, res.message)
    x = np.rint(res.x).astype(np.int64)
    counts = {kind: np.array([[x[w(l, i, k)] for l in range(L)] for i in range(n)])
              for k, kind in enumerate(TP_KINDS)}
    counts["lm_head"] = x[v0:v0 + n]
    plan = TensorParallelPlan(cluster, model, "exact", list(range(n)), counts)
    order = [master] + [i for i in range(n) if i != master]
    plan.devices = order
    plan.counts = {k: v[order] for k, v in counts.items()}
    plan = prune_idle(plan)
    optimal = res.status == 0
    objective = float(res.fun) + constant
    return MilpResult(plan, objective, objective if optimal else bound_s, optimal, res.message)


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
    md = cluster.devices[master]
    t_c = md.latency_s + model.dim * SYNC_BYTES_PER_VALUE * 8 / md.bandwidth_bps
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
