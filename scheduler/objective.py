"""Eq. 1 of the HALO paper: the time per token a plan costs with loss ignored (what the planner minimizes).

Computation: for every layer and block, the slowest participant's share (FLOPs of its groups / its
FLOP/s), plus the LM head. Communication: every layer synchronizes twice (after attention and after
the MLP) and the LM head once; in each synchronization the master sends the hidden state to, and
receives a partial sum from, each other participant over its own link, so the (n - 1) transfers of
one round queue on the master's link: T_c = latency + D * bytes per value / bandwidth per transfer,
(2 L + 1)(n - 1) T_c per token.
"""

from __future__ import annotations

import numpy as np

from halo.scheduler.plan import SYNC_BYTES_PER_VALUE, TP_KINDS, TensorParallelPlan
from halo.scheduler.profiles import Cluster, ModelProfile


def compute_seconds(plan: TensorParallelPlan) -> float:
    compute = np.array([d.compute_flops for d in plan.profiles()])
    total = 0.0
    for kind in TP_KINDS:
        per_device = getattr(plan.model, kind).flops * plan.counts[kind] / compute[:, None]  # [n, L]
        total += per_device.max(axis=0).sum()
    return total + float((plan.model.lm_head.flops * plan.counts["lm_head"] / compute).max())


def transfer_seconds(cluster: Cluster, model: ModelProfile) -> float:
    """T_c: one hidden-state transfer on the master's link."""
    master = cluster.devices[cluster.master]
    return master.latency_s + model.rows * model.dim * SYNC_BYTES_PER_VALUE * 8 / master.bandwidth_bps


def sync_rounds(model: ModelProfile) -> int:
    """Synchronizations per token: two per layer and the LM head."""
    return 2 * model.n_layers + 1


def comm_seconds(plan: TensorParallelPlan) -> float:
    return sync_rounds(plan.model) * (plan.n - 1) * transfer_seconds(plan.cluster, plan.model)


def eq1_objective(plan: TensorParallelPlan) -> float:
    """Eq. 1 (plus the LM head), in seconds per token."""
    return compute_seconds(plan) + comm_seconds(plan)
