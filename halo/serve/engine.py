"""The serving engine: one thread owns the model and runs one generation at a time.

Why one at a time: a cluster master holds one KV cache (its own and, through its agents, theirs) and
one set of connections, so generations cannot interleave; halo does not batch. Requests wait in a
FIFO bounded by `max_queue` (QueueFull, HTTP 429, beyond it). Each request has a deadline counted
from its arrival (queue time included); the loop stops at the next token once the client has gone,
the deadline has passed or a stop string appeared (`generate(cancelled=...)`), so the cluster is free
for the next request one token later and the agents get nothing more for the old one.

The thread also builds the model (through `open_model`, the same code path as `halo-master generate`),
so local agents die with it (they are bound to the thread that started them). An agent failure
closes the cluster; the next request, or the next idle ping, builds it again (`rebuilds`). While
idle the engine pings the cluster every `ping_interval_s` (a `reset()`: every agent answers, which
also keeps their sessions from expiring after 60 s of silence) and so knows whether the agents live.

Everything other threads read comes from `snapshot` (view.py builds it), replaced whole, never mutated.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable

from ..errors import ConfigError, HaloError
from ..generate import GenerationCancelled, generate
from ..sampling import SamplingSettings
from ..speculative import SpeculationSettings
from . import view
from .protocol import BadRequest, ClusterUnavailable, QueueFull, RequestTimeout, ServeError

log = logging.getLogger("halo.serve")
SNAPSHOT_EVERY_S = 0.5  # while generating


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    prompt_tokens: int  # as counted by the caller (it validated the prompt's length)
    max_tokens: int
    sampling: SamplingSettings
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens or the context)
    prompt_tokens: int
    completion_tokens: int
    prefill_ms: float
    ms_per_token: float


class Cancelled(HaloError):
    """The client went away; nothing is sent any more."""


@dataclass
class Job:
    """One request's life: waiting -> running -> done. The event loop reads `events`:
    ("text", str)*, then ("done", Outcome) or ("error", ServeError)."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic()
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    state: str = "waiting"
    cancel_reason: str | None = None
    first_text_at: float | None = None

    def put(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


class StopScanner:
    """Cuts streamed text before the first stop string, holding back only what may begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        self.pending += piece
        cuts = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            out, self.pending = self.pending[:min(cuts)], ""
            return out
        keep = 0  # the longest tail of pending that is a proper prefix of a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:k]):
                    keep = k
                    break
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


@dataclass
class Totals:
    """What the engine did since it started (for /metrics and the view)."""

    requests: dict = field(default_factory=lambda: {"completed": 0, "cancelled": 0, "timeout": 0, "error": 0})
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rebuilds: int = 0
    last_tokens_per_s: float = 0.0
    last_ms_per_token: float = 0.0
    last_error: str | None = None
    speculative_drafted_tokens: int = 0  # --speculate: tokens drafted, those accepted, passes after the prompts
    speculative_accepted_tokens: int = 0
    speculative_passes: int = 0
    last_rounds_per_token: float | None = None  # sync rounds a token in the last generation (None: one process)


class Engine:
    def __init__(self, open_model: Callable[[ExitStack], object], tokenizer, weights, *, model_name: str,
                 sync_mode: str = "exact", max_queue: int = 32, request_timeout_s: float = 300.0,
                 ping_interval_s: float = 5.0, speculation=(SpeculationSettings(), None),
                 on_generation: Callable[[Outcome, list[float], float | None], None] | None = None):
        if max_queue < 0 or request_timeout_s <= 0 or ping_interval_s <= 0:
            raise ConfigError("--max-queue must be >= 0, --request-timeout and the ping interval > 0")
        self.open_model, self.tokenizer, self.weights = open_model, tokenizer, weights
        self.model_name, self.sync_mode = model_name, sync_mode
        self.max_queue, self.request_timeout_s, self.ping_interval_s = max_queue, request_timeout_s, ping_interval_s
        self.on_generation = on_generation
        self.speculation, self.drafter = speculation  # settings, drafter (None: prompt lookup)
        self.model = None
        self.max_seq_len = 0
        self.totals = Totals()
        self.agent_errors: dict[str, str] = {}  # agent name -> why it is down
        self.snapshot: dict = {}
        self._stack: ExitStack | None = None
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running: Job | None = None
        self._closing = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="halo-engine", daemon=True)

    # ---- the event loop's side ---------------------------------------------------------------------------------
    def start(self) -> "Engine":
        """Build the model in the engine thread; raise what that raised (bad model, unreachable agents)."""
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error
        return self

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Job:
        with self._lock:
            if self._waiting >= self.max_queue and (self._running is not None or self._waiting > 0):
                raise QueueFull(f"{self._waiting} requests are already waiting (--max-queue {self.max_queue}); "
                                "retry later", "queue_full")
            self._waiting += 1
            job = Job(request, loop, time.monotonic() + self.request_timeout_s)
        self._queue.put(job)
        return job

    def cancel(self, job: Job, reason: str = "disconnected") -> None:
        """The client went away: a waiting job leaves the queue, a running one stops at its next token."""
        with self._lock:
            if job.cancel_reason is None and job.state in ("waiting", "running"):
                job.cancel_reason = reason
                if job.state == "waiting":
                    job.state = "done"
                    self._waiting -= 1
                    self.totals.requests["cancelled"] += 1
                    job.put("error", Cancelled(reason))

    def queue_state(self) -> dict:
        """Now, not as of the last snapshot."""
        return {"waiting": self._waiting, "limit": self.max_queue, "running": self._running is not None}

    def close(self) -> None:
        self._closing = True
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # ---- the engine thread -------------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self._build()
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._closing:
                try:
                    job = self._queue.get(timeout=self.ping_interval_s)
                except queue.Empty:
                    self._ping()
                    continue
                if job is None:
                    break
                with self._lock:
                    if job.state != "waiting":
                        continue  # cancelled while it waited
                    job.state = "running"
                    self._waiting -= 1
                    self._running = job
                try:
                    self._serve(job)
                finally:
                    with self._lock:
                        job.state, self._running = "done", None
                    self._publish()
        finally:
            self._teardown()

    def _build(self) -> None:
        self._teardown()
        stack = ExitStack()
        try:
            self.model = self.open_model(stack)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        self.max_seq_len = self.model.max_seq_len
        self.agent_errors.clear()
        self._publish()

    def _teardown(self) -> None:
        self.model = None
        if self._stack is not None:
            stack, self._stack = self._stack, None
            try:
                stack.close()
            except Exception:  # noqa: BLE001 - a dead cluster may fail to close cleanly
                log.exception("closing the cluster failed")

    def _down(self, error: Exception) -> None:
        """An agent failed: note who, close the cluster; it is built again on the next request or ping."""
        message = str(error)
        self.totals.last_error = message
        names = [row["name"] for row in self.snapshot.get("devices", []) if row.get("role") == "agent"]
        for name in names:
            if name in message or name.split("#")[0] in message:
                self.agent_errors[name] = message
        if not self.agent_errors and names:
            self.agent_errors.update({name: message for name in names})
        log.error("cluster down: %s", message)
        self._publish(state="down")
        self._teardown()

    def _rebuild(self) -> None:
        log.info("rebuilding the cluster")
        self._build()
        self.totals.rebuilds += 1
        log.info("cluster rebuilt (%d rebuilds so far)", self.totals.rebuilds)

    def _ping(self) -> None:
        """Whether the cluster is there: rebuilt where it is down, else kept if it answers a reset (also after a request
        failed for a reason of its own) and taken down if it does not, whatever the reset raised."""
        try:
            if self.model is None:
                self._rebuild()
            else:
                self.model.reset()
                self._publish()
        except Exception as e:  # noqa: BLE001 - a cluster that cannot reset is not usable, whatever the cause
            if self.model is not None:
                log.warning("the cluster did not answer a reset: %s", e)
                self._down(e)
            else:
                self.totals.last_error = str(e)
                self._publish(state="down")

    def _serve(self, job: Job) -> None:
        if not self._can_run(job):
            return
        run = _Run(self, job)
        try:
            result = generate(self.model, self.tokenizer, job.request.prompt, job.request.max_tokens,
                              job.request.sampling, on_text=run.on_text, cancelled=run.cancelled,
                              speculation=self.speculation, drafter=self.drafter)
            finish = "stop" if result.stop_reason == "eos" else "length"
        except GenerationCancelled as e:
            result = e.result
            if not run.scanner.stopped:
                self._cancelled(job, result)
                return
            finish = "stop"
        except ConfigError as e:  # the prompt does not fit, ...
            self.totals.requests["error"] += 1
            job.put("error", BadRequest(str(e), "invalid_request"))
            return
        except HaloError as e:  # an agent failed: AgentError and what the transport raises
            self.totals.requests["error"] += 1
            self._down(e)
            job.put("error", ClusterUnavailable(f"the cluster failed during this request: {e}", "cluster_failed"))
            return
        except Exception as e:  # noqa: BLE001 - a bug must not kill the server
            log.exception("generation failed")
            self.totals.requests["error"] += 1
            job.put("error", ServeError(f"internal error: {type(e).__name__}: {e}", "internal_error"))
            # the request failed, not necessarily the cluster (a sampler's error once tore it down and reloaded every
            # agent): it stays if its devices answer a reset, and goes down only if they do not
            self._ping()
            return
        self._finish(job, run, result, finish)

    def _can_run(self, job: Job) -> bool:
        """Whether the job may run now: not cancelled, not timed out in the queue, a cluster to run on."""
        if job.cancel_reason:
            return False
        if time.monotonic() > job.deadline:
            self.totals.requests["timeout"] += 1
            job.put("error", RequestTimeout(f"the request waited longer than --request-timeout "
                                            f"({self.request_timeout_s:g} s) in the queue", "timeout"))
            return False
        if self.model is None:
            try:
                self._rebuild()
            except HaloError as e:
                self.totals.requests["error"] += 1
                self.totals.last_error = str(e)
                job.put("error", ClusterUnavailable(f"the cluster is down and could not be rebuilt: {e}",
                                                    "cluster_unavailable"))
                return False
        return True

    def _cancelled(self, job: Job, result) -> None:
        if job.cancel_reason:
            self.totals.requests["cancelled"] += 1
            job.put("error", Cancelled(job.cancel_reason))
            log.info("request cancelled (%s) after %d tokens", job.cancel_reason, len(result.token_ids))
        else:
            self.totals.requests["timeout"] += 1
            job.put("error", RequestTimeout(f"the request ran longer than --request-timeout "
                                            f"({self.request_timeout_s:g} s)", "timeout"))

    def _finish(self, job: Job, run: "_Run", result, finish: str) -> None:
        tail = run.scanner.flush()
        if tail:
            run.emitted.append(tail)
            job.put("text", tail)
        outcome = Outcome("".join(run.emitted), finish, len(result.prompt_ids), len(result.token_ids),
                          result.prefill_ms, result.ms_per_token)
        t = self.totals
        t.requests["completed"] += 1
        t.prompt_tokens += outcome.prompt_tokens
        t.completion_tokens += outcome.completion_tokens
        t.last_rounds_per_token = getattr(self.model, "rounds_per_pass", None)
        if result.speculation is not None:
            if result.speculation.rounds_per_token is not None:
                t.last_rounds_per_token = result.speculation.rounds_per_token
            t.speculative_drafted_tokens += result.speculation.drafted
            t.speculative_accepted_tokens += result.speculation.accepted
            t.speculative_passes += result.speculation.passes
        if result.decode_ms:
            t.last_ms_per_token = result.ms_per_token
            t.last_tokens_per_s = 1e3 / result.ms_per_token if result.ms_per_token else 0.0
        if run.base is not None:
            self._publish(live=run.live(), final=True)
        if self.on_generation is not None:
            ttft = job.first_text_at - job.arrived if job.first_text_at is not None else None
            self.on_generation(outcome, result.decode_ms, ttft)
        job.put("done", outcome)

    def _publish(self, state: str | None = None, live=None, final: bool = False) -> None:
        """A new snapshot (engine thread only: it reads the model)."""
        if state is None:
            state = "down" if self.model is None else ("generating" if self._running is not None else "idle")
        self.snapshot = view.build_snapshot(self, state, live, final, previous=self.snapshot)


class _Run:
    """One generation's callbacks: stop strings, streamed text, cancellation, live view updates."""

    def __init__(self, engine: Engine, job: Job):
        self.engine, self.job = engine, job
        self.scanner = StopScanner(job.request.stop)
        self.emitted: list[str] = []
        self.forwards = 0
        self.base = None  # device counters once the prefill is done
        self.base_time = 0.0
        self.last_publish = time.monotonic()

    def live(self):
        return self.base, self.forwards - 1, time.perf_counter() - self.base_time

    def on_text(self, piece: str) -> None:
        out = self.scanner.feed(piece)
        if out:
            if self.job.first_text_at is None:
                self.job.first_text_at = time.monotonic()
            self.emitted.append(out)
            self.job.put("text", out)
        if time.monotonic() - self.last_publish > SNAPSHOT_EVERY_S and self.base is not None:
            self.last_publish = time.monotonic()
            self.engine._publish(live=self.live())

    def cancelled(self) -> bool:
        """Asked before every forward pass: the first is the prefill."""
        self.forwards += 1
        if self.forwards == 2:
            self.base, self.base_time = view.counters(self.engine.model), time.perf_counter()
        job = self.job
        return self.scanner.stopped or job.cancel_reason is not None or time.monotonic() > job.deadline
