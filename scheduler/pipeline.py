"""Pipeline-layer plans for GPU/WebGPU workers (thesis 000, chapter 5).

The model is a sequence of units: the embedding, every decoder layer, the head. A plan is an
ordered list of stages (worker, [start, stop)) covering units 0..n, each worker at most once. For a
fixed worker order, Algorithm 5.1's dynamic program finds the cheapest split, skipping workers that
would not help; the order is searched exhaustively below 8 workers, by simulated annealing up to
n^2 m < 50,000, and by time-bounded random search above.

Execution cost of worker w on units [i, j) (thesis Eq. 5.2.1): infinite when the units' memory
exceeds the worker's; else session overhead + compute / speed + delta + latency + (input of unit i +
output of unit j-1) / bandwidth. A skipped worker costs nothing. The initialization (download)
penalty of §5.2.2 is not modelled: halo devices hold their weights locally.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from halo.errors import ConfigError

from halo.scheduler.profiles import Cluster, DeviceProfile, ModelProfile

DELTA_S = 500e-6  # per-stage serialization and processing overhead (thesis: 500 us)
EXHAUSTIVE_MAX_WORKERS = 7
ANNEALING_MAX_SIZE = 50_000
RANDOM_ORDER_WORK = 4e7  # larger problems: random worker orders, as many as ~0.1 s of dp_assign here (n^2 m each)


@dataclass(frozen=True)
class Units:
    """Per-unit costs: FLOPs, memory required, input and output bytes."""

    names: list[str]
    flops: np.ndarray
    memory: np.ndarray
    input_bytes: np.ndarray
    output_bytes: np.ndarray

    def __len__(self) -> int:
        return len(self.names)


def model_units(model: ModelProfile, context: int) -> Units:
    L = model.n_layers
    layer_flops = sum(b.count * b.flops for b in model.tp_blocks)
    layer_memory = sum(b.count * model.group_bytes(b, context) for b in model.tp_blocks)
    head_bytes = model.lm_head.count * model.lm_head.bytes
    hidden = model.dim * 4
    return Units(
        names=["embedding"] + [f"layer {i}" for i in range(L)] + ["head"],
        flops=np.array([0.0] + [layer_flops] * L + [model.lm_head.count * model.lm_head.flops]),
        memory=np.array([model.embedding_bytes] + [layer_memory] * L + [head_bytes]),
        input_bytes=np.array([4.0] + [hidden] * (L + 1)),  # a token id, then hidden states
        output_bytes=np.array([hidden] * (L + 1) + [8.0]),  # the head returns the sampled token
    )


@dataclass
class PipelinePlan:
    stages: list[tuple[int, int, int]]  # (worker index, start unit, stop unit)
    n_units: int
    cost_s: float  # sum of stage costs (inf when partial)
    workers: list[DeviceProfile]
    unit_names: list[str]

    @property
    def covered(self) -> int:
        return self.stages[-1][2] if self.stages else 0

    @property
    def complete(self) -> bool:
        return self.covered == self.n_units


def stage_costs(worker: DeviceProfile, units: Units, session_overhead_s: float = 0.0) -> np.ndarray:
    """[x, i] cost of running units [x, i) on worker (inf where it does not fit; 0 on the diagonal)."""
    n = len(units)
    flops = np.concatenate([[0.0], np.cumsum(units.flops)])
    memory = np.concatenate([[0.0], np.cumsum(units.memory)])
    x = np.arange(n + 1)[:, None]
    i = np.arange(n + 1)[None, :]
    safe_x, safe_i = np.minimum(x, n - 1), np.maximum(i - 1, 0)
    cost = (session_overhead_s + (flops[i] - flops[x]) / worker.compute_flops + DELTA_S + worker.latency_s
            + (units.input_bytes[safe_x] + units.output_bytes[safe_i]) * 8 / worker.bandwidth_bps)
    cost = np.where(memory[i] - memory[x] > worker.memory_bytes, np.inf, cost)
    cost = np.where(i < x, np.inf, cost)
    cost[np.arange(n + 1), np.arange(n + 1)] = 0.0  # a worker may take nothing
    return cost


def dp_assign(order: list[int], costs: list[np.ndarray], n: int) -> tuple[float, list[tuple[int, int, int]], int]:
    """Algorithm 5.1 for a fixed order: (cost, stages, covered units). Partial when not all fit."""
    m = len(order)
    dp = np.full((m + 1, n + 1), np.inf)
    dp[:, 0] = 0.0
    choice = np.zeros((m + 1, n + 1), dtype=np.int64)
    for j, w in enumerate(order, start=1):
        total = dp[j - 1][:, None] + costs[w]  # [x, i]
        choice[j] = np.argmin(total, axis=0)
        dp[j] = total[choice[j], np.arange(n + 1)]
    covered = n
    while covered > 0 and not np.isfinite(dp[m, covered]):
        covered -= 1
    stages, i = [], covered
    for j in range(m, 0, -1):
        x = int(choice[j, i]) if i > 0 else 0
        if x < i:
            stages.append((int(order[j - 1]), x, int(i)))
        i = x
    stages.reverse()
    return float(dp[m, n]), stages, covered


def _better(a, b) -> bool:
    """Deeper coverage first, then lower cost."""
    return (a[2], -a[0]) > (b[2], -b[0])


def plan_pipeline(cluster: Cluster, model: ModelProfile, seed: int = 0, time_budget_s: float = 0.1,
                  session_overhead_s: float = 0.0) -> PipelinePlan:
    units = model_units(model, cluster.context)
    return plan_units(list(cluster.devices), units, seed, time_budget_s, session_overhead_s)


def plan_units(workers: list[DeviceProfile], units: Units, seed: int = 0, time_budget_s: float = 0.1,
               session_overhead_s: float = 0.0) -> PipelinePlan:
    if not workers:
        raise ConfigError("a pipeline plan needs at least one worker")
    n, m = len(units), len(workers)
    costs = [stage_costs(w, units, session_overhead_s) for w in workers]
    rng = np.random.default_rng(seed)
    best = None

    def consider(order):
        nonlocal best
        result = dp_assign(list(order), costs, n)
        if best is None or _better(result, best):
            best = result
        return result

    if m <= EXHAUSTIVE_MAX_WORKERS:
        seen = set()
        for order in itertools.permutations(range(m)):
            key = tuple(_profile_key(workers[i]) for i in order)  # identical workers: one order suffices
            if key not in seen:
                seen.add(key)
                consider(order)
    elif n * n * m < ANNEALING_MAX_SIZE:
        _anneal(m, consider, rng, time_budget_s)
    else:  # a fixed count of random orders: under a wall-clock budget the plan depended on how busy the CPU was
        for _ in range(int(min(1000, max(32, RANDOM_ORDER_WORK / (n * n * m))))):
            consider(rng.permutation(m))
    cost, stages, covered = best
    return PipelinePlan(stages, n, cost, workers, units.names)


def _profile_key(w: DeviceProfile):
    return (w.memory_bytes, w.compute_flops, w.bandwidth_bps, w.latency_s)


def _score(result) -> float:
    cost, _, covered = result
    return cost if math.isfinite(cost) else 1e12 * (1 + (1e6 - covered))


def _neighbour(order: np.ndarray, rng) -> np.ndarray:
    """Thesis §5.5.3 moves: range swap, range reversal, first/last swap (20 % each), element swap (40 %)."""
    order = order.copy()
    m = len(order)
    move = rng.random()
    if move < 0.2 and m >= 4:
        length = int(rng.integers(1, m // 2 + 1))
        a = int(rng.integers(0, m - 2 * length + 1))
        b = int(rng.integers(a + length, m - length + 1))
        order[a:a + length], order[b:b + length] = order[b:b + length].copy(), order[a:a + length].copy()
    elif move < 0.4:
        a, b = sorted(rng.choice(m, 2, replace=False))
        order[a:b + 1] = order[a:b + 1][::-1]
    elif move < 0.6:
        end = 0 if rng.random() < 0.5 else m - 1
        other = int(rng.integers(0, m))
        order[end], order[other] = order[other], order[end]
    else:
        a, b = rng.choice(m, 2, replace=False)
        order[a], order[b] = order[b], order[a]
    return order


def _anneal(m: int, consider, rng, time_budget_s: float, iterations: int = 1000, final_temperature: float = 0.01):
    """Simulated annealing over worker orders (Metropolis, geometric cooling, early stop after 200 idle steps)."""
    deadline = time.perf_counter() + time_budget_s
    current = rng.permutation(m)
    current_score = _score(consider(current))
    deltas, probe = [], current
    for _ in range(10):
        nxt = _neighbour(probe, rng)
        deltas.append(abs(_score(consider(nxt)) - _score(consider(probe))))
        probe = nxt
    t0 = 10 * (np.mean(deltas) or 1.0)
    alpha = (final_temperature / t0) ** (1 / iterations) if t0 > final_temperature else 1.0
    temperature, best_score, idle = t0, current_score, 0
    for _ in range(iterations):
        if time.perf_counter() > deadline or idle >= 200:
            break
        candidate = _neighbour(current, rng)
        score = _score(consider(candidate))
        if score < current_score or rng.random() < math.exp(-(score - current_score) / max(temperature, 1e-12)):
            current, current_score = candidate, score
        if current_score < best_score:
            best_score, idle = current_score, 0
        else:
            idle += 1
        temperature *= alpha
