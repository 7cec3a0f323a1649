"""The master of a tensor-parallel cluster: a device worker plus a coordinator.

`DistributedModel` has the same interface as the single-process `Transformer` (forward, reset,
max_seq_len), so `generate()` drives either. For every block it opens a round (rounds.py) that sends
the residual stream to the agents that need it, computes its own share meanwhile (HALO: the master is
a worker too), and adds the partial outputs in a fixed order (its own share, then agents by node id),
so the result is deterministic. The LM head's vocabulary slices are gathered into full logits.
"""

from __future__ import annotations

import math

import numpy as np

from halo.compute.batch import Rows, check_slots, check_span, check_tokens
from halo.compute.neuron_groups import GroupLayout
from halo.compute.remap import keep_in_place
from halo.compute.shares import Block, Shares, rank_range
from halo.errors import HaloError
from halo.generation.generate import largest_pass_vector_bytes
from halo.model.quant import embed
from halo.sync import (AdaptiveDeadline, Epoch, LossLedger, Point, Transport, plan_round, ranking_digest,
                       ranks_next_layer_itself)
from halo.transport.udp import kept_bytes
from halo.compute.worker import DeviceWorker
from halo.model.weights import ModelWeights

from halo.distributed.estimates import RunningEstimates
from halo.distributed.remote import RemoteAgent
from halo.distributed.rounds import MasterRound, RoundContext
from halo.distributed.session import MasterSettings, Session
from halo.distributed.timing import RoundClock, Timings

POINTS = {"attention": Point.ATTENTION, "mlp": Point.MLP, "lm_head": Point.LM_HEAD}
TIER_PLR = 0.02  # agents whose probed links lose within this of each other are equally reliable (keep_in_place): the
# session's probe of 50 datagrams tells losses apart no finer than ~2 points
LOSSLESS_PLR = 0.01  # a link whose probe lost nothing (below the probe's resolution): where every agent of a layer has
# one, the ranking's placement protects nothing and a layer's groups stay where they are (`_tiers`)


def own_groups_memory(weights: ModelWeights, layout: GroupLayout, fmt: str):
    """HALO mode: the master re-maps MLP groups as an agent does, so it budgets them as one (the default budget:
    as kernels where every candidate fits, compact where not; a master in a 1.6 GB cgroup with the Llama-3.1-8B
    shape cannot hold its layers' whole MLP) and builds them from `halo-agent prepare`d groups where this host has
    them for the model (HALO_PREPARED_DIR). -> (budget bytes, prepared groups or None)."""
    from halo.compute.prepared import find_prepared
    from halo.model.loader import model_fingerprint
    from halo.runtime.measure import default_memory_budget

    return default_memory_budget(), find_prepared(weights, model_fingerprint(weights.source), fmt, layout)


