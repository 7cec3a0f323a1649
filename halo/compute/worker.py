"""One device's share of a model: its shards, the partial outputs of blocks, and the next layer's ranking.

The master and every agent each run one `DeviceWorker` (the master is a worker plus a coordinator).
A worker is built from the device's `Shares`: an AttentionShard (with its KV cache) per layer where it
holds heads, an MlpShard per layer where it holds MLP groups, an LmHeadShard for its vocabulary
slice. In HALO mode its MLP share is a rank range per layer and the `Remapper` picks the groups per
token from the predictors' ranking, which the worker computes one layer ahead from the residual
stream entering the attention block (`predict_next`).

Every block's input is the residual stream; the worker applies the block's RMSNorm itself (the
predictors read the un-normed residual, so the residual is what travels).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from halo.compute.batch import Rows
from halo.compute.neuron_groups import AttentionShard, GroupLayout, LmHeadShard, MlpShard
from halo.compute.shares import Block, Shares, rank_range
from halo.errors import HaloError
from halo.host.memory import groups_headroom, resident_bytes
from halo.model.ops import Rotary, rmsnorm
from halo.model.weights import ModelWeights

STEPWISE_TOKENS = 9  # passes this short get a decode step's bits per position: a verification of up to 8 drafts


class DeviceWorker:
    def __init__(self, weights: ModelWeights, layout: GroupLayout, share: Shares, context: int, fmt: str = "fp32",
                 threads: int = 1, remap: bool = False, predictors=None, load_overlap: bool = True,
                 reuse: "DeviceWorker | None" = None, progress: "Callable[[int, int], None] | None" = None,
                 memory_budget: int | None = None, prepared=None, slots: int = 1, reserved: int = 0):
        """remap: HALO mode (MLP shares are rank ranges re-mapped per token; `predictors` ranks them, None: the identity
        ranking). reuse: the worker of this device's previous session; its shards whose groups all stay in the new
        share are taken over (kernels already built, KV caches cleared) and only the groups it did not hold are built:
        after a sticky re-plan a survivor builds just what it gained. progress(done, total): called as each block's
        share is ready (an agent reports its loading with it). memory_budget: the most process memory the share's
        weights and KV cache may take; in HALO mode with compact weights, the built MLP groups it keeps are bounded by
        what the other shards (measured), the KV cache and `reserved` (taken later outside the worker: the vectors its
        UDP endpoint keeps for NACKs) leave of it (halo/compute/group_cache.py; None: every candidate group, built now).
        prepared: HALO's groups in kernel form (prepared.py), built from instead of the file. slots: KV caches."""
        c = self.config = weights.config
        self.weights, self.layout, self.share = weights, layout, share
        self.context, self.fmt, self.threads, self.slots = context, fmt, threads, slots
        self.rotary = Rotary(c, context)
        self.norms, self.final_norm = _own_norms(weights)
        old = reuse if reuse is not None and reuse.compatible(weights, layout, context, fmt, threads, slots) else None
        self.reused_groups = 0  # groups whose kernels came from `reuse`
        bounded = remap and fmt != "fp32" and memory_budget is not None  # HALO's built groups: within the budget
        started = resident_bytes() if bounded else 0
        kept_caches = []
        blocks = [*share.attention, *share.mlp, share.lm_head]
        loaded = _Progress(sum(1 for groups in blocks if groups), progress)

        def shard(kind: str, layer: int, groups: list[int], build):
            previous = None if old is None else old._shard(kind, layer)
            kept = [p for p in _pieces(previous) if set(_groups_of(p)) <= set(groups)]
            held = {g for p in kept for g in _groups_of(p)}
            self.reused_groups += len(held)
            rest = [g for g in groups if g not in held]
            pieces = kept + ([build(rest)] if rest else [])
            kept_caches.extend(p for p in kept if isinstance(p, AttentionShard))
            loaded.step()
            return pieces[0] if len(pieces) == 1 else PiecedShard(pieces, layout if kind == "lm_head" else None, groups)

        self.attention = {l: shard("attention", l, heads,
                                   lambda g, l=l: AttentionShard(weights.layers[l], layout, g, context, fmt, threads, slots))
                          for l, heads in enumerate(share.attention) if heads}
        self.lm_head = (shard("lm_head", c.n_layers, share.lm_head,
                              lambda g: LmHeadShard(weights.lm_head, layout, g, fmt, threads))
                        if share.lm_head else None)
        self.mlp: dict[int, MlpShard] = {}
        self.remapper = None
        if remap:
            from halo.compute.remap import Remapper

            ranges = {l: rank_range(g) for l, g in enumerate(share.mlp) if g}  # ConfigError if not ranks
            groups_budget = self._groups_budget(memory_budget, started) - reserved if bounded else None
            self.remapper = Remapper(weights, layout, ranges, predictors, load_overlap, fmt, threads, built=loaded.step,
                                     resident_budget=groups_budget, prepared=prepared)
        else:
            self.mlp = {l: shard("mlp", l, g, lambda g, l=l: MlpShard(weights.layers[l], layout, g, fmt, threads))
                        for l, g in enumerate(share.mlp) if g}
        for cache in kept_caches:  # only once everything was built: a failed build leaves the old session intact
            cache.reset()  # the history is replayed into the new assignment
        self.compute_ms = 0.0  # wall clock, every compute call
        self.cpu_ms = 0.0  # the same in this thread's CPU time: what it costs without other processes on the cores
        self.last_compute_ms = 0.0

    def _warm_static(self) -> None:
        """Run each attention and LM-head shard once (zeros at position 0, caches cleared after): a kernel session
        allocates its buffers at its first run, and the memory left to HALO's groups must be measured after that
        (TinyLlama shape: an agent budgeted before it outgrew its cgroup limit at the first token)."""
        x = np.zeros((1, self.config.dim), dtype=np.float32)
        for shard in self.attention.values():
            shard.forward(x, 0, self.rotary)
            shard.reset()
        if self.lm_head is not None:
            self.lm_head.forward(x)

    def _groups_budget(self, memory_budget: int, started: int) -> int:
        """HALO mode: the process memory its built MLP groups may take: the budget less what the other shards made the
        process grow by and the KV cache (filled as positions come), and under a cgroup limit at most what the limit
        leaves (it counts everything: the predictors, buffers, page cache). The process shrinking meanwhile (heap an
        earlier session left, freed) gives the groups nothing: it is not room the shards made."""
        self._warm_static()  # measured after the other shards' first run
        kv = sum(s.cache_nbytes for s in self.attention.values())
        budget = memory_budget - max(0, resident_bytes() - started) - kv
        headroom = groups_headroom()
        return budget if headroom is None else min(budget, headroom - kv)

    def compatible(self, weights, layout, context, fmt, threads, slots: int = 1) -> bool:
        """Whether this worker's shards can serve a new session with these settings."""
        return (self.remapper is None and self.weights is weights and self.layout == layout
                and (self.context, self.fmt, self.threads, self.slots) == (context, fmt, threads, slots))

    def _shard(self, kind: str, layer: int):
        if kind == "lm_head":
            return self.lm_head
        return (self.attention if kind == "attention" else self.mlp).get(layer)

    def holds(self, block: Block) -> bool:
        return self.share.holds(block)

    def begin_forward(self) -> None:
        """A new forward pass: rankings of the previous one must not be reused."""
        if self.remapper is not None:
            self.remapper.begin()

    def compute(self, block: Block, x: np.ndarray, start: "int | Rows") -> np.ndarray:
        """This device's partial output of a block for the residual stream x [T, D] at positions start.. (or, a batched
        pass, where `Rows` says): [T, D] (attention, MLP) or [T, its vocabulary slice] (LM head). Each position gets
        the bits of a decode step of its own wherever halo's C steps hold the block (they take the positions together,
        each weight read once, as fast as a prompt's kernels: 162 against 163 ms for 128 SmolLM2 tokens), so a
        prompt, a speculative verification and a batch of requests round alike, whatever they are passed with; other
        kernels do so in passes of at most STEPWISE_TOKENS (a verification: halo/generation/speculative.py) and in batched
        passes, a position at a time. HALO's re-mapped MLP groups (chosen per pass, never exact) run as one pass."""
        if not isinstance(start, Rows):
            return self._compute(block, x, start, 0, len(x) <= STEPWISE_TOKENS)
        start.check(len(x), self.context, self.slots)
        if block.kind != "attention":
            return self._compute(block, x, 0, 0, True)
        if len(start.segments) == 1:
            s = start.segments[0]
            return self._compute(block, x, s.start, s.slot, True)
        shard = self.attention[block.layer]
        if shard.fused:  # every slot's rows in one C call
            t, cpu = time.perf_counter(), time.thread_time()
            out = shard.step_rows(np.ascontiguousarray(x, np.float32), self.norms["attention"][block.layer],
                                  self.config.norm_eps, start.table, self.rotary)
            self._timed(t, cpu)
            return out
        return np.concatenate([self._compute(block, x[s.first:s.last], s.start, s.slot, True) for s in start.segments])

    def _compute(self, block: Block, x: np.ndarray, start: int, slot: int, stepwise: bool) -> np.ndarray:
        kind = block.kind
        norm = self.final_norm if kind == "lm_head" else self.norms[kind][block.layer]
        shard = (self.attention[block.layer] if kind == "attention" else None if kind == "lm_head" or self.remapper
                 else self.mlp[block.layer])
        stepwise = stepwise and not (kind == "mlp" and self.remapper is not None)
        fused = shard is not None and shard.fused
        if stepwise and len(x) > 1 and not fused and not (kind == "lm_head" and self.lm_head.row_by_row):
            return np.concatenate([self._compute(block, x[i:i + 1], start + i, slot, True) for i in range(len(x))])
        t, cpu = time.perf_counter(), time.thread_time()
        if kind == "attention" and not 0 <= start <= self.context - len(x):  # (numpy would wrap a negative one)
            raise HaloError(f"positions {start}..{start + len(x) - 1} are outside the context 0..{self.context - 1}")
        if fused:  # decode steps: the whole block in one C call
            out = shard.step(np.ascontiguousarray(x, np.float32), norm, self.config.norm_eps, start, self.rotary, slot)
        elif kind == "mlp" and shard is None:  # HALO's re-mapped groups: normed where they are computed
            out = self.remapper.mlp_partial(block.layer, x, norm, self.config.norm_eps)
        else:
            h = rmsnorm(x, norm, self.config.norm_eps)
            if shard is not None:
                out = shard.forward(h, start, self.rotary, slot) if kind == "attention" else shard.forward(h)
            else:
                out = self.lm_head.forward(h)
        self._timed(t, cpu)
        return out

    def _timed(self, started: float, cpu_started: float) -> None:
        self.last_compute_ms = 1e3 * (time.perf_counter() - started)
        self.compute_ms += self.last_compute_ms
        self.cpu_ms += 1e3 * (time.thread_time() - cpu_started)

    def fill(self, layer: int, x: np.ndarray) -> None:
        """The KV cache of layer `layer` at positions 0.. from the residual stream that entered its attention block
        there, x [T, D] (a re-plan's new shares, from the master's InputLog): the K/V a forward pass writes, through
        the same C step where it holds the block (projections only: no attention over the history)."""
        shard, norm = self.attention[layer], self.norms["attention"][layer]
        if shard.fused:
            shard.write_kv(np.ascontiguousarray(x, np.float32), norm, self.config.norm_eps, 0, self.rotary)
        else:
            shard.fill(rmsnorm(x, norm, self.config.norm_eps), 0, self.rotary)

    def predicts_from(self, block: Block) -> bool:
        """Whether this device ranks the next layer's groups from this block's input (HALO: it holds MLP
        ranks of the next layer)."""
        return (self.remapper is not None and block.kind == "attention"
                and bool(self.share.mlp[block.layer + 1] if block.layer + 1 < self.config.n_layers else False))

    def predict_next(self, block: Block, x: np.ndarray, place=None) -> None:
        """HALO: rank layer l+1's groups from the residual entering layer l's attention block, start loading ours
        (place: Remapper.predict's)."""
        if self.remapper is not None and block.kind == "attention":
            self.remapper.predict(block.layer + 1, x, place)

    def digest(self, layer: int) -> int:
        """24-bit digest of the MLP ranking this device computed for a layer (0: static groups)."""
        return self.remapper.digest(layer) if self.remapper is not None else 0

    @property
    def loads_ahead(self) -> bool:
        """HALO: whether a prediction starts reading this device's groups of the next layer (a memory budget's
        group reads, fp32 pages asked of the kernel), so it is worth predicting here although the master sends its
        ranking with the MLP input."""
        return self.remapper is not None and self.remapper.loads and any(self.share.mlp)

    def adopt_ranking(self, layer: int, ranking: np.ndarray) -> None:
        """HALO: compute layer `layer`'s MLP groups as the master ranked them ([T, G], sent with the input)."""
        if self.remapper is not None:
            self.remapper.adopt(layer, ranking)

    def expect_ranking(self, layer: int, ranking: np.ndarray) -> None:
        """HALO: the master's ranking of a layer still to come ([T, G], sent with the previous layer's MLP input):
        start loading our groups of it, as our own prediction would."""
        if self.remapper is not None and 0 <= layer < self.config.n_layers:
            self.remapper.expect(layer, ranking)

    def reset(self) -> None:
        for shard in self.attention.values():
            shard.reset()

    @property
    def nbytes(self) -> int:
        shards = [*self.attention.values(), *self.mlp.values()] + ([self.lm_head] if self.lm_head else [])
        total = sum(s.nbytes for s in shards)
        if self.remapper is not None:  # the candidate MLP groups it holds (any may be re-mapped here)
            total += sum(bank.nbytes for bank in self.remapper.banks.values())
            total += self.remapper.cache.held_bytes if self.remapper.cache is not None else 0
        return total

    def close(self) -> None:
        if self.remapper is not None:
            self.remapper.close()


