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


def solve_exact(cluster: Cluster, model: ModelProfile, time_limit_s: float = 10.0) -> MilpResult:
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
    integrality[:tv - L * K] = 1  # W, V, z integer; t continuous
    rows, lo, hi = [], [], []
    A = lil_matrix((L * K + 1 + L * n * K + n + n + n * (L * K + 1) + L * K, nvar))
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
    for i in range(n):  # groups only on participants
        for l in range(L):
            for k, b in enumerate(blocks):
                A[r, w(l, i, k)] = 1
                A[r, z0 + i] = -b.count
                lo.append(-np.inf); hi.append(0); r += 1
        A[r, v0 + i] = 1
        A[r, z0 + i] = -model.lm_head.count
        lo.append(-np.inf); hi.append(0); r += 1
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
