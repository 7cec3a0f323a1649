"""The master's side of one round: a block's input goes out, the agents' partial outputs come back.

`MasterRound` carries out a `RoundPlan` (halo/sync/modes.py): it sends the input over UDP and/or the
control connection, then `collect` gathers the partials the same ways, chases silent agents,
stops waiting for droppable partials at the adaptive deadline, checks statuses, feeds the deadline
rule and the loss ledger, and returns each agent's partial (None: dropped) by node id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from halo.compute.batch import Rows
from halo.compute.shares import Block
from halo.sync import AdaptiveDeadline, LossLedger, RoundPlan, Status, SyncSettings
from halo.sync.framing import FramingError, frame_broadcast, partial_size, read_partial, reply_epoch
from halo.transport import wire
from halo.transport.udp import GatherPolicy, PeerDeadline, UdpEndpoint

from halo.distributed.remote import AgentError, RemoteAgent


@dataclass
class RoundContext:
    """What every round of a session shares."""

    agents: dict[int, RemoteAgent]  # by node id
    udp: UdpEndpoint | None
    sync: SyncSettings
    deadline: AdaptiveDeadline
    ledger: LossLedger
    timeout_s: float
    dim: int
    ranks_of: object  # (agent, block) -> predicted ranks of its groups, for the ledger


class MasterRound:
    def __init__(self, ctx: RoundContext, block: Block, epoch: int, x: np.ndarray, start: int | Rows, digest: int,
                 plan: RoundPlan, label: str, ranking: np.ndarray | None = None,
                 next_ranking: np.ndarray | None = None):
        """ranking: the master's MLP ranking of the block's layer (HALO), sent with a UDP input (framing.py);
        next_ranking: the next layer's, sent with it where an agent loads its groups ahead."""
        self.ctx, self.block, self.epoch, self.x, self.start = ctx, block, epoch, x, start
        self.digest, self.plan, self.label, self.ranking = digest, plan, label, ranking
        self.next_ranking = next_ranking
        self.tokens = len(x)
        self.expected = {i: partial_size(self.tokens, ctx.agents[i].width(block, ctx.dim)) for i in plan.partial_udp}
        self.sent_at = 0.0
        self.agent_compute: dict[int, float] = {}  # node id -> its compute for this round, as it reports it

    def send(self) -> None:
        ctx, plan = self.ctx, self.plan
        self.sent_at = time.perf_counter()
        if plan.input_udp:
            body = frame_broadcast(self.x, self.start, self.digest, wire.values_per_chunk(wire.FLOAT32), self.ranking,
                                   self.next_ranking)
            ctx.udp.send_vector({i: ctx.agents[i].udp_address for i in sorted(plan.input_udp)}, self.epoch, body,
                                **ctx.sync.protection(ctx.udp.lossy(plan.input_udp)))
        rows = isinstance(self.start, Rows)  # a batched pass: each row's slot and position ride as a second array
        arrays = [self.x, self.start.table] if rows else [self.x]
        for i in sorted(plan.input_tcp):
            reply = "tcp" if i in plan.partial_tcp else ("udp" if i in plan.partial_udp else "none")
            ctx.agents[i].send("block", {"kind": self.block.kind, "layer": self.block.layer,
                                         "start_pos": -1 if rows else self.start, "epoch": self.epoch,
                                         "digest": self.digest, "reply": reply}, arrays)

    def collect(self) -> dict[int, np.ndarray | None]:
        """Every holder's partial output (None: dropped), after the plan's waiting rules."""
        partials = self._gather_udp() if self.expected else {}
        for i in sorted(self.plan.partial_tcp):
            partials[i] = self._receive_tcp(self.ctx.agents[i])
        return partials

    # ---- UDP --------------------------------------------------------------------------------------------
    def _gather_udp(self) -> dict[int, np.ndarray | None]:
        ctx, plan = self.ctx, self.plan
        holders = [i for i in self.expected if ctx.agents[i].holds(self.block)]
        deadline = ctx.deadline.deadline_s(self.block.kind, holders, self.tokens)
        late = ctx.deadline.late_deadline_s(self.block.kind, holders, self.tokens)
        waited = time.perf_counter() - self.sent_at
        own = {} if ctx.sync.policy.all_critical else {  # deadlines of its own for each dropped-if-late agent
            i: PeerDeadline(max(0.0, d.loss_s - waited), max(0.0, d.late_s - waited))
            for i, d in ctx.deadline.per_peer(self.block.kind, holders, self.tokens).items()}
        # a critical partial: the turnaround a droppable one is given (token-scaled until measured: a first 24-token
        # pass may take 2.4 s) and timeout_s beyond it (a fixed timeout_s from the start failed first prompt passes
        # on Wi-Fi whose whole vector a burst took: the chase comes at 0.6 x the late deadline)
        self.critical_s = late + ctx.timeout_s
        policy = GatherPolicy(deadline_s=max(0.0, deadline - waited), hard_deadline_s=max(0.0, self.critical_s - waited),
                              late_deadline_s=max(0.0, late - waited), critical=plan.critical, nack=plan.nack,
                              silent_s=AdaptiveDeadline.chase_after_s(late), per_peer=own)
        result = ctx.udp.gather(reply_epoch(self.epoch), self.expected, ctx.sync.partial_dtype, policy, on_silent=self._chase)
        gathered = time.perf_counter() - self.sent_at
        if any(i not in plan.critical for i in holders):
            ctx.ledger.blocks += 1
        partials = {}
        for i in sorted(self.expected):
            agent = ctx.agents[i]
            self._check_alive(agent, i in result.heard, i in plan.critical and not result.masks[i].all())
            if i in result.done_s:
                ctx.deadline.observe(self.block.kind, i, waited + result.done_s[i], self.tokens)
            elif agent.holds(self.block):  # cut at its deadline: a turnaround at least that long (RFC 6298 backs off
                ctx.deadline.observe(self.block.kind, i, gathered, self.tokens)  # too), or the deadlines only shrink
            agent.stats.reply_ms += 1e3 * (waited + result.done_s[i] if i in result.done_s else gathered)
            partial = self._read(agent, result.values[i], result.masks[i], lost=i in result.lossy)
            if agent.holds(self.block):
                partials[i] = partial
        return partials

    def _chase(self, peer: int) -> None:
        """An agent still owed data has sent nothing: it may have lost its whole input, or be gone."""
        agent = self.ctx.agents[peer]
        if agent.gone():  # its process ended: nothing will come, whatever the deadline
            raise self._gone(agent)
        if peer not in self.plan.chase:
            return
        if peer in self.plan.input_udp:
            self.ctx.udp.resend(self.epoch, peer)  # it answers a repeated input by sending its partial again
        else:  # its input came over TCP: ask for every chunk of its partial
            self.ctx.udp.request_all(reply_epoch(self.epoch), peer, self.expected[peer])

    def _gone(self, agent: RemoteAgent) -> AgentError:
        return AgentError(f"agent {agent} sent nothing for {self.label} and its connection closed (the agent process "
                          "ended, or its host went down)")

    def _check_alive(self, agent: RemoteAgent, heard: bool, incomplete_critical: bool) -> None:
        if incomplete_critical:
            raise AgentError(f"agent {agent} did not deliver its partial of {self.label} within "
                             f"{self.critical_s:.1f} s: it stopped or its link is down")
        if heard:
            agent.heard()
        elif agent.gone():
            raise self._gone(agent)
        elif agent.silent_for() > self.ctx.timeout_s:
            raise AgentError(f"agent {agent} has sent nothing for {agent.silent_for():.1f} s (every partial since "
                             "was dropped): it stopped or its link is down")

    def _read(self, agent: RemoteAgent, values: np.ndarray, mask: np.ndarray, lost: bool) -> np.ndarray | None:
        """The agent's partial if any of it can be used; accounts what was lost."""
        chunks = len(mask)
        missing = chunks if not mask[0] else int((~mask).sum())  # no prefix: nothing of it can be trusted
        partial = None
        if mask[0]:
            try:
                partial = read_partial(values, self.tokens, agent.width(self.block, self.ctx.dim))
            except FramingError as e:
                raise AgentError(f"agent {agent} sent a malformed {self.block} partial: {e}") from None
            self._check_status(agent, partial.status)
            agent.stats.compute_ms += partial.compute_ms
            self.agent_compute[agent.node_id] = partial.compute_ms
        if agent.holds(self.block) and self.block.kind != "lm_head":
            ranks = self.ctx.ranks_of(agent, self.block) if missing else None
            groups = len(agent.share.groups(self.block))
            self.ctx.ledger.record(self.block.kind, self.block.layer, groups * self.tokens, missing, chunks, ranks, lost)
        return None if partial is None or missing == chunks else partial.values

    def _check_status(self, agent: RemoteAgent, status: Status) -> None:
        if status is Status.KV_GAP:
            raise AgentError(f"agent {agent} never received an attention input its KV cache needs (its link lost "
                             "everything for a second); start the generation again")
        if status is Status.RANKING_MISMATCH:
            raise AgentError(f"agent {agent} ranked layer {self.block.layer}'s groups differently from the master "
                             "(different predictors or onnxruntime build); use the same halo release everywhere, "
                             "or --sync lossy")

    # ---- TCP --------------------------------------------------------------------------------------------
    def _receive_tcp(self, agent: RemoteAgent) -> np.ndarray:
        reply = agent.receive(self.label)
        partial = reply.arrays[0] if reply.arrays else None
        shape = (self.tokens, agent.width(self.block, self.ctx.dim))
        if partial is None or partial.shape != shape:
            raise AgentError(f"agent {agent} returned a {self.block.kind} partial of shape "
                             f"{None if partial is None else partial.shape}, expected {shape}")
        compute_ms = float(reply.fields.get("compute_ms", 0.0))
        agent.stats.compute_ms += compute_ms
        agent.stats.cpu_ms += float(reply.fields.get("cpu_ms", 0.0))
        self.agent_compute[agent.node_id] = compute_ms
        return partial
