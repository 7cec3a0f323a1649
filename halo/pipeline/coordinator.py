"""The pipeline coordinator: a model object that runs a forward pass through stage workers.

`PipelineModel` has the interface of the single-process `Transformer` (forward, reset, max_seq_len),
so halo/generation/generate.py and the lm-eval plugin drive it unchanged. Per forward, the token ids go to the
stage holding the embedding, each stage's residual stream goes to the next (a star: every hop passes
through the coordinator, which therefore sees and counts all traffic), and the head stage sends back
only what sampling needs: the top-k logits of the last position (k = 1 for greedy), or full logits
when asked (`head_top_k=0`, or `all_logits` for lm-eval scoring).

Recovery by recomputation (thesis 001 §5.2.4, Petals' replay): the coordinator keeps the token ids of
every forward pass it completed, as the calls that computed them. When a worker disappears it
re-plans over the workers left (halo/pipeline/replan.py), opens the new stages, replays those calls
so every new stage rebuilds its KV cache with the same kernels on the same inputs, and runs the
interrupted pass again. The continuation equals an uninterrupted run's.

Survival is the tensor-parallel master's (halo/runtime/replanning.py, shared): a lost native worker is
quarantined and asked again between passes; one that answers is taken into a re-plan when the plan
would change; every `rebalance_every_s` the stages' observed decode times rescale their workers'
profiles, and a plan the cost model predicts `rebalance_gain` faster replaces the current one (a
persistently slow worker gets fewer layers). Each re-plan is a `Recovery` record in report().
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from halo.compute.batch import check_span, check_tokens
from halo.compute.shares import planning_format
from halo.errors import ConfigError, HaloError
from halo.model.config import DEFAULT_CONTEXT
from halo.model.weights import ModelWeights
from halo.runtime.measure import MedianWindow
from halo.runtime.replanning import Membership, RebalanceClock, Recovery, SurvivalSettings, recovery_kind

from halo.pipeline.links import StageFailed, StageRefused, Traffic
from halo.pipeline.profile import WorkerProfile
from halo.pipeline.replan import Stage, model_costs, plan_stages, predicted_s, validate_stages
from halo.pipeline.stage import HeadRequest, dense_from_top_k


class PipelineError(HaloError):
    """The pipeline cannot go on: a worker refused, or too few workers are left to hold the model."""


@dataclass
class StageStats:
    calls: int = 0
    compute_ms: float = 0.0
    wall_ms: float = 0.0
    decode_ms: MedianWindow = field(default_factory=MedianWindow)  # recent one-token calls: the straggler signal


@dataclass
class History:
    """The forward calls whose results the KV caches hold: (start position, token ids)."""

    calls: list = field(default_factory=list)

    def truncate(self, position: int) -> None:
        kept = []
        for start, tokens in self.calls:
            if start < position:
                kept.append((start, tokens[:position - start]))
        self.calls = kept

    @property
    def positions(self) -> int:
        return sum(len(t) for _, t in self.calls)


class PipelineModel:
    def __init__(self, weights: ModelWeights, workers: list, stages: list[Stage] | None = None,
                 max_seq_len: int | None = None, fmt: str = "fp32", head_top_k: int = 1, recover: bool = True,
                 profiles: list[WorkerProfile] | None = None, survive: SurvivalSettings | None = None):
        c = self.config = weights.config
        self.max_seq_len = min(c.max_seq_len, max_seq_len or DEFAULT_CONTEXT)
        if head_top_k < 0:
            raise ConfigError(f"head_top_k must be >= 0 (0: full logits), got {head_top_k}")
        self.weights, self.fmt, self.head_top_k, self.recover = weights, fmt, head_top_k, recover
        self.cost_fmt = planning_format(fmt, weights)  # what the stages' weights cost ("native": the file's blocks)
        self.workers = list(workers)
        self.traffic = Traffic()
        for w in self.workers:
            if hasattr(w, "traffic"):
                w.traffic = self.traffic
        self.alive = [True] * len(self.workers)
        self.survive = survive or SurvivalSettings()
        self.membership = Membership(self.survive, self._ask_status)
        self._clock = RebalanceClock(self.survive)
        self.history = History()
        self.recoveries: list[Recovery] = []
        self.pos = 0
        self.step = 0
        self.ready: dict[int, dict] = {}
        self.profiles = profiles if profiles is not None else measure_profiles(self.workers, fmt)
        if len(self.profiles) != len(self.workers):
            raise ConfigError(f"{len(self.profiles)} profiles for {len(self.workers)} workers")
        if stages is None:
            stages, _ = plan_stages(self.devices(), c, self.cost_fmt, self.max_seq_len)
        validate_stages(stages, c, [w.name for w in self.workers])
        self.stages = list(stages)
        self.stats = {}
        self._open()
        self.traffic.sent = self.traffic.received = 0  # from here on: what generation costs

    # ---- set-up --------------------------------------------------------------------------------------------
    def devices(self, indices: list[int] | None = None, profiles: list[WorkerProfile] | None = None):
        model = model_costs(self.config, self.cost_fmt)
        indices = range(len(self.workers)) if indices is None else indices
        return [(profiles or self.profiles)[i].to_device(model, self.cost_fmt) for i in indices]

    def predicted_ms(self) -> float:
        """What the cost model says one decode step of the current plan takes."""
        return 1e3 * predicted_s(self.stages, self.devices(), self.config, self.cost_fmt, self.max_seq_len)

    def _open(self) -> None:
        self.ready = {}
        for s in self.stages:
            link = self.workers[s.worker]
            self.ready[s.worker] = link.open(s.start, s.stop, self.max_seq_len, self.fmt)
        self.stats = {s.worker: StageStats() for s in self.stages}

    def plan_json(self) -> list[dict]:
        return [{"worker": self.workers[s.worker].name, "start": s.start, "stop": s.stop,
                 "engine": self.ready.get(s.worker, {}).get("engine", "?"),
                 "weight_bytes": self.ready.get(s.worker, {}).get("weight_bytes", 0)} for s in self.stages]

    # ---- the forward pass ----------------------------------------------------------------------------------
    def forward(self, tokens, start_pos: int | None = None, all_logits: bool = False) -> np.ndarray:
        tokens = check_tokens(tokens, self.config.vocab_size)
        start = self.pos if start_pos is None else start_pos
        check_span(start, len(tokens), self.max_seq_len)
        if start > self.pos:
            raise ValueError(f"start position {start} would leave a hole after the {self.pos} cached positions")
        self.history.truncate(start)
        head = HeadRequest(0, True) if all_logits else HeadRequest(self.head_top_k, False)
        failure, detected_after_s = None, 0.0
        if self.recover:
            try:
                self._take_back_returning()
                self._rebalance()
            except StageFailed as e:  # a worker failed the new plan's hello or the replay
                failure = e
        while True:  # a worker lost while recovering is recovered from in turn
            t = time.perf_counter()
            try:
                if failure is not None:
                    self._recover(failure, detected_after_s)
                    failure = None
                out = self._run(tokens, start, head)
                break
            except StageFailed as e:
                if not self.recover:
                    raise PipelineError(str(e)) from None
                failure, detected_after_s = e, time.perf_counter() - t
        self.history.calls.append((start, tokens.copy()))
        self.pos = start + len(tokens)
        self.step += 1
        if all_logits or self.head_top_k == 0:
            return out[0] if all_logits else out[0][-1]
        return dense_from_top_k(out[0], out[1], self.config.vocab_size)

    def _run(self, tokens: np.ndarray, start: int, head: HeadRequest) -> list[np.ndarray]:
        x, c = tokens, self.config
        for k, s in enumerate(self.stages):
            link, last = self.workers[s.worker], k == len(self.stages) - 1
            t = time.perf_counter()
            try:
                arrays, compute_ms = link.forward(x, start, head if last else HeadRequest())
            except StageRefused as e:
                raise PipelineError(str(e)) from None
            stats = self.stats[s.worker]
            stats.calls += 1
            stats.compute_ms += compute_ms
            stats.wall_ms += 1e3 * (time.perf_counter() - t)
            if len(tokens) == 1:
                stats.decode_ms.add(compute_ms)
            if not last:
                if len(arrays) != 1 or arrays[0].shape != (len(tokens), c.dim) or arrays[0].dtype != np.float32:
                    raise PipelineError(f"stage worker {link.name} returned {_shapes(arrays)}, expected one "
                                        f"float32 [{len(tokens)}, {c.dim}] residual stream")
                x = arrays[0]
                continue
            rows = len(tokens) if head.all_positions else 1
            if head.all_positions or head.top_k == 0:
                ok = len(arrays) == 1 and arrays[0].shape == (rows, c.vocab_size)
            else:
                k = min(head.top_k, c.vocab_size)
                ok = (len(arrays) == 2 and arrays[0].shape == (k,) and arrays[1].shape == (k,)
                      and arrays[0].dtype == np.int64 and bool(np.all((arrays[0] >= 0) & (arrays[0] < c.vocab_size))))
            if not ok:
                raise PipelineError(f"the head stage ({link.name}) returned {_shapes(arrays)}, which is not what "
                                    f"was asked ({head.to_json()})")
            return arrays
        raise PipelineError("the plan's last stage does not hold the head")  # validate_stages prevents this

    # ---- recovery, joins, stragglers -----------------------------------------------------------------------
    def _index(self, name: str) -> int | None:
        return next((i for i, w in enumerate(self.workers) if w.name == name), None)

    def _recover(self, failure: StageFailed, detected_after_s: float) -> None:
        """Re-plan over the workers left, open their stages, replay the history."""
        lost = self._index(failure.worker)
        if lost is None:
            raise PipelineError(str(failure)) from None
        self.alive[lost] = False
        if getattr(self.workers[lost], "rejoins", False):
            self.membership.fail(failure.worker)  # asked again after its quarantine
        self._replan(str(failure), self._plan_over_alive(str(failure)), lost=[failure.worker], joined=[],
                     detected_after_s=detected_after_s)

    def _plan_over_alive(self, cause: str, profiles: list[WorkerProfile] | None = None) -> list[Stage]:
        alive = [i for i, ok in enumerate(self.alive) if ok]
        try:
            planned, _ = plan_stages(self.devices(alive, profiles), self.config, self.cost_fmt, self.max_seq_len)
        except ConfigError as e:
            raise PipelineError(f"{cause}; re-planning over the workers left failed: {e}") from None
        return [Stage(alive[s.worker], s.start, s.stop) for s in planned]

    def _replan(self, cause: str, stages: list[Stage], lost: list[str], joined: list[str],
                detected_after_s: float | None = None) -> None:
        t = time.perf_counter()
        self.stages = stages
        self._open()  # a failure here is another lost worker: forward()'s loop recovers from it too
        replayed = 0
        for start, tokens in self.history.calls:
            self._run(tokens, start, HeadRequest(1))
            replayed += len(tokens)
        self.recoveries.append(Recovery(recovery_kind(cause), cause, lost, joined,
                                        [[self.workers[s.worker].name, s.start, s.stop] for s in self.stages],
                                        replayed, time.perf_counter() - t, detected_after_s))

    def _ask_status(self, name: str):
        return self.workers[self._index(name)].status_probe()

    def _take_back_returning(self) -> None:
        """Between passes: workers back from quarantine that answered are planned over again; a re-plan (and its
        replay) only when the plan changes."""
        returning = self.membership.returning() if self.membership.absent else []
        for name in returning:
            i = self._index(name)
            self.workers[i].reconnect()
            self.alive[i] = True
        if not returning:
            return
        try:
            stages = self._plan_over_alive("joined")
        except PipelineError:
            return  # the next failure says what is missing
        if stages != self.stages:
            self._replan("joined", stages, lost=[], joined=returning)

    def _rebalance(self) -> None:
        """Every `rebalance_every_s`, once every stage has a full window of one-token calls: each worker's profile
        is rescaled by how its stage's median decode time compares with what the profile predicted, relative to
        the other stages (a machine-wide slowdown moves nothing). A worker persistently `rebalance_gain` slower
        than the rest makes the DP plan again; the new plan is taken when it is predicted that much faster."""
        windows = [self.stats[s.worker].decode_ms for s in self.stages]
        if not self._clock.due() or not self.history.calls or \
                any(len(w.values) < w.values.maxlen for w in windows):
            return
        self._clock.checked()
        ratios = {s.worker: w.median() / max(1e3 * self._predicted_compute_s(s), 1e-6) for s, w in zip(self.stages, windows)}
        typical = float(np.median(list(ratios.values())))
        relative = {w: r / typical for w, r in ratios.items()}
        if max(relative.values()) < 1 / (1 - self.survive.rebalance_gain):
            return
        observed = [replace(p, layer_s=p.layer_s * relative.get(i, 1.0), overhead_s=p.overhead_s * relative.get(i, 1.0))
                    for i, p in enumerate(self.profiles)]
        stages = self._plan_over_alive("rebalancing", observed)
        now_s = predicted_s(self.stages, self.devices(profiles=observed), self.config, self.cost_fmt, self.max_seq_len)
        new_s = predicted_s(stages, self.devices(profiles=observed), self.config, self.cost_fmt, self.max_seq_len)
        if stages == self.stages or not self._clock.worth_it(now_s, new_s):
            return
        before, after = {s.worker for s in self.stages}, {s.worker for s in stages}
        self.profiles = observed
        self._replan(f"rebalanced: {1e3 * now_s:.1f} -> {1e3 * new_s:.1f} ms/token predicted from the observed stage times",
                     stages, lost=[self.workers[i].name for i in before - after],
                     joined=[self.workers[i].name for i in after - before])

    def _predicted_compute_s(self, stage: Stage) -> float:
        """What the worker's profile says one decode call of `stage` costs on the worker itself (no link)."""
        from halo.scheduler.pipeline import model_units

        costs = model_costs(self.config, self.cost_fmt)
        flops = model_units(costs, self.max_seq_len).flops[stage.start:stage.stop].sum()
        profile = self.profiles[stage.worker]
        return profile.overhead_s + flops / profile.to_device(costs).compute_flops

    def survival_report(self) -> dict:
        return {"recoveries": [r.to_json() for r in self.recoveries],
                "in_plan": [self.workers[s.worker].name for s in self.stages], "absent": self.membership.report()}

    # ---- the rest of the model interface ---------------------------------------------------------------------
    def reset(self) -> None:
        self.pos = 0
        self.history = History()
        for s in self.stages:
            try:
                self.workers[s.worker].reset()
            except StageFailed:
                pass  # noticed (and recovered from) by the next forward pass

    def report(self) -> dict:
        steps = max(self.step, 1)
        stages = []
        for entry, s in zip(self.plan_json(), self.stages):
            st = self.stats.get(s.worker, StageStats())
            stages.append({**entry, "calls": st.calls, "compute_ms": round(st.compute_ms, 3),
                           "wall_ms": round(st.wall_ms, 3), "decode_compute_ms": _rounded(st.decode_ms.median())})
        return {"stages": stages, "bytes_sent": self.traffic.sent, "bytes_received": self.traffic.received,
                "bytes_per_forward": self.traffic.total / steps, "predicted_ms_per_token": round(self.predicted_ms(), 3),
                "profiles": [p.to_json() for p in self.profiles],
                "recoveries": [r.to_json() for r in self.recoveries]}

    def close(self) -> None:
        self.membership.close()
        for w in self.workers:
            try:
                w.close()
            except Exception:  # noqa: BLE001 - closing must not fail
                pass


def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)


def measure_profiles(links, fmt: str = "fp32") -> list[WorkerProfile]:
    """Every worker's self-benchmark (of the weight format its stage will compute in) and memory, and its link
    as measured from the coordinator."""
    out = []
    for link in links:
        fields = link.probe(fmt)
        rtt, bandwidth = link.link()
        out.append(WorkerProfile.from_json(link.name, {**fields, "rtt_s": rtt, "bandwidth_bps": bandwidth}))
    return out


def _shapes(arrays) -> str:
    return "[" + ", ".join(f"{a.dtype}{list(a.shape)}" for a in arrays) + "]"
