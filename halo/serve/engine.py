"""The serving engine: one thread owns the model and runs every generation, batched.

The model keeps a KV cache per slot (--slots; on every device of a cluster). A request takes a free slot at the next
forward pass and from then on every pass carries its rows with everyone else's (continuous batching: batching.py);
it gives the slot back when it ends. Requests without a slot wait in a FIFO bounded by `max_queue` (QueueFull, HTTP
429 with Retry-After, beyond it). Each request has a deadline counted from its arrival (queue time included); its rows
leave the batch at the next pass once its client has gone, the deadline has passed or a stop string appeared, so its
slot is free one pass later and the agents get nothing more for it. One slot, a model without batched passes (a
pipeline) or --speculate (its passes verify one request's drafts) runs one generation at a time
(`generate(cancelled=...)`).

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

from halo.compute.batch import RowsError
from halo.errors import ConfigError, HaloError
from halo.generation.generate import Continuation, GenerationCancelled, encode_prompt, generate, prefill_chunk
from halo.generation.sampling import Sampler, SamplingSettings
from halo.generation.speculative import SpeculationSettings
from halo.serve import view
from halo.serve.batching import Running, next_pass, take_pass
from halo.serve.protocol import BadRequest, ClusterUnavailable, QueueFull, RequestTimeout, ServeError

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
    outbox: "Outbox | None" = None  # batched: events go out once a pass, all jobs' together

    def put(self, kind: str, value) -> None:
        if self.outbox is not None:
            self.outbox.items.append((self, kind, value))
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


@dataclass
class Outbox:
    """A batched pass's events of every job, handed to the event loop in one call: a call per token woke the loop
    (and took the GIL from the engine thread, mid-round) sixteen times a pass."""

    items: list = field(default_factory=list)

    def flush(self) -> None:
        items, self.items = self.items, []
        by_loop: dict = {}
        for job, kind, value in items:
            by_loop.setdefault(job.loop, []).append((job, kind, value))
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the event loop is closed: the server is shutting down
                pass


def _deliver(events: list) -> None:
    for job, kind, value in events:
        job.events.put_nowait((kind, value))


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
        self.on_tokens: Callable[[int, int], None] | None = None  # (prompt, completion) of an unfinished request
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
        self._running: Job | None = None  # one generation at a time: the job running
        self.slots = 1  # KV-cache slots of the model (batched: requests running at once), known once it is built
        self.batched = False  # whether requests share forward passes (slots, batched passes, no --speculate)
        self._active = 0  # batched: requests holding a slot
        self._window: list | None = None  # batched: [device counters, tokens, start] since the batch began yielding
        self._view_stale, self._published_at = False, 0.0  # batched: a request came or went since the last snapshot
        self._outbox = Outbox()
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
            if self._closing:
                raise _shutting_down()
            # waiting requests beyond the slots about to free up wait in the queue: at most max_queue of them
            free = max(0, self.slots - self._active) if self.batched else int(self._running is None)
            if self._waiting >= self.max_queue + free:
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
        return {"waiting": self._waiting, "limit": self.max_queue, "running": self._running is not None or self._active > 0,
                "slots": self.slots, "slots_busy": self._active if self.batched else int(self._running is not None)}

    def close(self) -> None:
        """Stop serving: requests still waiting, and one generation running alone, end now with a 503 "the server is
        shutting down" (a batch's requests at its next pass), so their clients hear why rather than lose the
        connection; then the engine thread ends and the cluster with it."""
        self._closing = True  # a generation running stops at its next pass (_Run.cancelled); one taken from the
        # queue meanwhile is refused (_can_run); the batch ends at its next pass (_pass_after_pass)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                if job is None or job.state != "waiting":
                    continue
                job.state = "done"
                self._waiting -= 1
                self.totals.requests["error"] += 1
            job.put("error", _shutting_down())
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
        if self.batched:
            try:
                self._batches()
            finally:
                self._outbox.flush()
                self._teardown()
            return
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
        self.slots = getattr(self.model, "slots", 1)
        self.batched = self.slots > 1 and hasattr(self.model, "forward_rows") and not self.speculation.enabled
        self.pass_rows = prefill_chunk(self.weights.config.dim)  # what a round carries at once (generate.prefill)
        if self.batched and self.slots > self.pass_rows:  # a pass's decode rows alone
            self._teardown()
            raise ConfigError(f"--slots {self.slots}: a pass of that many rows of this model's width ({self.weights.config.dim}) "
                              f"is more than a round carries at once; use --slots {self.pass_rows} or fewer")
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
                              speculation=self.speculation, drafter=self.drafter,
                              stopped=lambda: run.scanner.stopped)  # (within a speculative pass too)
            finish = "stop" if result.stop_reason == "eos" or run.scanner.stopped else "length"  # (a stop string
        except GenerationCancelled as e:  # completed by the last token allowed: no cancel came after it, still "stop")
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
        """Whether the job may run now: the server not closing, not cancelled, not timed out in the queue, a cluster
        to run on."""
        if self._closing:  # taken from the queue as close() drained it
            self.totals.requests["error"] += 1
            job.put("error", _shutting_down())
            return False
        if job.cancel_reason:  # (cancelled between leaving the queue and now: its client still hears why)
            self.totals.requests["cancelled"] += 1
            job.put("error", Cancelled(job.cancel_reason))
            return False
        if time.monotonic() > job.deadline:
            self.totals.requests["timeout"] += 1
            job.put("error", RequestTimeout(f"the request waited longer than --request-timeout "
                                            f"({self.request_timeout_s:g} s) in the queue", "timeout"))
            return False
        if self.model is None:
            try:
                self._rebuild()
            except Exception as e:  # noqa: BLE001 - whatever opening the model raised, the request hears it
                self.totals.requests["error"] += 1
                self.totals.last_error = str(e)
                job.put("error", ClusterUnavailable(f"the cluster is down and could not be rebuilt: {e}",
                                                    "cluster_unavailable"))
                return False
        return True

    def _count_unfinished(self, result) -> None:
        """The tokens of a request that ended before completing (cancelled, timed out, failed): processed all the
        same (halo_generated_tokens_total counted completed requests alone, and read 0 under a load of timeouts)."""
        if self.on_tokens is not None:
            self.on_tokens(len(result.prompt_ids), len(result.token_ids))

    def _cancelled(self, job: Job, result) -> None:
        self._count_unfinished(result)
        if self._closing:
            self.totals.requests["error"] += 1
            job.put("error", _shutting_down())
        elif job.cancel_reason:
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

    # ---- batched generations ----------------------------------------------------------------------------------------
    def _batches(self) -> None:
        """Run every admitted request's rows together, pass after pass; admit waiting requests as slots free up."""
        running: list[Running] = []
        try:
            self._pass_after_pass(running)
        finally:  # the server is closing: what still runs ends with an error, not silence
            for member in running:
                job, _ = member.owner
                self.totals.requests["error"] += 1
                job.put("error", _shutting_down())

    def _pass_after_pass(self, running: list[Running]) -> None:
        while not self._closing:
            self._outbox.flush()
            self._refresh_view(running)
            if not self._admit(running):
                break
            self._leave(running)
            step = next_pass(running, self.pass_rows)
            if step is None:
                continue
            try:
                logits = self.model.forward_rows(step.tokens, step.rows)
                ended = take_pass(step, logits)
            except Exception as e:  # noqa: BLE001 - every running request fails; the server goes on
                self._fail_all(running, e)
                continue
            self._count_pass(step)
            for member in ended:
                self._end(running, member)

    def _refresh_view(self, running: list[Running]) -> None:
        """A new snapshot at most once a pass: final when the batch has run dry (its requests ended, stopped, were
        cancelled), else when a request came or went or SNAPSHOT_EVERY_S has passed."""
        if not running and self._window is not None:
            self._publish(final=True)
            self._window = None
        elif self._view_stale or time.monotonic() - self._published_at > SNAPSHOT_EVERY_S:
            self._publish()
        else:
            return
        self._view_stale, self._published_at = False, time.monotonic()

    def _count_pass(self, step) -> None:
        """The view's per-token figures: per token chosen since the first pass that chose one (a lone request: its
        decode steps, as one generation at a time counts them; a batch: every request's tokens)."""
        tokens = sum(1 for m in step.members if not m.prefilling)
        if self._window is not None:
            self._window[1] += tokens
        elif tokens:
            self._window = [view.counters(self.model), 0, time.perf_counter()]

    def _admit(self, running: list[Running]) -> bool:
        """Waiting requests into free slots (waiting for one, and pinging the cluster meanwhile, when nothing runs);
        False once the engine closes."""
        while len(running) < self.slots:
            idle = not running
            self._outbox.flush()
            if idle:
                self._refresh_view(running)  # before waiting: what ended shows now, not at the next request
            try:
                job = self._queue.get(timeout=self.ping_interval_s) if idle else self._queue.get_nowait()
            except queue.Empty:
                if idle:
                    self._ping()
                    continue
                return True
            if job is None:
                return False
            with self._lock:
                if job.state != "waiting":
                    continue  # cancelled while it waited
                job.state = "running"
                self._waiting -= 1
                self._active += 1
                job.outbox = self._outbox
            member = self._start(job, {r.slot for r in running})
            if member is None:
                self._release(job)
            else:
                running.append(member)
        return True

    def _start(self, job: Job, taken: set[int]) -> Running | None:
        """A request's place in the batch (None: it ended before it began: cancelled, timed out, a prompt that does not
        fit, no cluster)."""
        if not self._can_run(job):
            return None
        try:
            prompt_ids = encode_prompt(self.tokenizer, job.request.prompt, self.max_seq_len)
            run = _Run(self, job)
            going = Continuation(self.tokenizer, prompt_ids, job.request.max_tokens, self.max_seq_len, run.on_text)
        except ConfigError as e:
            self.totals.requests["error"] += 1
            job.put("error", BadRequest(str(e), "invalid_request"))
            return None
        except Exception as e:  # noqa: BLE001 - a request's own failure (its tokenization): it alone ends
            self._own_error(job, e)
            return None
        slot = min(set(range(self.slots)) - taken)
        return Running(slot, prompt_ids, going, Sampler(job.request.sampling), (job, run))

    def _leave(self, running: list[Running]) -> None:
        """Requests whose stop string appeared end; those whose client left or whose deadline passed are cancelled."""
        for member in list(running):
            job, run = member.owner
            if run.scanner.stopped:
                self._end(running, member)
            elif job.cancel_reason is not None or time.monotonic() > job.deadline:
                self._leaves(running, member)
                self._cancelled(job, member.going.result)
                self._release(job)

    def _end(self, running: list[Running], member: Running) -> None:
        job, run = member.owner
        self._leaves(running, member)
        try:
            if member.error is not None:
                raise member.error
            result = member.going.finish()
            result.prefill_ms, result.decode_ms = member.prefill_ms, member.decode_ms
            finish = "stop" if result.stop_reason == "eos" or run.scanner.stopped else "length"
            self._finish(job, run, result, finish)
        except Exception as e:  # noqa: BLE001 - a request's own failure (its sampler, its text): it alone ends
            self._own_error(job, e)
        self._release(job)

    def _leaves(self, running: list[Running], member: Running) -> None:
        """A request out of the batch; a master that keeps every slot's history (to replay it after a re-plan)
        forgets its slot's."""
        running.remove(member)
        release = getattr(self.model, "release_slot", None)
        if release is not None:
            release(member.slot)

    def _own_error(self, job: Job, error: Exception) -> None:
        log.error("a request failed: %s", error, exc_info=error)
        self.totals.requests["error"] += 1
        job.put("error", ServeError(f"internal error: {type(error).__name__}: {error}", "internal_error"))

    def _release(self, job: Job) -> None:
        """A request leaves its slot (or never took one): the view shows it by the next pass."""
        with self._lock:
            job.state = "done"
            self._active -= 1
        self._view_stale = True

    def _fail_all(self, running: list[Running], error: Exception) -> None:
        """A pass failed: every running request with it (an agent failure takes the cluster down, to be rebuilt)."""
        if isinstance(error, HaloError) and not isinstance(error, (ConfigError, RowsError)):
            self._down(error)
            reply = ClusterUnavailable(f"the cluster failed during this request: {error}", "cluster_failed")
        else:
            log.exception("a batched pass failed", exc_info=error)
            reply = ServeError(f"internal error: {type(error).__name__}: {error}", "internal_error")
        self._window = None
        for member in running:
            job, _ = member.owner
            self._count_unfinished(member.going.result)
            self.totals.requests["error"] += 1
            job.put("error", reply)
            self._release(job)
        running.clear()
        if not isinstance(reply, ClusterUnavailable):
            self._ping()  # the cluster stays if its devices answer a reset

    def _publish(self, state: str | None = None, live=None, final: bool = False) -> None:
        """A new snapshot (engine thread only: it reads the model)."""
        if live is None and self._window is not None and self.model is not None:
            live = (self._window[0], self._window[1], time.perf_counter() - self._window[2])
        if state is None:
            busy = self._running is not None or self._active > 0
            state = "down" if self.model is None else ("generating" if busy else "idle")
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
        return (self.scanner.stopped or job.cancel_reason is not None or time.monotonic() > job.deadline
                or self.engine._closing)


def _shutting_down() -> ClusterUnavailable:
    return ClusterUnavailable("the server is shutting down", "shutting_down")
