"""Pipeline-layer plans: Algorithm 5.1's DP, worker-order search, partial plans."""

import itertools

import numpy as np
import pytest

from halo.scheduler.pipeline import Units, dp_assign, plan_pipeline, plan_units, stage_costs
from halo.scheduler.profiles import Cluster, DeviceProfile, model_profile, named_config

GB = 1e9


def units(memory, flops=None):
    n = len(memory)
    return Units([f"u{i}" for i in range(n)], np.asarray(flops if flops is not None else [1e9] * n, float),
                 np.asarray(memory, float), np.full(n, 4.0), np.full(n, 4.0))


def test_order_decides_feasibility_16gb_then_8gb():
    u = units([16 * GB, 1 * GB])
    workers = [DeviceProfile("w8", 8 * GB, 1e12), DeviceProfile("w16", 16 * GB, 1e12)]
    costs = [stage_costs(w, u) for w in workers]
    assert not np.isfinite(dp_assign([0, 1], costs, 2)[0])  # (8 GB, 16 GB): no plan
    cost, stages, covered = dp_assign([1, 0], costs, 2)
    assert np.isfinite(cost) and stages == [(1, 0, 1), (0, 1, 2)] and covered == 2
    plan = plan_units(workers, u)
    assert plan.complete and plan.stages == [(1, 0, 1), (0, 1, 2)]


def brute_force(order, u, workers):
    """Every way to cut the units into len(order) contiguous (possibly empty) ranges."""
    n, best = len(u), np.inf
    costs = [stage_costs(w, u) for w in workers]
    for cuts in itertools.combinations_with_replacement(range(n + 1), len(order) - 1):
        bounds = [0, *cuts, n]
        best = min(best, sum(costs[w][a, b] for w, a, b in zip(order, bounds[:-1], bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, m = int(rng.integers(2, 7)), int(rng.integers(1, 4))
    u = units(rng.uniform(0.5, 3, n) * GB, rng.uniform(0.5, 2, n) * 1e9)
    workers = [DeviceProfile(f"w{i}", float(rng.uniform(1, 8)) * GB, float(rng.uniform(1, 10)) * 1e9,
                             bandwidth_bps=float(rng.uniform(1e8, 1e9)), latency_s=float(rng.uniform(0, 5e-3)))
               for i in range(m)]
    order = list(rng.permutation(m))
    cost = dp_assign(order, [stage_costs(w, u) for w in workers], n)[0]
    expected = brute_force(order, u, workers)
    assert (cost == expected == np.inf) or cost == pytest.approx(expected, rel=1e-12)


def test_each_worker_at_most_once_and_ranges_contiguous():
    model = model_profile(named_config("tinyllama-1.1b"), "fp16")
    workers = tuple(DeviceProfile(f"g{i}", 0.6 * GB, 5e12, bandwidth_bps=1e9) for i in range(6))
    plan = plan_pipeline(Cluster(workers, context=512, weights="fp16"), model)
    assert plan.complete
    assert len({w for w, _, _ in plan.stages}) == len(plan.stages)
    assert plan.stages[0][1] == 0 and plan.stages[-1][2] == plan.n_units
    assert all(a[2] == b[1] for a, b in zip(plan.stages, plan.stages[1:]))


def test_partial_plan_when_the_cluster_cannot_hold_the_model():
    model = model_profile(named_config("tinyllama-1.1b"), "fp16")
    workers = tuple(DeviceProfile(f"g{i}", 0.3 * GB, 5e12) for i in range(3))
    plan = plan_pipeline(Cluster(workers, context=512, weights="fp16"), model)
    assert not plan.complete and 0 < plan.covered < plan.n_units


@pytest.mark.parametrize("m", [9, 30])  # simulated annealing, then time-bounded random search
def test_large_clusters_use_the_heuristic_searches(m):
    rng = np.random.default_rng(m)
    model = model_profile(named_config("tinyllama-1.1b"), "fp16")
    workers = tuple(DeviceProfile(f"g{i}", float(rng.choice([0.3, 0.6, 1.2])) * GB, float(rng.uniform(1, 10)) * 1e12)
                    for i in range(m))
    plan = plan_pipeline(Cluster(workers, context=512, weights="fp16"), model, time_budget_s=0.05)
    assert plan.complete
