"""Ratio algorithms (HALO Algorithms 1-2, baselines) and Algorithm 3's priority ranks."""

import numpy as np
import pytest

from halo.scheduler.profiles import Cluster, DeviceProfile
from halo.scheduler.ratios import InsufficientMemory, computation_greedy, galaxy, memory_aware, min_max, vanilla
from halo.scheduler.plan import TensorParallelPlan
from halo.scheduler.tp_plan import round_counts


def test_paper_example_for_algorithm_3():
    # 8 groups, PLRs [0.0, 0.5, 0.1], ratios [0.4, 0.4, 0.2] -> [1,2,3], [6,7,8], [4,5] (1-based ranks)
    cluster = Cluster(tuple(DeviceProfile(f"d{i}", 1e9, 1e9, plr=p) for i, p in enumerate([0.0, 0.5, 0.1])))
    counts = round_counts(np.array([0.4, 0.4, 0.2]), 8, 1)
    plan = TensorParallelPlan(cluster, None, "example", [0, 1, 2], {"attention": counts})
    ranks = plan.priority_ranks("attention")[:, 0]
    assert [list(range(a + 1, b + 1)) for a, b in ranks] == [[1, 2, 3], [6, 7, 8], [4, 5]]


def test_computation_greedy_fills_the_fastest_first():
    r = computation_greedy(np.array([4.0, 4.0, 4.0]), np.array([1.0, 2.0, 3.0]), 6.0)
    np.testing.assert_allclose(r, [0, 1 / 3, 2 / 3])


def test_min_max_follows_compute_until_memory_caps():
    np.testing.assert_allclose(min_max(np.array([4.0, 4, 4]), np.array([1.0, 2, 3]), 6.0), [1 / 6, 2 / 6, 3 / 6], atol=1e-8)
    np.testing.assert_allclose(min_max(np.array([10.0, 1, 1]), np.array([1.0, 1, 1]), 6.0), [4 / 6, 1 / 6, 1 / 6], atol=1e-8)


def test_galaxy_moves_overflow_to_spare_memory_and_min_max_beats_it():
    m, c = np.array([10.0, 10, 1]), np.array([1.0, 2, 3])
    g = galaxy(m, c, 6.0)
    np.testing.assert_allclose(g * 6, [1 + 2 * 9 / 17, 2 + 2 * 8 / 17, 1], atol=1e-9)
    mm = min_max(m, c, 6.0)
    assert np.max(mm * 6 / c) < np.max(g * 6 / c)  # 1.67 < 2.06


def test_baselines():
    np.testing.assert_allclose(vanilla(np.ones(4), np.ones(4), 1.0), 0.25)
    np.testing.assert_allclose(memory_aware(np.array([1.0, 3.0]), np.ones(2), 2.0), [0.25, 0.75])


@pytest.mark.parametrize("algorithm", [computation_greedy, min_max, galaxy, memory_aware])
def test_too_little_memory_names_the_shortfall(algorithm):
    with pytest.raises(InsufficientMemory, match=r"short by 2.0 MB"):
        algorithm(np.array([1e6, 1e6]), np.ones(2), 4e6)


def test_round_counts_are_exact_per_layer_and_fair_over_layers():
    ratios = np.array([0.37, 0.13, 0.29, 0.21])
    counts = round_counts(ratios, 14, 32)
    assert (counts.sum(axis=0) == 14).all()
    np.testing.assert_array_less(np.abs(counts.sum(axis=1) - ratios * 14 * 32), 1.0 + 1e-9)
