"""Per-token group re-mapping (HALO mode): predict the next layer's ranking, load its groups ahead.

Every device (master and agents) holds a priority range of MLP ranks per layer [a, b) from the plan
(Algorithm 3: the master the top ranks, the least reliable link the bottom ones). For each token the
predictors rank layer l's MLP groups from the hidden state entering layer l-1, and the device
computes the groups ranked a..b-1. All devices reach the same ranking because they run the same ONNX
graph (one intra-op thread) on the same broadcast float32 bytes with a stable sort; the master sends a
digest of its ranking with each MLP broadcast and an agent that disagrees refuses the block (the
master then stops with an error instead of merging a wrong sum).

Load-Comp overlap: as soon as layer l+1's ranking is known (during layer l), a background thread
asks the kernel to read those groups' weights from the memory-mapped model file
(`MlpGroupBank.prefetch`, madvise WILLNEED: on a device short of RAM, this starts the disk read);
the MLP block then computes on pages already resident. Without overlap the same request runs inline,
just before the computation. (The thread only issues system calls: it never competes with the
computation for Python's GIL, which touching pages from Python did, 30x slowing the compute thread.)

Without predictors (ablation "no prediction, no loading", or layer 0) the ranking is the identity:
rank r = group r.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .neuron_groups import GroupLayout, MlpGroupBank
from .sync.framing import ranking_digest
from .weights import ModelWeights


class Remapper:
    def __init__(self, weights: ModelWeights, layout: GroupLayout, rank_ranges: dict[int, tuple[int, int]],
                 predictors=None, load_overlap: bool = True, fmt: str = "fp32", threads: int = 1, built=None):
        """rank_ranges: layer -> this device's [a, b) of MLP ranks (layers with an empty range omitted); fmt: the
        weight format its candidate groups are computed in (compact: every group's kernels built now); built():
        called after each layer's bank (loading progress)."""
        self.ranges = {l: r for l, r in rank_ranges.items() if r[1] > r[0]}
        self.banks = {}
        for l in self.ranges:
            self.banks[l] = MlpGroupBank(weights.layers[l], layout, fmt, threads)
            if built is not None:
                built()
        self.predictors = predictors
        self.n_groups = layout.n_mlp_groups
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="halo-load") if load_overlap else None
        self.rankings: dict[int, np.ndarray] = {}  # layer -> [T, G] MLP ranking (most important first)
        self.head_rankings: dict[int, np.ndarray] = {}  # layer -> [T, H]
        self.loading: dict[int, Future] = {}
        self.predict_ms = 0.0
        self.load_ms = 0.0

    def begin(self) -> None:
        """A new forward pass: rankings of the previous one must not be reused."""
        self.rankings.clear()
        self.head_rankings.clear()
        self.loading.clear()

    def predicts(self, layer: int) -> bool:
        return self.predictors is not None and layer in self.predictors.sessions

    def predict(self, layer: int, hidden: np.ndarray) -> None:
        """Rank `layer`'s groups from the hidden state entering layer-1 [T, D]; start loading ours."""
        if not self.predicts(layer):
            return
        t = time.perf_counter()
        heads, groups = self.predictors.rank(layer, np.atleast_2d(hidden))
        self.head_rankings[layer], self.rankings[layer] = heads, groups
        self.predict_ms += 1e3 * (time.perf_counter() - t)
        if layer in self.ranges and self.pool is not None:
            self.loading[layer] = self.pool.submit(self._load, layer)

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

    def mlp_partial(self, layer: int, x: np.ndarray) -> np.ndarray | None:
        """This device's partial MLP output for the normed input x [T, D] (None: no ranks here)."""
        if layer not in self.ranges:
            return None
        pending = self.loading.pop(layer, None)
        if pending is not None:
            pending.result()
        elif self.predicts(layer) and layer in self.rankings:
            self._load(layer)  # no overlap: load now, then compute
        groups, keep = self._assignment(layer, len(x))
        return self.banks[layer].forward(x, groups, keep)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
