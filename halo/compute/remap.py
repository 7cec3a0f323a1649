"""Per-token group re-mapping (HALO mode): predict the next layer's ranking, load its groups ahead.

Every device (master and agents) holds a priority range of MLP ranks per layer [a, b) from the plan
(Algorithm 3: the master the top ranks, the least reliable link the bottom ones). For each token the
predictors rank layer l's MLP groups from the hidden state entering layer l-1, and the device
computes the groups ranked a..b-1. Over UDP (halo) the master's ranking rides in each MLP input
(halo/sync/framing.py) and agents compute it (`adopt`); for an agent that reads its groups ahead (a memory
budget, or fp32 pages) the MLP input of layer l-1 brings layer l's ranking too (`expect`), so agents need
no predictors of their own (one that holds ranks of layer l and none of layer l-1 still predicts, from
layer l-1's attention input). Among agents whose links lose alike the master keeps each group where it
went last token (`keep_in_place`), so a bounded agent reads only the groups new to its tier. Over TCP (halo-tcp) every device predicts: all reach the same ranking
because they run the same ONNX graph (one intra-op thread) on the same broadcast float32 bytes with a
stable sort; the master sends a digest of its ranking with each MLP input and an agent that disagrees
refuses the block (the master then stops with an error instead of merging a wrong sum).

Load-Comp overlap: as soon as layer l+1's ranking is known (during layer l), a background thread
loads those groups (`MlpGroupBank.prefetch`). fp32: it asks the kernel to read their weights from the
memory-mapped model file (madvise WILLNEED: on a device short of RAM, this starts the disk read; the
thread only issues system calls, so it never competes with the computation for Python's GIL, which
touching pages from Python did, 30x slowing the compute thread). Compact formats: the device's built
groups are a `GroupCache`; unbounded, every candidate group is built at the start (onnxruntime kernels) and
nothing is loaded per token; bounded by a memory budget, groups are held as their compact arrays and computed
by halo._nbits, numpy without it (CompactMlpGroup: a session per group would hold 2-5x its weights and take ~10 ms
to build), and the thread reads the groups the cache lacks (from `halo-agent prepare`d groups: one pread each).
Without overlap the same load runs inline, just before the computation.

Without predictors (ablation "no prediction, no loading", or layer 0) the ranking is the identity:
rank r = group r.
"""

from __future__ import annotations

import logging
import zlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from halo.compute.group_cache import GroupCache, minimum_capacity
from halo.compute.linear import COMPACT_KERNEL, projection_kernel
from halo.compute.neuron_groups import GroupLayout, MlpGroupBank
from halo.errors import ConfigError
from halo.host.memory import groups_headroom, release_freed_heap, resident_bytes
from halo.model.weights import ModelWeights

log = logging.getLogger("halo.compute.remap")
RESIDENT_MARGIN = 1.15  # over the measured cost of the first groups built: heap growth they do not show
MIN_RESIDENT_PER_BYTE = 2.0  # measured 3.3 (SmolLM2 Q4_1 groups), 1.7 (TinyLlama Q4_0); less: they reused freed heap
CALIBRATION_GROUPS = 12  # groups built (and run once) before their measured cost sets a budget's capacity
COMPACT_MARGIN = 1.1  # compact groups are numpy arrays of exactly their bytes; the allocator's slack