class DistributedModel:
    def __init__(self, weights: ModelWeights, shares: list[Shares], endpoints: list[str], key=None,
                 insecure: bool = False, layout: GroupLayout | None = None, settings: MasterSettings = MasterSettings(),
                 reuse: DeviceWorker | None = None):
        """shares: plan order, the master's first; endpoints: one per agent, in the same order; reuse: the
        master's worker of the previous session (a re-plan keeps the shards whose groups stay here)."""
        if len(endpoints) != len(shares) - 1:
            raise HaloError(f"the plan has {len(shares)} participants: the master and {len(shares) - 1} agents, "
                            f"but {len(endpoints)} agent addresses were given")
        c = self.config = weights.config
        self.weights, self.settings, self.sync = weights, settings, settings.sync
        self.layout = layout or GroupLayout.for_model(c)
        self.max_seq_len = min(c.max_seq_len, settings.context)
        self.slots = check_slots(settings.slots)
        self.timeout_s = settings.timeout_s
        predictors = None
        if self.sync.policy.remap and self.sync.predict:
            from halo.predictors.store import load_predictors

            predictors = load_predictors(weights, self.layout, settings.predictors)

        kept = kept_bytes(largest_pass_vector_bytes(c.dim, self.max_seq_len, self.slots))  # inputs kept for NACKs

        def build_own_share():
            remap = self.sync.policy.remap
            budget, prepared = own_groups_memory(weights, self.layout, settings.fmt) if remap else (None, None)
            self.worker = DeviceWorker(weights, self.layout, shares[0], self.max_seq_len, settings.fmt, settings.threads,
                                       remap=remap,
                                       predictors=predictors, load_overlap=self.sync.load_overlap, reuse=reuse,
                                       slots=self.slots, memory_budget=budget, prepared=prepared, reserved=kept)

        self.session = Session.open(weights, self.layout, settings, self.max_seq_len, shares[1:], endpoints, key,
                                    insecure, meanwhile=build_own_share)
        if self.session.udp is not None:
            self.session.udp.bytes_kept = kept
        self.own_vocab_ids = self.worker.lm_head.token_ids if self.worker.lm_head else None
        self.pos = self.step = self.forward_id = 0
        self.ledger = LossLedger()
        self.timings = Timings()
        self.decoding = False  # whether the forward pass running is one decode step (its rounds are timed)
        self.deadline = AdaptiveDeadline(self.sync)
        self.agents: dict[int, RemoteAgent] = self.session.agents
        self.rounds = RoundContext(self.agents, self.session.udp, self.sync, self.deadline, self.ledger,
                                   self.timeout_s, c.dim, self._ranks_of)
        # who holds groups of which block, worked out once: the per-token loop only looks them up
        self.holders = {b: [i for i, a in self.agents.items() if a.holds(b)] for b in self._blocks()}
        self.listeners = {l: self._listeners(l) for l in range(1, c.n_layers)} if self.worker.remapper else {}
        tiers = {l: self._tiers(l) for l in range(1, c.n_layers)} if self.worker.remapper else {}
        self.tiers = {l: t for l, t in tiers.items() if t}  # HALO: where rankings keep groups in place (keep_in_place)
        self.placed: dict[int, np.ndarray] = {}  # layer -> last token's ranking as placed
        self.rank_of: dict[int, np.ndarray] = {}  # layer -> each group's predicted rank, where the placement differs
        # blocks the master computes alone, with nobody listening to their input: no round, nothing on the wire
        self.alone = {b for b, held in self.holders.items()
                      if not held and not (b.kind == "attention" and self.listeners.get(b.layer + 1))}
        ids = self.own_vocab_ids  # the whole LM head here, in vocabulary order: its logits are the output as they are
        self.whole_lm_head = ids is not None and np.array_equal(ids, np.arange(c.vocab_size))
        # scheduler hooks: running estimates fed once per forward pass; what was planned (set by connect.py)
        self.estimates = RunningEstimates(self.worker, self.agents, self.session.udp, c, self.layout)
        self.plan, self.planning = None, {}
        self.input_log = None  # survive.py's InputLog: the residual stream entering each attention block, recorded

    def _blocks(self):
        for l in range(self.config.n_layers):
            yield Block("attention", l)
            yield Block("mlp", l)
        yield Block("lm_head", self.config.n_layers)

    # ---- one token ------------------------------------------------------------------------------------
    def forward(self, tokens, start_pos: int | None = None, all_logits: bool = False) -> np.ndarray:
        tokens = check_tokens(tokens, self.config.vocab_size)
        start = self.pos if start_pos is None else start_pos
        check_span(start, len(tokens), self.max_seq_len)
        logits = self._pass(tokens, start, slice(None) if all_logits else slice(-1, None), len(tokens) == 1)
        self.pos = start + len(tokens)
        return logits if all_logits else logits[0]

    def forward_rows(self, tokens, rows: Rows) -> np.ndarray:
        """A batched pass: tokens of several sequences, each in its KV-cache slot at its positions (halo/compute/batch.py) ->
        the logits of each sequence's last row [sequences, V], in row order. Every device computes each row as a
        decode step of its own; the rounds carry the rows' slots and positions with the attention inputs."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        rows.check(len(tokens), self.max_seq_len, self.slots)
        return self._pass(tokens, rows, rows.last_rows, all(s.last - s.first == 1 for s in rows.segments))

    def _pass(self, tokens: np.ndarray, start: int | Rows, logits_of, decoding: bool) -> np.ndarray:
        """One forward pass through every block's round -> the logits of rows `logits_of`."""
        self.forward_id += 1
        self.decoding = decoding  # its rounds are timed (a prompt's LM-head round also has one position)
        self.worker.begin_forward()
        x = embed(self.weights.tok_embeddings, tokens)  # [T, D]
        for l in range(self.config.n_layers):
            if self.input_log is not None and not isinstance(start, Rows):
                self.input_log.record(l, start, x)
            x = x + self._block(Block("attention", l), x, start)
            x = x + self._block(Block("mlp", l), x, start)
        head_start = start.last_only() if isinstance(start, Rows) else start  # (logits_of: its last rows)
        logits = self._block(Block("lm_head", self.config.n_layers), x[logits_of], head_start)
        self.step += 1
        self.timings.forwards += self.decoding  # counted once done: a pass an agent failure cut short is tried again
        self.estimates.observe(len(tokens))  # scheduler hook (estimates.py)
        return logits

    def _block(self, block: Block, x: np.ndarray, start: int | Rows) -> np.ndarray:
        """One round: send the input, compute the own share, merge the partials (own share first, then
        agents by node id: deterministic). Decode rounds are timed (timing.py RoundClock)."""
        clock = RoundClock()
        if block in self.alone:  # nothing to send or gather (~20 us of round bookkeeping a block saved)
            out = self._own(block, x, start)
            clock.mark("own")
            self._predict_next(block, x)
            clock.mark("predict")
            self._timed(clock, {}, synced=False)
            return out
        round_ = self._open_round(block, x, start)
        round_.send()
        clock.mark("send")
        out = self._own(block, x, start)
        clock.mark("own")
        if self.sync.pred_overlap:
            self._predict_next(block, x)  # while the partial sums are in flight
            clock.mark("predict")
        partials = round_.collect()
        clock.mark("wait")
        for i, partial in sorted(partials.items()):
            if partial is not None:
                out = self._merge(block, out, self.agents[i], partial)
        clock.mark("merge")
        if not self.sync.pred_overlap:
            self._predict_next(block, x)
            clock.mark("predict")
        self._timed(clock, round_.agent_compute, synced=bool(round_.plan.receivers))
        return out

    def _timed(self, clock: RoundClock, agent_compute: dict[int, float], synced: bool) -> None:
        """A decode round's times into the breakdown (prefill passes are not rounds of a token)."""
        if self.decoding:
            self.timings.record(clock.time(max(agent_compute.values(), default=0.0)), agent_compute, synced)

    def _predict_next(self, block: Block, x: np.ndarray) -> None:
        """HALO: rank the next layer's groups (from an attention block's input) and, within each tier of equally
        reliable agents that read groups from storage, keep the groups where they went last token (before our own
        load thread reads any of them)."""
        layer = block.layer + 1  # (an attention block's input ranks the next layer; other blocks rank nothing)
        if block.kind == "attention":
            self.rank_of.pop(layer, None)
        placing = block.kind == "attention" and layer in self.tiers
        self.worker.predict_next(block, x, (lambda ranking: self._place(layer, ranking)) if placing else None)

    def _place(self, layer: int, ranking: np.ndarray) -> np.ndarray:
        """A decode step's ranking [1, G] as keep_in_place places it, each group's predicted rank kept (a prompt's
        rows: each token its own groups, the agents read them all)."""
        if len(ranking) == 1:
            self.rank_of[layer] = np.argsort(ranking[0])
            ranking = keep_in_place(ranking[0], self.placed.get(layer), self.tiers[layer])[None]
        self.placed[layer] = ranking[-1]
        return ranking

    def _tiers(self, layer: int) -> list[list[tuple[int, int]]]:
        """The rank ranges of agents holding MLP ranks of a layer, in rank order, in tiers of links that lose alike
        (probed loss within TIER_PLR of the tier's first) where some agent of the tier reads its groups from storage:
        `keep_in_place`'s tiers. Ranges are cut at the critical ranks' end, so a top group never moves to where a
        partial may be zero-filled. Where every agent's link is lossless (LOSSLESS_PLR), one tier holds every range,
        the master's too: an agent given a top group is critical for that round (`_critical`, from the groups'
        predicted ranks), so no partial can be zero-filled and nothing moves (a bounded agent on a share + 10 % limit
        read 23 TinyLlama-shape groups a token for groups moving across the cut alone: 1.4x the unbounded agents'
        time). Where agents rank for themselves (over TCP every one; over UDP a listener) the ranking must stay as
        predicted."""
        if self.sync.policy.input is not Transport.UDP or self.listeners.get(layer):
            return []
        holders = self.holders[Block("mlp", layer)]
        probed = {i: (self.agents[i].profile.get("link") or {}).get("plr") for i in holders}  # None: never probed
        plr = {i: p or 0.0 for i, p in probed.items()}
        if holders and all(p is not None and p <= LOSSLESS_PLR for p in probed.values()):
            if not (self.worker.loads_ahead or any(self.agents[i].loads_ahead for i in holders)):
                return []
            own = [rank_range(self.worker.share.mlp[layer])] if self.worker.share.mlp[layer] else []
            return [sorted(own + [rank_range(self.agents[i].share.mlp[layer]) for i in holders])]
        cut = math.ceil(self.sync.critical_fraction * self.layout.n_mlp_groups)
        held = sorted((piece, i) for i in holders
                      for a, b in [rank_range(self.agents[i].share.mlp[layer])]
                      for piece in ([(a, cut), (cut, b)] if a < cut < b else [(a, b)]))
        tiers = []
        for (a, b), i in held:
            first = tiers[-1][0] if tiers else None
            if (first and tiers[-1][-1][0][1] == a and abs(plr[i] - plr[first[1]]) <= TIER_PLR
                    and (first[0][0] < cut) == (a < cut)):
                tiers[-1].append(((a, b), i))
            else:
                tiers.append([((a, b), i)])
        return [[r for r, _ in tier] for tier in tiers
                if len(tier) > 1 and any(self.agents[i].loads_ahead for _, i in tier)]

    def _open_round(self, block: Block, x: np.ndarray, start: int | Rows) -> MasterRound:
        holders = self.holders[block]
        remapper, listeners, ranking = self.worker.remapper, [], None
        if remapper is not None and block.kind == "attention" and block.layer + 1 < self.config.n_layers:
            listeners = self.listeners[block.layer + 1]  # they predict the next layer from this input
        plan = plan_round(self.sync.policy, holders, listeners, self._critical(block, holders))
        epoch = Epoch(self.forward_id, block.layer, POINTS[block.kind]).encode()
        digest = self.worker.digest(block.layer) if block.kind == "mlp" else 0
        following = None
        if block.kind == "mlp" and plan.input_udp and remapper is not None:
            if any(self.agents[i].loads_ahead for i in plan.input_udp):  # the next layer's ranking, to load ahead
                following = remapper.rankings.get(block.layer + 1)
            if digest:  # the agents compute the groups of our ranking: it rides in the input
                ranking = remapper.rankings.get(block.layer)
            elif following is not None:  # a layer nobody ranks (layer 0): its order, for the next layer's to ride with
                ranking = np.tile(np.arange(self.layout.n_mlp_groups), (len(x), 1))
                digest = ranking_digest(ranking)
        where = f"{len(start.segments)} sequences" if isinstance(start, Rows) else f"position {start}"
        label = f"{block.kind} of layer {block.layer} at {where} (step {self.step})"
        return MasterRound(self.rounds, block, epoch, x, start, digest, plan, label, ranking, following)

    def _listeners(self, layer: int) -> list[int]:
        """Agents that need the input of layer-1's attention to predict `layer`'s ranking themselves. Over UDP an
        MLP input carries the master's ranking, and for agents that load their groups ahead (a memory budget) the
        next layer's too: only such an agent that holds no MLP ranks of layer-1 (so gets no MLP input of it) still
        listens; over TCP every holder of the layer's MLP does."""
        ranks = self.sync.policy.input is not Transport.UDP
        return [i for i in self.holders[Block("mlp", layer)] if (ranks or self.agents[i].loads_ahead)
                and ranks_next_layer_itself(self.sync.policy, self.agents[i].share.mlp, layer - 1)]

    def _own(self, block: Block, x: np.ndarray, start: int | Rows) -> np.ndarray:
        if block.kind == "lm_head":
            if self.whole_lm_head:
                return self.worker.compute(block, x, start)
            out = np.zeros((len(x), self.config.vocab_size), dtype=np.float32)
            if self.worker.lm_head is not None:
                out[:, self.own_vocab_ids] = self.worker.compute(block, x, start)
            return out
        return self.worker.compute(block, x, start) if self.worker.holds(block) else np.zeros_like(x)

    @staticmethod
    def _merge(block: Block, out: np.ndarray, agent: RemoteAgent, partial: np.ndarray) -> np.ndarray:
        if block.kind == "lm_head":
            out[:, agent.vocab_ids] = partial
            return out
        return out + partial

    # ---- what is critical, and the ranks of what was dropped ------------------------------------------
    def _critical(self, block: Block, holders: list[int]) -> set[int]:
        """Agents whose partial must arrive whole: layer 0 and the LM head always; in HALO mode any holding a
        group in the predicted top `critical_fraction` (MLP: by its rank range; heads: by the ranking)."""
        if block.kind == "lm_head" or block.layer == 0:
            return set(holders)
        if not self.sync.policy.remap:
            return set()
        if block.kind == "mlp":
            cut = math.ceil(self.sync.critical_fraction * self.layout.n_mlp_groups)
            if block.layer not in self.rank_of:  # the ranking as predicted: the top ranks' places
                return {i for i in holders if rank_range(self.agents[i].share.mlp[block.layer])[0] < cut}
            return {i for i in holders if min(self._ranks_of(self.agents[i], block)) < cut}
        ranking = self.worker.remapper.head_rankings.get(block.layer)
        if ranking is None:
            return set(holders)
        top = set(np.unique(ranking[:, :math.ceil(self.sync.critical_fraction * self.layout.n_heads)]).tolist())
        return {i for i in holders if top & set(self.agents[i].share.attention[block.layer])}

    def _ranks_of(self, agent: RemoteAgent, block: Block) -> list[int]:
        """Predicted importance ranks (0 = most important) of an agent's groups of a block."""
        groups = agent.share.groups(block)
        if self.worker.remapper is None:
            return list(groups)
        if block.kind == "mlp":
            ranks = range(*rank_range(groups))
            rank_of = self.rank_of.get(block.layer)  # placed by keep_in_place: the groups at those ranks, as predicted
            return list(ranks) if rank_of is None else rank_of[self.placed[block.layer][ranks.start:ranks.stop]].tolist()
        ranking = self.worker.remapper.head_rankings.get(block.layer)
        return list(groups) if ranking is None else [int(np.flatnonzero(ranking[-1] == h)[0]) for h in groups]

    # ---- reports and lifecycle --------------------------------------------------------------------------
    @property
    def rounds_per_pass(self) -> int:
        """Sync rounds a forward pass opens, whatever its length (blocks computed here alone open none)."""
        return sum(1 for block in self.holders if block not in self.alone)

    @property
    def own_compute_ms(self) -> float:
        return self.worker.compute_ms

    @property
    def own_cpu_ms(self) -> float:
        return self.worker.cpu_ms

    def report(self) -> list[dict]:
        """Per agent: profile, share, and the time the master spent waiting for it vs its own compute."""
        rows = []
        for i, agent in sorted(self.agents.items()):
            row = agent.report()
            if self.session.udp is not None and self.sync.policy.uses_udp:
                row["udp"] = self.session.udp.stats[i].to_json()
            rows.append(row)
        return rows

    def carry_from(self, previous: "DistributedModel") -> None:
        """A re-plan's master goes on from the last one's figures: the time breakdown and what the sync lost (--json,
        status), so they cover the whole generation, not the tokens since the re-plan (the losses before it, often
        the worst, were gone from the report)."""
        self.timings, self.ledger = previous.timings, previous.ledger
        self.rounds.ledger = previous.ledger

    def sync_report(self) -> dict:
        """The sync mode, its settings and what it lost (the loss ledger)."""
        out = {"settings": self.sync.to_json(), "loss": self.ledger.to_json(), "breakdown": self.timings.to_json()}
        if self.session.udp is not None:
            out["rejected"] = self.session.udp.rejections()  # datagrams refused here, by reason
            out["udp_gso"] = self.session.udp.segmenting  # False where asked off or the kernel refused it
        if self.worker.remapper is not None:
            out.update(self.worker.remapper.report())
        return out

    def refill(self, inputs: np.ndarray) -> None:
        """Positions 0..T-1 from the residual stream that entered each attention block there, [L, T, D] (an
        InputLog's): every device writes its heads' K/V from it, one projection per layer, instead of running
        the history through every block (a replay). Nothing else holds state across positions."""
        layers_of = {i: [l for l, heads in enumerate(a.share.attention) if heads] for i, a in self.agents.items()}
        for i, agent in self.agents.items():  # one message per layer: each answer comes within the usual timeout
            for layer in layers_of[i]:
                agent.send("fill", {"layers": [layer]}, [inputs[layer:layer + 1]])
        for layer in self.worker.attention:
            self.worker.fill(layer, inputs[layer])
        for i, agent in self.agents.items():
            for layer in layers_of[i]:
                agent.receive(f"fill of layer {layer}")
        self.pos = inputs.shape[1]

    def reset(self) -> None:
        self.pos = self.step = 0
        self.worker.reset()
        self.session.reset()

    def close(self, retain: bool = False) -> None:
        """retain: the agents keep this session's kernels a while (a re-plan follows: sticky shares reuse them)."""
        self.worker.close()
        self.session.close(retain)
