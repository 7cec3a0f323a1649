"""Generation that outlives its agents: re-plan over the devices still answering, rebuild, replay, go on.

`SurvivingModel` wraps the tensor-parallel master (`DistributedModel`) behind the same interface
(forward, reset, max_seq_len; everything else is the current master's). It keeps the token ids of
the sequence the agents hold. When a pass fails with an `AgentError` (an agent's process ended, it
stopped, or its link was silent for --timeout), it:

1. asks every listed agent for its status at once (`ask_status`, one short bound);
2. re-plans over the master and the agents that answered. Sticky (the default, in the exact modes):
   every survivor keeps its groups and the failed agent's groups are split among them (scheduler/sticky.py
   `spread_lost`); each device keeps the kernels of the groups it held (DeviceWorker `reuse`), so it
   builds only what it gained: about 1/(n-1) of a share instead of a whole one. Otherwise (HALO and
   lossy modes, whose priority ranks are contiguous ranges; a sticky plan over a device's memory;
   `sticky=False`) from the profiles measured at start (the scheduler, the same algorithm as the first
   plan: `Replanner.survivors` in connect.py), leaving out the agent that failed;
3. opens a new session with the new shares (agents take a new hello over the old session) and
   rebuilds the KV caches: from the residual stream the master recorded entering each attention block
   (`InputLog`; every device projects its heads' K/V of the history, one call per layer, no round per
   block), or where that was not kept (over `input_log_mb`) by recomputation: the token history runs
   once through the new assignment as one prefill. Then the failed pass runs again from the same position.

Why recomputation and not KV replicas: a replica doubles every agent's cache (on a Pi the cache, not
the weights, is what grows with the context) and costs a copy per token on the links that lose
packets; a refill costs one K/V projection of the history per failure, held by the master alone
(L x positions x dim floats: 46 MB for 256 positions of a 1.1B Llama), a replay one prefill
(eval/results/churn.md). In the exact modes the continuation equals an uninterrupted run's up to
float summation order (partials are added in another grouping), which greedy decoding does not
notice on the known answer.

Joins: an agent that failed is asked again between passes (a status request that never blocks a
pass); one that answers is taken into a re-plan when the plan would change. A sticky join gives it back
its share of the last full plan (its "home"), which the others drop: they build nothing. The quarantine
(hysteresis), the re-plan record and the rebalance rule are halo/runtime/replanning.py's, shared with the
pipeline coordinator.
Generation fails only when the devices left cannot hold the model (the scheduler's message says
what is missing) or after `max_attempts` rebuilds in one pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from halo.compute.batch import Rows
from halo.compute.shares import Shares
from halo.errors import ConfigError, HaloError
from halo.generation.generate import prefill, prefill_chunk
from halo.runtime.replanning import Membership, RebalanceClock, Recovery, SurvivalSettings, recovery_kind, status_probe
from halo.scheduler.sticky import spread_lost, take_back

from halo.distributed.remote import AgentError, ask_status
from halo.distributed.session import master_context

log = logging.getLogger("halo.master")
__all__ = ["ClusterLost", "SurvivalSettings", "SurvivingModel"]


class ClusterLost(HaloError):
    """The devices left cannot go on with the generation."""


class InputLog:
    """The residual stream entering each attention block at each position, as the master sent it. It is all a new
    assignment needs to continue: the KV caches are the only state across positions, and each device computes its
    heads' K/V of the history from it (one projection per layer: ~1/10 of a replay's compute for a Llama, with no
    round trip per block). Up to `max_bytes` (positions beyond are not kept: a re-plan then replays)."""

    def __init__(self, n_layers: int, dim: int, context: int, max_bytes: float):
        self.max_positions = min(context, int(max_bytes // (4 * n_layers * dim)))
        # allocated once, zeroed by the OS page by page as positions are written (calloc): memory follows the longest
        # sequence so far with no copy on the way (growing by doubling cost a decode step ~40 us a layer, page faults
        # on fresh memory and copies, on the master's critical path)
        self.inputs = np.zeros((n_layers, self.max_positions, dim), dtype=np.float32)
        self.length = 0  # positions recorded (each holds its latest input)

    def record(self, layer: int, start: int, x: np.ndarray) -> None:
        end = min(start + len(x), self.max_positions)  # what fits: every kept position holds its latest input
        if end <= start:
            return
        self.inputs[layer, start:end] = x[:end - start]
        self.length = max(self.length, end)

    def window(self, n: int) -> np.ndarray | None:
        """[L, n, D] of positions 0..n-1, or None where they were not kept."""
        return self.inputs[:, :n] if 0 < n <= self.length else None


@dataclass
class SurvivingModel:
    """model: the first master; listed: every agent endpoint the user gave (in the plan or not); planner:
    `survivors(endpoints)` -> (plan, agent endpoints in plan order), raising ConfigError when they cannot hold
    the model, and `observed(model)` -> (plan, endpoints, predicted s/token now, with the new plan) from the
    running estimates (connect.Replanner); build(plan, endpoints) -> a new master; key/insecure: to ask
    agents their status."""

    model: object
    listed: list[str]
    planner: object
    build: Callable
    key: object = None
    insecure: bool = False
    settings: SurvivalSettings = field(default_factory=SurvivalSettings)
    history: list[int] = field(default_factory=list)
    slot_history: dict[int, list[int]] = field(default_factory=dict)  # batched passes: the tokens each slot holds
    recoveries: list[Recovery] = field(default_factory=list)

    def __post_init__(self):
        self.max_seq_len = self.model.max_seq_len
        self._plan_endpoints = [a.endpoint for _, a in sorted(self.model.agents.items())]
        self._probes = master_context()
        # every listed agent answered at start; one the first plan left out is idle, not absent
        self.membership = Membership(self.settings, lambda e: status_probe(self._probes, e, self.key, self.insecure))
        self._clock = RebalanceClock(self.settings)
        self._open = True  # whether self.model still needs closing
        self._shares = self._shares_of(self.model)  # endpoint ("" = the master) -> groups, of the last plan tried
        self._set_home(self.model.plan, self._plan_endpoints)
        c = self.model.config
        self.input_log = InputLog(c.n_layers, c.dim, self.max_seq_len, self.settings.input_log_mb * 1e6) \
            if self.settings.input_log_mb > 0 else None
        self.model.input_log = self.input_log

    @property
    def absent(self) -> dict:
        return self.membership.absent

    def in_plan(self) -> list[str]:
        """The agents of the current (or the last attempted) plan."""
        return list(self._plan_endpoints)

    def __getattr__(self, name):  # report, sync_report, plan, planning, timings, ...: the current master's
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    # ---- the model interface ------------------------------------------------------------------------
    def forward(self, tokens, start_pos: int | None = None, all_logits: bool = False) -> np.ndarray:
        tokens = [int(t) for t in np.asarray(tokens, dtype=np.int64).reshape(-1)]
        start = len(self.history) if start_pos is None else start_pos
        if not 0 <= start <= len(self.history):
            raise ValueError(f"start_pos {start} is beyond the {len(self.history)} positions the cluster holds")
        self._take_back_returning(self.history[:start])
        self._rebalance(self.history[:start])
        for _ in range(self.settings.max_attempts):
            try:
                out = self.model.forward(tokens, start, all_logits)
            except AgentError as e:
                self._recover(str(e), self.history[:start])
                continue
            self.history = self.history[:start] + tokens
            return out
        raise self._gave_up()

    def forward_rows(self, tokens, rows: Rows) -> np.ndarray:
        """A batched pass (DistributedModel.forward_rows). After a re-plan every slot's history is replayed into the
        new assignment, slot by slot, before the failed pass runs again (the input log holds one sequence)."""
        tokens = [int(t) for t in np.asarray(tokens, dtype=np.int64).reshape(-1)]
        for s in rows.segments:
            if s.start > len(self.slot_history.get(s.slot, [])):
                raise ValueError(f"slot {s.slot}: position {s.start} is beyond the "
                                 f"{len(self.slot_history.get(s.slot, []))} positions the cluster holds")
        model, stale = self.model, False
        self._take_back_returning([])
        for _ in range(self.settings.max_attempts):
            try:
                if stale or self.model is not model:
                    replayed = self._replay_slots({s.slot: s.start for s in rows.segments})
                    if self.recoveries:  # (the re-plan recorded no prefix: a batch's histories are replayed here)
                        self.recoveries[-1].replayed_tokens += replayed
                    log.info("replayed %d positions of %d sequences on the new assignment", replayed,
                             len(self.slot_history))
                    model, stale = self.model, False
                out = self.model.forward_rows(tokens, rows)
            except AgentError as e:
                self._recover(str(e), [])
                stale = True
                continue
            for s in rows.segments:
                self.slot_history[s.slot] = self.slot_history.get(s.slot, [])[:s.start] + tokens[s.first:s.last]
            return out
        raise self._gave_up()

    def _gave_up(self) -> ClusterLost:
        return ClusterLost(f"the cluster failed {self.settings.max_attempts} times in one pass; last recoveries: "
                           f"{[r.cause for r in self.recoveries[-self.settings.max_attempts:]]}")

    def release_slot(self, slot: int) -> None:
        """The sequence in `slot` is done: nothing of it is replayed after a re-plan."""
        self.slot_history.pop(slot, None)

    def _replay_slots(self, kept: dict[int, int]) -> int:
        """Every slot's history through a new assignment, in prompt-sized passes (`kept`: slots the next pass rewrites
        from a position on: only what precedes it); returns the positions replayed."""
        chunk, replayed = prefill_chunk(self.model.config.dim), 0
        for slot, history in sorted(self.slot_history.items()):
            history = history[:kept.get(slot, len(history))]
            for at in range(0, len(history), chunk):
                piece = history[at:at + chunk]
                self.model.forward_rows(piece, Rows.of([(slot, at, len(piece))]))
            replayed += len(history)
        return replayed

    def reset(self) -> None:
        self.history = []
        self.slot_history = {}
        try:
            self.model.reset()
        except AgentError as e:
            self._recover(str(e), [])

    def close(self) -> None:
        self.membership.close()
        self._probes.destroy(linger=0)
        self._close_model()

    def _close_model(self, replanning: bool = False) -> None:
        """replanning: the agents keep the session's kernels a while for the next hello (sticky re-plans)."""
        if self._open:
            self._open = False
            self.model.close(retain=replanning)  # never waits for an agent that is gone; the others end that session

    def survival_report(self) -> dict:
        return {"recoveries": [r.to_json() for r in self.recoveries], "in_plan": self.in_plan(),
                "absent": self.membership.report()}

    # ---- failures ------------------------------------------------------------------------------------
    def _recover(self, cause: str, prefix: list[int]) -> None:
        """Re-plan without the agents that failed or do not answer, rebuild, replay `prefix`."""
        t0 = time.perf_counter()
        for _ in range(self.settings.max_attempts):
            before = self.in_plan()
            failed = [e for e in before if f"({e})" in cause]  # AgentError names an agent as "name (endpoint)"
            ask = [e for e in self.listed if e not in failed and e not in self.absent]  # who else is gone?
            answers = ask_status(ask, self.key, self.insecure, self.settings.status_timeout_s)
            silent = [e for e in ask if "error" in answers[e]]
            for endpoint in dict.fromkeys(failed + silent):  # (one another master took over too: asked back after
                self.membership.fail(endpoint)  # its quarantine, which doubles each time it is taken again)
            lost = [e for e in before if e in self.absent]
            log.warning("agent failure: %s; re-planning without %s", cause, ", ".join(lost) or "nobody")
            error = self._rebuild(cause, prefix, t0, lost=lost, joined=[], planned=self._sticky_without_absent())
            if error is None:
                return
            cause = error
        raise ClusterLost(f"the cluster could not be rebuilt in {self.settings.max_attempts} attempts; last: {cause}")

    def _rebuild(self, cause: str, prefix: list[int], t0: float, lost: list[str], joined: list[str],
                 planned: tuple | None = None) -> str | None:
        """A new master over the listed agents not absent (or `planned`: a plan, its endpoints and, for a sticky
        re-plan, every participant's shares), the history replayed; the AgentError's message when an agent fails
        the hello or the replay (the caller tries again without it)."""
        present = [e for e in self.listed if e not in self.absent]
        try:
            plan, endpoints, *shares = planned or self.planner.survivors(present)
        except ConfigError as e:
            self._close_model()
            raise ClusterLost(f"generation cannot go on after {cause}: the devices left (the master"
                              f"{', ' + ', '.join(present) if present else ' alone'}) cannot hold the model: {e}") from None
        self._close_model(replanning=True)
        self._plan_endpoints = list(endpoints)
        sticky, inputs = bool(shares), self.input_log.window(len(prefix)) if self.input_log and prefix else None
        previous = self.model  # its figures go on in the new master (carry_from)
        try:
            self.model = self.build(plan, endpoints, shares=shares[0] if sticky else None,
                                    reuse=getattr(self.model, "worker", None))
            self._open = True
            self._shares = self._shares_of(self.model)
            if not sticky:
                self._set_home(plan, endpoints)
            self.model.input_log = self.input_log
            if inputs is not None:
                self.model.refill(inputs)  # what the history left in the KV caches, without running it again
            elif prefix:
                prefill(self.model, prefix)  # (a fresh model starts at position 0; in passes whose vectors stay small)
            if hasattr(previous, "ledger"):
                self.model.carry_from(previous)
        except AgentError as e:
            return str(e)
        finally:
            refilled = inputs is not None and self._open
            kept, moved = self._kept_and_moved()
            self.recoveries.append(Recovery(recovery_kind(cause), cause, lost, joined, endpoints, len(prefix),
                                            time.perf_counter() - t0, sticky=sticky, refilled=refilled,
                                            kept_groups=kept, moved_groups=moved))
        log.warning("re-planned (%s) in %.2f s over %d agents (%s); %s", "sticky" if sticky else "full",
                    time.perf_counter() - t0, len(endpoints), ", ".join(endpoints) or "the master alone",
                    f"{'refilled the KV caches of' if refilled else 'replayed'} {len(prefix)} positions" if prefix
                    or not self.slot_history else f"the {len(self.slot_history)} sequences' positions are replayed next")
        return None

    # ---- sticky re-plans --------------------------------------------------------------------------------
    def _sticky_without_absent(self) -> tuple | None:
        """A sticky re-plan without the absent agents: the others keep their groups and take the absent ones'. None for
        a paired plan: spreading a lost agent's layers over everyone left would engage every process in those layers'
        rounds, so the survivors are paired again (Replanner.survivors)."""
        if self.planner.paired:
            return None
        kept = [e for e in self._shares if e and e not in self.absent]
        lost = [share for e, share in self._shares.items() if e in self.absent]
        return self._sticky(["", *kept], spread_lost([self._shares[e] for e in ["", *kept]], lost))

    def _sticky_with(self, returning: list[str]) -> tuple | None:
        """A sticky re-plan with returning agents: each takes back its share of the last full plan (None: one of
        them was not in it)."""
        _, home, device_of = self._home
        if any(e not in home for e in returning):
            return None
        if not any(sum(map(len, home[e].attention + home[e].mlp)) + len(home[e].lm_head) for e in returning):
            return None  # they held nothing in it: the planner decides whether they get work now
        participants = [e for e in device_of if e == "" or e in self._shares or e in returning]
        shares = [self._shares.get(e, home[e]) for e in participants]
        for e in returning:
            shares = take_back(shares, home[e])
        return self._sticky(participants, [home[e] if e in returning else s for e, s in zip(participants, shares)])

    def _kept_and_moved(self) -> tuple[int | None, int | None]:
        """(groups whose kernels the devices kept, groups they built) in the current session."""
        if not self._open:
            return None, None
        total = sum(sum(map(len, s.attention + s.mlp)) + len(s.lm_head) for s in self._shares.values())
        kept = self.model.worker.reused_groups + sum(a.kept_groups for a in self.model.agents.values())
        return kept, total - kept

    def _set_home(self, plan, endpoints: list[str]) -> None:
        """The last full plan: its plan, every device's share in it, each device's place in its cluster."""
        self._home = (plan, dict(self._shares), dict(zip(["", *endpoints], plan.devices)))

    @staticmethod
    def _shares_of(model) -> dict[str, Shares]:
        return {"": model.worker.share, **{a.endpoint: a.share for a in model.agents.values()}}

    def _sticky(self, participants: list[str], shares: list[Shares]) -> tuple | None:
        """(plan, agent endpoints, shares) for a sticky re-plan over `participants` ("" = the master, first), or
        None where it cannot be one: not in an exact mode (HALO's and lossy's priority ranks are contiguous rank
        ranges placed by link reliability), a device the last full plan did not have, or a share over a device's
        memory."""
        from halo.scheduler.plan import TensorParallelPlan

        base, _, device_of = self._home
        if not self.settings.sticky or not self.model.sync.policy.all_critical \
                or any(e not in device_of for e in participants):
            return None
        counts = {kind: np.array([[len(g) for g in getattr(s, kind)] for s in shares], dtype=np.int64)
                  for kind in ("attention", "mlp")}
        counts["lm_head"] = np.array([len(s.lm_head) for s in shares], dtype=np.int64)
        plan = TensorParallelPlan(base.cluster, base.model, "sticky", [device_of[e] for e in participants], counts)
        if np.any(plan.memory_used() > np.array([d.memory_bytes for d in plan.profiles()])):
            return None
        return plan, participants[1:], shares

    # ---- stragglers -----------------------------------------------------------------------------------
    def _rebalance(self, prefix: list[int]) -> None:
        """Every `rebalance_every_s`, once every device has a full window of estimates: re-plan from what the
        devices were observed to deliver when the cost model says the new plan is at least `rebalance_gain`
        faster (a re-plan costs a replay: only a persistent difference pays for it; a transient stall is the
        deadline's business)."""
        if not self._clock.due() or not prefix:
            return
        estimates = getattr(self.model, "estimates", None)
        if estimates is None or any(len(d.compute.values) < d.compute.values.maxlen for d in estimates.devices.values()):
            return
        self._clock.checked()
        t0 = time.perf_counter()
        try:
            plan, endpoints, now_s, new_s = self.planner.observed(
                self.model, {index: e for e, index in self._home[2].items() if e})  # (an absent agent's too)
        except ConfigError as e:
            log.warning("no re-plan from the running estimates: %s", e)
            return
        if not self._clock.worth_it(now_s, new_s) or endpoints == self.in_plan() and \
                np.array_equal(plan.counts["mlp"], self.model.plan.counts["mlp"]):
            return
        before = self.in_plan()
        cause = f"rebalanced: {1e3 * now_s:.1f} -> {1e3 * new_s:.1f} ms/token predicted from the running estimates"
        log.warning("%s", cause)
        error = self._rebuild(cause, prefix, t0, lost=[e for e in before if e not in endpoints],
                              joined=[e for e in endpoints if e not in before], planned=(plan, endpoints))
        if error is None:
            self.planner.adopt(plan)
        else:
            self._recover(error, prefix)

    # ---- joins ----------------------------------------------------------------------------------------
    def _take_back_returning(self, prefix: list[int]) -> None:
        """Between passes: ask absent agents whose quarantine is over; re-plan with those that answered."""
        returning = self.membership.returning() if self.absent else []
        if not returning:
            return
        t0 = time.perf_counter()
        planned = self._sticky_with(returning)
        if planned is not None:
            log.warning("agent(s) %s answer again: they take back their shares", ", ".join(returning))
            error = self._rebuild("joined", prefix, t0, lost=[], joined=returning, planned=planned)
            if error is not None:
                self._recover(error, prefix)
            return
        try:
            planned = self.planner.survivors([e for e in self.listed if e not in self.absent])
        except ConfigError:
            return  # the next failure says what is missing
        if planned[1] == self.in_plan() and all(np.array_equal(planned[0].counts[k], self.model.plan.counts[k])
                                                for k in ("attention", "mlp", "lm_head")):
            return  # the plan would not change: no re-plan, no replay
        log.warning("agent(s) %s answer again: re-planning with them", ", ".join(returning))
        error = self._rebuild("joined", prefix, t0, lost=[], joined=returning, planned=planned)
        if error is not None:
            self._recover(error, prefix)