class Remapper:
    def __init__(self, weights: ModelWeights, layout: GroupLayout, rank_ranges: dict[int, tuple[int, int]],
                 predictors=None, load_overlap: bool = True, fmt: str = "fp32", threads: int = 1, built=None,
                 cache_bytes: int | None = None, resident_budget: int | None = None, prepared=None):
        """rank_ranges: layer -> this device's [a, b) of MLP ranks (layers with an empty range omitted); fmt: the
        weight format its candidate groups are computed in. The built groups it keeps (compact formats), at most:
        cache_bytes of compact weights, or resident_budget bytes of process memory (converted with what the first
        layer's groups measurably cost: a one-group kernel's session holds several times its weights); neither:
        all of them, built now. built(): called after each layer's groups (loading progress). prepared: the groups
        written group-major in kernel form (halo/compute/prepared.py), built from instead of the model file."""
        self.ranges = {l: r for l, r in rank_ranges.items() if r[1] > r[0]}
        self.cache = GroupCache(cache_bytes) if fmt != "fp32" else None
        self.resident_budget = resident_budget if self.cache is not None else None
        self.resident_per_byte = None  # process memory per compact byte of a built group (measured with a budget)
        self.banks = {l: MlpGroupBank(weights.layers[l], layout, fmt, threads, self.cache, l,
                                      prepared if fmt != "fp32" else None) for l in self.ranges}
        self.n_groups, self.layout = layout.n_mlp_groups, layout
        self.floor = 0  # the least a bounded cache may hold (two layers of this device's ranks)
        self.shrunk = 0  # bytes of capacity given up since the start to stay under the cgroup limit
        self._fill(built)
        self.predictors = predictors
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="halo-load") if load_overlap else None
        self.rankings: dict[int, np.ndarray] = {}  # layer -> [T, G] MLP ranking (most important first)
        self.head_rankings: dict[int, np.ndarray] = {}  # layer -> [T, H]
        self.loading: dict[int, Future] = {}
        self.predict_ms = 0.0
        self.load_ms = 0.0  # building/reading groups ahead (either thread)
        self.wait_ms = 0.0  # the computation waiting for a layer's groups to be loaded

    def _fill(self, built) -> None:
        """Build the groups a device starts with. Unbounded: every candidate group, as onnxruntime kernels. Bounded
        (cache_bytes, or a resident budget too small for every candidate as kernels: `_calibrate`): compact groups
        (CompactMlpGroup), first every layer's own rank range under the identity ranking (what it computes without
        predictions), then, while the cache has room, the other groups layer by layer in rank order; a cache too
        small for two layers' ranges is refused."""
        cache = self.cache
        if cache is not None and cache.capacity_bytes is not None:
            self._go_compact(cache.capacity_bytes)
        elif cache is not None and self.resident_budget is not None:
            self._calibrate()
        bounded = cache is not None and cache.capacity_bytes is not None
        for l, (a, b) in self.ranges.items():
            for g in (range(a, b) if bounded else range(self.n_groups)) if cache is not None else ():
                self.banks[l].shard(g)
            if bounded:
                need = self.floor = minimum_capacity(int(self._group_bytes() * max(b - a for a, b in self.ranges.values())))
                if cache.capacity_bytes < need:
                    raise ConfigError(f"the memory left for re-mapped MLP groups holds {cache.capacity_bytes / 1e6:.1f} MB "
                                      f"of them, less than two layers of this share's groups ({need / 1e6:.1f} MB): give "
                                      "this device fewer MLP ranks or more memory (an agent: halo-agent --memory-budget; "
                                      "the master: what its memory cgroup leaves), or use --sync exact")
            if built is not None:
                built()
        for l, (a, b) in self.ranges.items() if bounded else ():
            for g in (g for g in range(self.n_groups) if not a <= g < b):
                if not cache.room_for(self._group_bytes()):
                    break
                self.banks[l].shard(g)
        if cache is not None:
            cache.filling = False

    def _calibrate(self) -> None:
        """Whether the resident budget holds every candidate group as onnxruntime kernels (fastest per call; a
        one-group session holds 2-5x its weights: its own buffers and graph), from what the first groups built (and
        run once) made the process grow by. If not, they are dropped and the budget holds compact groups."""
        cache, before, layers = self.cache, resident_bytes(), []
        for l, (a, b) in self.ranges.items():
            for g in range(a, b):
                self.banks[l].shard(g)
            layers.append(l)
            if len(cache) >= CALIBRATION_GROUPS:
                break
        for l in layers:  # a session allocates its buffers at its first run
            self.banks[l].forward(np.zeros((1, self.banks[l].dim), dtype=np.float32), range(*self.ranges[l]))
        per_byte = RESIDENT_MARGIN * max(MIN_RESIDENT_PER_BYTE, (resident_bytes() - before) / max(1, cache.held_bytes))
        every = self._group_bytes() * self.n_groups * len(self.ranges)
        if self.resident_budget >= every * per_byte:
            self.resident_per_byte = per_byte
            log.info("HALO groups within %.1f MB of memory: all %.1f MB of candidates as kernels (%.1f x their weights "
                     "in memory)", self.resident_budget / 1e6, every / 1e6, per_byte)
            return
        cache.clear()
        release_freed_heap()
        dim = next(iter(self.banks.values())).dim
        working = 8 * self.layout.mlp_group_size * dim  # a call's float32 expansion of gate+up (numpy, prefills; transient)
        self._go_compact(int(max(0, self.resident_budget - working) / COMPACT_MARGIN))
        log.info("HALO groups within %.1f MB of memory: %.1f MB of compact groups of %.1f MB candidates (as kernels "
                 "they would take %.1f x their weights), computed by %s", self.resident_budget / 1e6,
                 cache.capacity_bytes / 1e6, every / 1e6, per_byte, COMPACT_KERNEL)
        if COMPACT_KERNEL == "numpy":
            log.warning("halo._nbits was not built with this install (no C compiler then): compact groups are computed "
                        "in numpy, ~3x slower per group; install a C compiler (apt install gcc) and reinstall halo")

    def _go_compact(self, capacity: int) -> None:
        """Bounded: groups held as compact arrays (linear.DequantKernel) within `capacity` bytes."""
        self.cache.capacity_bytes = capacity
        self.resident_per_byte = COMPACT_MARGIN
        for bank in self.banks.values():
            bank.compact = True

    def _group_bytes(self) -> int:
        return int(self.cache.held_bytes / max(1, len(self.cache)))

    def begin(self) -> None:
        """A new forward pass: rankings of the previous one must not be reused."""
        self.rankings.clear()
        self.head_rankings.clear()
        self.loading.clear()
        if self.cache is not None:
            self.cache.begin_pass()
        if self.resident_budget is not None and self.cache.capacity_bytes is not None:
            self._stay_under_limit()

    def _stay_under_limit(self) -> None:
        """Under a cgroup limit, give up cache capacity where the process outgrew what the budget was measured from
        (buffers of the first passes, the KV cache filling, the predictors): checked each forward pass, so the
        agent shrinks its cache rather than be killed by the limit."""
        headroom = groups_headroom()
        if headroom is None or headroom >= 0:
            return
        cache = self.cache
        capacity = max(self.floor, cache.capacity_bytes + headroom)
        if capacity < cache.capacity_bytes:
            self.shrunk += cache.capacity_bytes - capacity
            cache.shrink(capacity)
            release_freed_heap()
            log.warning("memory limit: the HALO group cache shrinks to %.1f MB (%.1f MB given up so far)",
                        capacity / 1e6, self.shrunk / 1e6)

    def predicts(self, layer: int) -> bool:
        return self.predictors is not None and layer in self.predictors.sessions

    def predict(self, layer: int, hidden: np.ndarray, place=None) -> None:
        """Rank `layer`'s groups from the hidden state entering layer-1 [T, D]; start loading ours. place(ranking) ->
        the ranking as the groups are placed (the master keeps them in place: keep_in_place), before any is loaded."""
        if not self.predicts(layer):
            return
        t = time.perf_counter()
        heads, groups = self.predictors.rank(layer, np.atleast_2d(hidden))
        self.head_rankings[layer], self.rankings[layer] = heads, groups if place is None else place(groups)
        self.predict_ms += 1e3 * (time.perf_counter() - t)
        self._load_ahead(layer)

    def adopt(self, layer: int, ranking: np.ndarray) -> None:
        """The master's ranking of `layer` ([T, G], sent with its MLP input: halo/sync/framing.py) instead of ours:
        the groups computed are the ones it ranked, whatever our predictors said (or whether we predicted)."""
        self.rankings[layer] = np.asarray(ranking)

    def expect(self, layer: int, ranking: np.ndarray) -> None:
        """The master's ranking of a layer still to come (sent with the MLP input before it): load our groups of it
        ahead, as our own prediction would have (the layer's MLP input brings the same ranking to compute)."""
        if layer not in self.loading:
            self.rankings[layer] = np.asarray(ranking)
            self._load_ahead(layer)

    def _load_ahead(self, layer: int) -> None:
        if layer in self.ranges and self.pool is not None and self.loads:
            self.loading[layer] = self.pool.submit(self._load, layer)

    @property
    def loads(self) -> bool:
        """Whether loading a layer's groups ahead does anything: not where every candidate group was built at the
        start and stays (an unbounded cache). There the load thread only cost the computation: it woke for nothing
        and took the GIL while the main thread waited for the partial sums (a TinyLlama-shaped token's prediction
        time on the 2-core test bed: 7.1 -> 2.3 ms, eval/results/halo_speed_c_datagrams.md). Nor where a bounded cache
        holds every candidate (a budget that has room for them): there an agent predicted every layer for nothing, a
        SmolLM2 agent's onnxruntime sessions on the shared cores making its tokens 1.2x slower than unbounded. (A cache
        that shrinks later builds what a ranking lacks in line.)"""
        if self.cache is None:
            return True
        return self.cache.capacity_bytes is not None and len(self.cache) < self.n_groups * len(self.ranges)

    def digest(self, layer: int) -> int:
        return ranking_digest(self.rankings.get(layer)) if self.predicts(layer) else 0

    def _assignment(self, layer: int, tokens: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Our groups of a layer and which tokens each serves ([T, n] mask; None: all tokens)."""
        a, b = self.ranges[layer]
        ranking = self.rankings.get(layer)
        if ranking is None or len(ranking) != tokens:
            return np.arange(a, b), None
        mine = ranking[:, a:b]
        groups = np.unique(mine)
        if len(groups) == b - a:
            return mine[0], None  # every token has the same set (always so for one token)
        keep = np.zeros((tokens, len(groups)), dtype=bool)
        keep[np.arange(tokens)[:, None], np.searchsorted(groups, mine)] = True
        return groups, keep

    def _load(self, layer: int) -> None:
        t = time.perf_counter()
        groups, _ = self._assignment(layer, len(self.rankings[layer]))
        self.banks[layer].prefetch(groups)
        self.load_ms += 1e3 * (time.perf_counter() - t)

    def mlp_partial(self, layer: int, x: np.ndarray, norm: np.ndarray | None = None,
                    eps: float = 0.0) -> np.ndarray | None:
        """This device's partial MLP output for the input x [T, D], normed with `norm` where the groups are computed
        (norm None: x is normed already); None when the device holds no ranks of the layer."""
        if layer not in self.ranges:
            return None
        pending = self.loading.pop(layer, None)
        t = time.perf_counter()
        if pending is not None:
            pending.result()
        elif self.loads and self.predicts(layer) and layer in self.rankings:
            self._load(layer)  # no overlap: load now, then compute
        self.wait_ms += 1e3 * (time.perf_counter() - t)
        groups, keep = self._assignment(layer, len(x))
        return self.banks[layer].forward(x, groups, keep, norm, eps)

    def report(self) -> dict:
        """Prediction and loading time; for compact groups what the cache holds and how it served."""
        out = {"predict_ms": round(self.predict_ms, 3), "load_ms": round(self.load_ms, 3),
               "load_wait_ms": round(self.wait_ms, 3)}
        if self.cache is not None:
            out["group_cache"] = {"capacity_bytes": self.cache.capacity_bytes, "held_bytes": self.cache.held_bytes,
                                  "groups": len(self.cache), "resident_budget_bytes": self.resident_budget,
                                  "prepared": next(iter(self.banks.values())).prepared is not None if self.banks else False,
                                  "resident_per_byte": self.resident_per_byte,
                                  "kernel": (COMPACT_KERNEL if self.cache.capacity_bytes is not None
                                             else projection_kernel()),
                                  "shrunk_bytes": self.shrunk,
                                  **self.cache.stats.to_json()}
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def keep_in_place(row: np.ndarray, previous: np.ndarray | None, tiers: list[list[tuple[int, int]]]) -> np.ndarray:
    """A layer's ranking for one token [G] with the groups inside each tier of equally reliable devices kept where
    they went last token: a tier is the rank ranges [a, b) of devices whose links lose alike, contiguous in rank
    order. Algorithm 3 only asks that less important ranks go to less reliable links, and between equally reliable
    ones nothing is gained by moving a group, while a memory-bounded device must read every group that moves onto
    it (the TinyLlama shape: ~78 groups of 0.85 MB a token each). Within a tier, each device keeps the groups it had
    that are still in the tier, and the groups new to the tier fill the places left, most important first; the ranks
    above and below the tier, and which groups form it, are the ranking's. previous: last token's row as placed (None:
    the ranking as it is)."""
    if previous is None or not tiers:
        return row
    placed = row.copy()
    for ranges in tiers:
        start, stop = ranges[0][0], ranges[-1][1]
        in_tier = set(row[start:stop].tolist())
        kept = [[g for g in previous[a:b].tolist() if g in in_tier] for a, b in ranges]
        taken = {g for groups in kept for g in groups}
        newcomers = iter([g for g in row[start:stop].tolist() if g not in taken])
        for (a, b), groups in zip(ranges, kept):
            placed[a:b] = groups + [next(newcomers) for _ in range(b - a - len(groups))]
    return placed


def ranking_digest(ranking: np.ndarray | None) -> int:
    """24 bits of CRC-32 over a ranking (int16), sent in the broadcast prefix: every device must hold the same."""
    if ranking is None:
        return 0
    return zlib.crc32(np.ascontiguousarray(ranking, dtype="<i2").tobytes()) & 0xFFFFFF
