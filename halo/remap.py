"""Per-token group re-mapping (HALO mode): predict the next layer's ranking, load its groups ahead.

Every device (master and agents) holds a priority range of MLP ranks per layer [a, b) from the plan
(Algorithm 3: the master the top ranks, the least reliable link the bottom ones). For each token the
predictors rank layer l's MLP groups from the hidden state entering layer l-1, and the device
computes the groups ranked a..b-1. All devices reach the same ranking because they run the same ONNX
graph (one intra-op thread) on the same broadcast float32 bytes with a stable sort; the master sends a
digest of its ranking with each MLP broadcast and an agent that disagrees refuses the block (the
master then stops with an error instead of merging a wrong sum).

Load-Comp overlap: as soon as layer l+1's ranking is known (during layer l), a background thread
gathers those groups' weight rows and columns into contiguous arrays (an `MlpShard`: reading them
from the memory-mapped model file, faulting pages in from disk on a device short of RAM); the MLP
block then finds them ready. Without overlap the same load runs inline.

Without predictors (ablation "no prediction, no loading", or layer 0) the ranking is the identity:
rank r = group r, loaded once.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .neuron_groups import GroupLayout, MlpShard
from .sync import ranking_digest
from .weights import ModelWeights


class Remapper:
    def __init__(self, weights: ModelWeights, layout: GroupLayout, rank_ranges: dict[int, tuple[int, int]],
                 predictors=None, load_overlap: bool = True, threads: int = 1):
        """rank_ranges: layer -> this device's [a, b) of MLP ranks (layers with an empty range omitted)."""
        self.weights, self.layout, self.threads = weights, layout, threads
        self.ranges = {l: r for l, r in rank_ranges.items() if r[1] > r[0]}
        self.predictors = predictors
        self.n_groups = layout.n_mlp_groups
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="halo-load") if load_overlap else None
        self.rankings: dict[int, np.ndarray] = {}  # layer -> [T, G] MLP ranking (most important first)
        self.head_rankings: dict[int, np.ndarray] = {}  # layer -> [T, H]
        self.loading: dict[int, Future | tuple] = {}  # layer -> (groups, keep, shard) or its future
        self.static: dict[int, MlpShard] = {}
        self.predict_ms = 0.0
        self.load_ms = 0.0

    def begin(self) -> None:
        """A new forward pass: rankings and loads of the previous one must not be reused."""
        self.rankings.clear()
        self.head_rankings.clear()
        for pending in self.loading.values():
            if isinstance(pending, Future):
                pending.cancel()
        self.loading.clear()

    def predicts(self, layer: int) -> bool:
        return self.predictors is not None and layer in self.predictors.sessions

    def predict(self, layer: int, hidden: np.ndarray) -> None:
        """Rank `layer`'s groups from the hidden state entering layer-1 [T, D]; start loading ours."""
        import time

        if not self.predicts(layer):
            return
        t = time.perf_counter()
        heads, groups = self.predictors.rank(layer, np.atleast_2d(hidden))
        self.head_rankings[layer], self.rankings[layer] = heads, groups
        self.predict_ms += 1e3 * (time.perf_counter() - t)
        if layer in self.ranges:
            if self.pool is not None:
                self.loading[layer] = self.pool.submit(self._load, layer, groups)
            else:
                self.loading.pop(layer, None)

    def ranking(self, layer: int, tokens: int) -> np.ndarray:
        """[T, G] MLP ranking of a layer: predicted, or the identity where there is no prediction."""
        if layer in self.rankings and len(self.rankings[layer]) == tokens:
            return self.rankings[layer]
        return np.broadcast_to(np.arange(self.n_groups), (tokens, self.n_groups))

    def digest(self, layer: int, tokens: int) -> int:
        return ranking_digest(self.rankings.get(layer)) if self.predicts(layer) else 0

    def _load(self, layer: int, ranking: np.ndarray):
        import time

        t = time.perf_counter()
        a, b = self.ranges[layer]
        mine = ranking[:, a:b]  # [T, b - a] group ids per token
        groups = np.unique(mine)
        keep = np.zeros((len(ranking), len(groups)), dtype=bool)
        keep[np.arange(len(ranking))[:, None], np.searchsorted(groups, mine)] = True
        shard = MlpShard(self.weights.layers[layer], self.layout, groups.tolist(), "fp32", self.threads)
        self.load_ms += 1e3 * (time.perf_counter() - t)
        return groups, keep, shard

    def mlp_partial(self, layer: int, x: np.ndarray) -> np.ndarray | None:
        """This device's partial MLP output for the normed input x [T, D] (None: no ranks here)."""
        if layer not in self.ranges:
            return None
        T = len(x)
        if not self.predicts(layer) or layer not in self.rankings or len(self.rankings[layer]) != T:
            if layer not in self.static:
                a, b = self.ranges[layer]
                self.static[layer] = MlpShard(self.weights.layers[layer], self.layout, range(a, b), "fp32", self.threads)
            return self.static[layer].forward(x)
        pending = self.loading.pop(layer, None)
        groups, keep, shard = pending.result() if isinstance(pending, Future) else \
            self._load(layer, self.rankings[layer])
        if keep.all():
            return shard.forward(x)
        return (shard.forward_groups(x) * keep[:, :, None]).sum(axis=1)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