def _own_norms(weights: ModelWeights) -> tuple[dict[str, list[np.ndarray]], np.ndarray]:
    """The RMSNorm weights, copied out of the memory-mapped model: every block reads them every token, and a device
    short of memory that loses their page faults in the disk's whole read-ahead window (8 MB here) each time."""
    return ({"attention": [np.array(l.attn_norm) for l in weights.layers],
             "mlp": [np.array(l.mlp_norm) for l in weights.layers]}, np.array(weights.final_norm))


class _Progress:
    """Blocks built so far out of `total`, told to a callback as they come."""

    def __init__(self, total: int, callback=None):
        self.done, self.total, self.callback = 0, total, callback
        if callback is not None:
            callback(0, total)

    def step(self) -> None:
        self.done += 1
        if self.callback is not None:
            self.callback(self.done, self.total)


class PiecedShard:
    """Several shards of one block computed as one (a share kept across a sticky re-plan: the shards it had,
    plus one for the groups it gained). Attention and MLP partial outputs add up; the LM head's logits are
    placed in the order of the share's groups (`layout` given), which is the order the master reads them in."""

    fused = False  # no one-call decode step: each piece runs its own `forward`

    def __init__(self, pieces: list, layout: GroupLayout | None = None, groups: list[int] | None = None):
        self.pieces = pieces
        self.groups = tuple(g for p in pieces for g in _groups_of(p))
        if layout is not None:
            self.token_ids = layout.vocab_ids(groups)
            computed = np.concatenate([p.token_ids for p in pieces])
            where = np.empty(layout.vocab_size, dtype=np.int64)
            where[computed] = np.arange(len(computed))
            self._order = where[self.token_ids]

    @property
    def row_by_row(self) -> bool:
        """LM-head pieces: whether each position's logits have the bits they would have alone (LmHeadShard)."""
        return all(getattr(p, "row_by_row", False) for p in self.pieces)

    def forward(self, x: np.ndarray, *args) -> np.ndarray:
        outputs = [p.forward(x, *args) for p in self.pieces]
        if hasattr(self, "_order"):
            return np.concatenate(outputs, axis=1)[:, self._order]
        return sum(outputs[1:], outputs[0])

    def fill(self, x: np.ndarray, *args) -> None:
        for p in self.pieces:
            p.fill(x, *args)

    def reset(self) -> None:
        for p in self.pieces:
            p.reset()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def cache_nbytes(self) -> int:
        return sum(p.cache_nbytes for p in self.pieces)


def _pieces(shard) -> list:
    if shard is None:
        return []
    return list(shard.pieces) if isinstance(shard, PiecedShard) else [shard]


def _groups_of(shard) -> tuple[int, ...]:
    return shard.heads if isinstance(shard, AttentionShard) else shard.groups
