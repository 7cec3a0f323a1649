"""Workload ratios: what fraction of every block's neuron groups each device takes (HALO §III-B4).

All functions take the devices' usable memory m (bytes), compute power c (FLOP/s) and the model's
memory demand M_t, and return ratios r (summing to 1). Pure functions, no I/O.

Galaxy, as implemented here: the two-step scheme HALO's baseline section describes. Step 1 splits
by compute; step 2 caps every device that would run out of memory and moves its overflow, in one
pass, to the other devices in proportion to their spare memory (not their compute). A variant
that re-distributes overflow in proportion to compute, repeated until nothing overflows
(water-filling), equals Min-Max exactly, so it is not a separate baseline.
"""

from __future__ import annotations

import numpy as np

from halo.errors import ConfigError


class InsufficientMemory(ConfigError):
    """The devices together cannot hold the model."""


def check_capacity(m: np.ndarray, total: float) -> None:
    if m.sum() < total:
        raise InsufficientMemory(f"the cluster can hold {m.sum() / 1e6:.1f} MB but the model needs {total / 1e6:.1f} MB "
                                 f"(short by {(total - m.sum()) / 1e6:.1f} MB): add devices, raise memory budgets, "
                                 "shorten the context or use a smaller weight format")


def vanilla(m: np.ndarray, c: np.ndarray, total: float) -> np.ndarray:
    """Even split; ignores memory (may run out of memory)."""
    return np.full(len(m), 1.0 / len(m))


def memory_aware(m: np.ndarray, c: np.ndarray, total: float) -> np.ndarray:
    """Split in proportion to memory budgets; never out of memory, ignores compute."""
    check_capacity(m, total)
    return m / m.sum()


def computation_greedy(m: np.ndarray, c: np.ndarray, total: float) -> np.ndarray:
    """Algorithm 1: fill the fastest devices to their memory, the rest get nothing."""
    check_capacity(m, total)
    u = np.zeros(len(m))
    left = total
    for i in np.argsort(-c, kind="stable"):
        u[i] = min(m[i], left)
        left -= u[i]
        if left <= 0:
            break
    return u / u.sum()


def exact_threshold(usable, compute, demand: float) -> float:
    """The least T with sum(min(u_i, T c_i)) >= demand.

    The sum is piecewise linear in T with breakpoints u_i / c_i, so T is found exactly by walking
    them in order: the answer Algorithm 2's bisection converges to, without its iterations."""
    order = sorted(range(len(usable)), key=lambda i: usable[i] / compute[i])
    filled, rate, t = 0.0, float(sum(compute)), float("inf")
    for i in order:
        t = (demand - filled) / rate
        if t <= usable[i] / compute[i]:
            return t
        filled += usable[i]
        rate -= compute[i]
    return t


def min_max_threshold(m: np.ndarray, c: np.ndarray, total: float) -> float:
    """Algorithm 2's SearchThreshold."""
    check_capacity(m, total)
    return exact_threshold(m.tolist(), c.tolist(), total)


def min_max(m: np.ndarray, c: np.ndarray, total: float) -> np.ndarray:
    """Algorithm 2: minimize the slowest device's time; devices fill with compute until memory caps them."""
    t = min_max_threshold(m, c, total)
    u = np.minimum(m, t * c)
    return u / u.sum()


def galaxy(m: np.ndarray, c: np.ndarray, total: float) -> np.ndarray:
    """Two-step Galaxy: by compute, then one pass moving overflow to spare memory (see module doc)."""
    check_capacity(m, total)
    u = total * c / c.sum()
    overflow = np.maximum(u - m, 0.0)
    if overflow.sum() > 0:
        u = np.minimum(u, m)
        spare = m - u
        u = u + overflow.sum() * spare / spare.sum()
    return u / u.sum()


ALGORITHMS = {"minmax": min_max, "greedy": computation_greedy, "galaxy": galaxy, "vanilla": vanilla,
              "memory": memory_aware}
