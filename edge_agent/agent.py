"""halo-agent: holds its neuron groups of a model and computes their partial outputs on request.

Life of an agent: listen (a CURVE server with the cluster key, or plaintext when told so) -> a master
says hello (protocol version, model sha256, the groups this agent computes, sync settings, where its
UDP endpoint is) -> the agent builds a device worker with only those groups from its local copy of
the model (rows and columns sliced out of a memory map: the other weights are never read), in a thread
of its own: meanwhile it tells the master how far it got ("loading" every LOADING_REPORT_S, which is
what keeps a slow load from being taken for a dead agent) and answers status ("loading 43 %"), and
it says "ready" when the share is built -> rounds
(edge_agent/rounds.py): block inputs arrive as residual streams over the control connection or UDP,
partial outputs go back -> bye, or the master disappears -> back to listening. Every message is
validated; a bad one is answered with an error and logged, never crashes the agent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from halo.compute.batch import Rows
from halo.compute.group_cache import minimum_capacity
from halo.compute.linear import FORMATS, resolve_format
from halo.compute.neuron_groups import GroupLayout
from halo.compute.shares import Block, Shares, share_memory
from halo.compute.worker import DeviceWorker
from halo.errors import HaloError
from halo.generation.generate import largest_pass_vector_bytes
from halo.host.memory import memory_limit, read_mapped_files_at_random
from halo.runtime.measure import MEMORY_SHARE, default_memory_budget
from halo.sync import Status, SyncSettings, Transport, ranks_next_layer_itself
from halo.transport import wire
from halo.transport.control import ControlError, Hello, ProfileRequest, Ready, UdpSession
from halo.transport.reliable import ClusterKey, Message, udp_base_key
from halo.transport.udp import BUSY_POLL_S, PARTIALS_KEPT, kept_bytes, spin_readable

from halo.edge_agent.daemon import ControlServer
from halo.edge_agent.rounds import MASTER, AgentRounds

log = logging.getLogger("halo.agent")
ABANDONED_STOP_S = 5.0  # how long a hello waits for an abandoned build to stop (it does at its next block)
IDLE_SESSION_S = 60.0  # a session with no message for this long is over (the master is gone)
RETAIN_S = 30.0  # an ended session's shards wait this long for the next hello, which keeps those whose groups stay
BUSY_WINDOW_S = 0.05  # busy polling spins while the last UDP round is at most this old (a decode is running)
LOADING_REPORT_S = 1.0  # while a share loads, the master hears how far it got this often


class LoadAbandoned(Exception):
    """Raised in a build thread whose master said bye (or whose agent recovered): the build stops at its next block."""


@dataclass
class Loading:
    """A hello being served: its share builds in a thread; the control loop reports and finishes it."""

    master: str
    peer: bytes
    hello: Hello
    address: str | None
    sync: SyncSettings
    node_id: int
    started: float = field(default_factory=time.perf_counter)
    done: int = 0  # blocks built (written by the build thread)
    total: int = 0
    worker: DeviceWorker | None = None
    error: str | None = None
    reported: float = field(init=False)  # when the master last heard of it (a share built within LOADING_REPORT_S
    # of the hello goes without reports)
    thread: threading.Thread | None = None
    abandoned: bool = False  # its master said bye before it was ready

    def __post_init__(self):
        self.reported = self.started

    def progress(self, done: int, total: int) -> None:
        """Called by the build after each block: where it is, and the end of a build its master abandoned."""
        if self.abandoned:
            raise LoadAbandoned
        self.done, self.total = done, total

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0

    def to_json(self) -> dict:
        return {"master": self.master, "blocks_done": self.done, "blocks": self.total,
                "percent": round(100 * self.fraction, 1), "seconds": round(time.perf_counter() - self.started, 2)}


@dataclass
class Session:
    master: str  # its name, for messages
    peer: bytes  # its ZeroMQ identity: only it may use the session
    worker: DeviceWorker
    rounds: AgentRounds
    sync: SyncSettings
    last_seen: float


def _storage_reads() -> dict:
    """Bytes this process had read from storage (page cache misses included) and its major page faults so far: what
    a device short of memory pays for re-reading its model (Linux; empty elsewhere)."""
    try:
        io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
        faults = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[9])
    except (OSError, ValueError, IndexError):
        return {}
    return {"storage_read_bytes": int(io["read_bytes"]), "major_faults": faults}


class Agent(ControlServer):
    def __init__(self, model_path: str | None, listen: str, key: ClusterKey | None, insecure: bool = False,
                 name: str = "agent", only_format: str | None = None, threads: int = 1, predictors: str | None = None,
                 memory_budget: int | None = None, busy_poll: str = "auto", masters=None):
        """memory_budget: bytes a session's weights and KV cache may take (None: MEMORY_SHARE of what is available
        at start); a hello whose share needs more is refused with the numbers. busy_poll: whether waits for the next
        UDP round spin before they sleep (transport/udp/base.py set_busy_poll: auto = where this process has dedicated
        cores). masters: the authorized masters' keys (daemon.py). only_format: the one weight format this agent
        serves (the master picks the cluster's; a hello in another is refused, naming it); None: any."""
        from halo.transport.udp import UdpEndpoint, set_busy_poll

        from halo.edge_agent.profile import device_profile

        super().__init__(model_path, listen, key, insecure, name, masters)
        self.only_format, self.threads = only_format, threads
        self.memory_budget = default_memory_budget() if memory_budget is None else memory_budget
        self.session: Session | None = None
        self.dropped_idle = b""  # the master whose session ended for silence (told so if it comes back)
        self.displaced = (b"", "", 0.0)  # (the master whose live session another took over, by whom, when)
        self.retired: tuple[DeviceWorker, float] | None = None  # the last session's worker, while RETAIN_S runs
        # a UDP endpoint beside the control socket: link probes, and the UDP rounds of the relaxed modes
        host = self.endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
        self.udp_key = udp_base_key(key)  # each session's datagram key derives from it
        self.udp = UdpEndpoint(self.udp_key, 0, 255, bind=(host if host != "*" else "0.0.0.0", 0))
        self.udp.vectors_kept = PARTIALS_KEPT
        self.profile = device_profile()
        self.busy_poll = set_busy_poll(busy_poll)
        self._last_round = 0.0  # when a UDP round was last served (busy polling spins only while they come)
        # what it did, cumulative: blocks and their compute, time gathering UDP inputs, sending partials, predicting
        self.served = {"sessions": 0, "blocks": 0, "compute_ms": 0.0, "input_wait_ms": 0.0, "send_ms": 0.0,
                       "predict_ms": 0.0, "refused": 0, "errors": 0, "broadcasts_incomplete": 0, "partials_resent": 0,
                       "rankings_overridden": 0}
        self.predictors_dir = predictors
        self._predictor_set = None
        self._predictors_bytes = 0  # what loading the predictors made this process grow by (HALO mode)
        self._said_unprepared: set[str] = set()
        self.loading: Loading | None = None  # a hello whose share is being built
        self._wake = os.pipe()  # the loading thread's "done", which wakes the control loop's poll
        os.set_blocking(self._wake[0], False)

    def poll_sources(self) -> list:
        return [self.udp.sock.fileno(), self._wake[0]]

    def wait(self, poller) -> dict:
        """While UDP rounds are coming (one served within BUSY_WINDOW_S) and busy polling is on, spin on their socket
        first: the next round's input is usually a compute step away, and a sleeping core wakes tens of microseconds
        late. Otherwise, or once the spin found nothing, the usual poll."""
        rounds_coming = self.busy_poll and time.monotonic() - self._last_round < BUSY_WINDOW_S
        if rounds_coming and spin_readable(self.udp.sock, BUSY_POLL_S):
            return dict(poller.poll(0))
        return super().wait(poller)

    def tick(self, events: dict) -> None:
        if self._wake[0] in events:
            os.read(self._wake[0], 4096)
        if self.udp.sock.fileno() in events:
            if self.session is not None and self.session.sync.policy.input is Transport.UDP:
                if self.session.rounds.poll():  # UDP rounds carry no control message: they keep it alive
                    self.session.last_seen = self._last_round = time.monotonic()
            else:
                self.udp.serve(0)  # answer link probes and NACKs for partials sent over UDP
        # every tick, datagrams or not: anyone can send datagrams (refused, but readable), and a check that waited for
        # a quiet socket let one datagram every 200 ms keep a dead master's session and its memory for good
        if self.session and time.monotonic() - self.session.last_seen > IDLE_SESSION_S:
            log.warning("session with %s idle for %.0f s: dropped", self.session.master, IDLE_SESSION_S)
            self.dropped_idle = self.session.peer
            self._end_session()
        if self.retired is not None and time.monotonic() - self.retired[1] > RETAIN_S:
            self.retired = None  # its memory goes back: no re-plan came
        if self.loading is not None:
            self._tend_loading()

    def count_error(self) -> None:
        self.served["errors"] += 1

    def recover(self) -> None:
        self.count_error()
        if self.loading is not None:
            self.loading.abandoned = True  # as after a bye: closed once its thread is done
        self._end_session()

    def _take_over(self, peer: bytes, master: str) -> None:
        """A master other than the live session's takes this agent: the old one is told so at its next message."""
        if self.session is not None and peer != self.session.peer:
            log.warning("master %s takes this agent over from %s", master[:64], self.session.master[:64])
            self.displaced = (self.session.peer, master[:64], time.monotonic())

    def _end_session(self, retain: bool = False) -> None:
        """retain: keep the worker's shards for RETAIN_S (a master that re-plans says bye, then hello)."""
        if self.session is not None:
            worker = self.session.worker
            if retain and worker.remapper is None:
                self.retired = (worker, time.monotonic())
            else:
                worker.close()
            rejected = self.udp.rejections()
            if rejected:
                log.warning("session with %s: datagrams refused, by reason: %s", self.session.master,
                            ", ".join(f"{reason} {count}" for reason, count in rejected.items()))
        self.session = None
        self.udp.send_hook = None
        self.udp.peers.clear()

    def close(self) -> None:
        if self.loading is not None:
            self.loading.thread.join()  # a build in flight ends before the memory it builds into goes
            self.loading = None
        self._end_session()
        self.retired = None
        self.udp.close()
        for fd in self._wake:
            os.close(fd)
        super().close()

    # ---- messages ----------------------------------------------------------------------------------------
    def handle(self, message: Message, peer: bytes = b"", address: str | None = None) -> Message | None:
        """A control message from `peer` (its ZeroMQ identity), connected from IP `address`."""
        if message.kind == "status":  # anyone holding the key may ask; it changes nothing
            return Message("status", self.status())
        if message.kind == "hello":  # a new master replaces the old session (the old one is gone or done)
            return self._hello(message.fields, peer, address)
        if message.kind == "profile":  # what this device can do, asked before the master plans
            return self._profile(message.fields, peer, address)
        if self.loading is not None and peer == self.loading.peer:
            if message.kind == "bye":  # the master gave up on this hello: what is built goes once the thread ends
                self.loading.abandoned = True
                return Message("ok")
            return Message("error", {"reason": f"'{message.kind}' before this agent said ready: it is still loading "
                                               f"its share ({100 * self.loading.fraction:.0f} %)"})
        if peer == self.displaced[0] and (self.session is None or peer != self.session.peer):
            return Message("error", {"reason": f"master {self.displaced[1]} took this agent over "
                                               f"{time.monotonic() - self.displaced[2]:.0f} s ago: this session is over "
                                               "(two masters cannot share an agent)"})
        if self.session is None:
            if peer == self.dropped_idle:
                return Message("error", {"reason": f"this agent ended the session after {IDLE_SESSION_S:.0f} s without "
                                                   "a message from the master; connect again (a new hello)"})
            return Message("error", {"reason": f"'{message.kind}' before hello: no session"})
        if peer != self.session.peer:
            return Message("error", {"reason": "not in session with this agent (another master said hello since)"})
        self.session.last_seen = time.monotonic()
        if message.kind == "block":
            return self._block(message)
        if message.kind == "reset":
            self.session.rounds.reset()
            return Message("ok")
        if message.kind == "fill":
            return self._fill(message)
        if message.kind == "bye":  # retain: a re-plan follows, whose hello keeps the shards whose groups stay
            log.info("session with %s ended", self.session.master)
            self._end_session(retain=message.fields.get("retain") is True)
            return Message("ok")
        return Message("error", {"reason": f"unknown message kind {message.kind!r}"})

    def status(self) -> dict:
        session = None
        if self.session is not None:
            w = self.session.worker
            session = {"master": self.session.master, "attention_layers": sorted(w.attention),
                       "mlp_layers": sorted(l for l, g in enumerate(w.share.mlp) if g),
                       "lm_head": w.lm_head is not None, "heads": sum(map(len, w.share.attention)),
                       "mlp_groups": sum(map(len, w.share.mlp)), "sync": self.session.sync.mode,
                       "idle_s": round(time.monotonic() - self.session.last_seen, 1)}
            if self.session.sync.policy.uses_udp:
                session["udp"] = self.udp.stats[MASTER].to_json()
                session["udp_gso"] = self.udp.segmenting
            session["rejected"] = self.udp.rejections()
            session["estimates"] = self.session.rounds.times.to_json()
        return {"name": self.name, "model": self.weights.source, "profile": self.profile, "session": session,
                "loading": self.loading.to_json() if self.loading is not None else None, "memory": self._memory(),
                "served": {**self.served, "refused_handshakes": self.refused_handshakes}, "udp_port": self.udp.address[1],
                "threads": self.threads, "busy_poll": self.busy_poll, "insecure": self.insecure}

    def _memory(self) -> dict:
        """The budget, and what this agent holds against it: weights, KV cache, a retired session's kernels."""
        import psutil

        worker = self.session.worker if self.session is not None else None
        memory = {"budget_bytes": self.memory_budget, "weights_bytes": worker.nbytes if worker else 0,
                  "kv_cache_bytes": sum(s.cache_nbytes for s in worker.attention.values()) if worker else 0,
                  "retained_bytes": self.retired[0].nbytes if self.retired else 0,
                  "rss_bytes": psutil.Process().memory_info().rss, "predictors_bytes": self._predictors_bytes,
                  **_storage_reads()}
        if worker is not None and worker.remapper is not None:
            memory.update(worker.remapper.report())  # HALO mode: loading, and the built groups it keeps (group_cache)
        return memory

    def _hello(self, f: dict, peer: bytes, address: str | None) -> Message:
        def refuse(reason: str) -> Message:
            self.served["refused"] += 1
            log.warning("refused master %s: %s", str(f.get("master", "?"))[:64], reason)
            return Message("refused", {"reason": reason})

        try:
            hello = Hello.from_fields(f)
        except ControlError as e:
            return refuse(f"bad hello: {e}")
        mismatch = self._mismatch(hello.model_sha256)
        if mismatch:
            return refuse(mismatch)
        if self.loading is not None and self.loading.abandoned:
            # a build its master gave up on stops at its next block: wait for that (it refused every hello until the
            # whole share was built, and a master re-planning after its bye planned without this agent)
            self.loading.thread.join(ABANDONED_STOP_S)
            if not self.loading.thread.is_alive():
                self._tend_loading()
        if self.loading is not None:
            return refuse(f"busy: loading a share for master {self.loading.master} "
                          f"({100 * self.loading.fraction:.0f} %); say hello again when it is ready")
        try:
            build, sync = self._worker_for(hello)
        except HaloError as e:
            return refuse(str(e))
        except (KeyError, TypeError, ValueError) as e:
            return refuse(f"bad hello: {e}")
        self._take_over(peer, hello.master)
        self._end_session(retain=True)  # a new master replaces the old session now; its kernels wait for the build
        loading = Loading(hello.master, peer, hello, address, sync, hello.node_id)

        def run() -> None:
            try:
                loading.worker = build(loading.progress)
            except LoadAbandoned:
                pass
            except HaloError as e:
                loading.error = str(e)
            except Exception as e:  # a bug must not leave the master waiting: it hears why
                log.exception("building the share failed")
                loading.error = f"{self.name} error while loading its share: {type(e).__name__}: {e}"
            finally:
                os.write(self._wake[1], b"!")  # the control loop finishes the hello at once, not at its next poll

        loading.thread = threading.Thread(target=run, name="halo-load", daemon=True)
        self.loading = loading
        loading.thread.start()
        return None  # the answer ("loading" reports, then "ready" or "refused") comes from the control loop

    def _tend_loading(self) -> None:
        """Between polls: report the loading to its master, or finish it once its thread is done."""
        loading = self.loading
        if loading.thread.is_alive():
            if time.perf_counter() - loading.reported >= LOADING_REPORT_S:
                loading.reported = time.perf_counter()
                self.reply(loading.peer, Message("loading", loading.to_json()))
            return
        self.loading = None
        if loading.abandoned:  # its master said bye while it loaded
            if loading.worker is not None:
                loading.worker.close()
            self.retired = None
            return
        if loading.worker is None:
            self.served["refused"] += 1
            log.warning("refused master %s: %s", loading.master, loading.error)
            self.reply(loading.peer, Message("refused", {"reason": loading.error}))
            return
        worker = loading.worker
        self.retired = None  # what the new worker kept from it is in it; the rest goes
        self._join_udp(loading.hello.udp, loading.sync, loading.node_id, loading.address)
        self.session = Session(loading.master, loading.peer, worker,
                               AgentRounds(worker, loading.sync, self.udp, self.served), loading.sync, time.monotonic())
        log.info("session with %s: %d attention and %d MLP layers, %.1f MB, loaded in %.0f ms (%d groups kept from "
                 "the last session)", self.session.master, len(worker.attention), sum(1 for g in worker.share.mlp if g),
                 worker.nbytes / 1e6, 1e3 * (time.perf_counter() - loading.started), worker.reused_groups)
        self.served["sessions"] += 1
        self.reply(loading.peer, Message("ready", Ready(self.name, worker.nbytes, self.profile, self.udp.address[1],
                                                        worker.reused_groups, worker.loads_ahead,
                                                        worker.slots).to_fields()))

    def _mismatch(self, model_sha256: str) -> str | None:
        """Why a master's hello or profile request cannot be served (None: it can; the fields themselves were checked
        by transport/control.py)."""
        if model_sha256 != self.model_sha256:
            return (f"model mismatch: the master runs sha256 {model_sha256[:12]}..., this agent holds "
                    f"{self.model_sha256[:12]}... ({self.weights.source}): start this agent with the master's model "
                    "(halo-agent --model FILE, or a fetched name such as smollm2-135m-instruct), or the master with "
                    "this agent's")
        return None

    def _format_refusal(self, fmt: str) -> str | None:
        """Why this agent cannot compute in `fmt` (None: it can): asked at the profile request too, before a
        benchmark in a format the hello would then refuse."""
        if fmt not in FORMATS:
            return f"unknown weight format {fmt!r}; this agent computes in {', '.join(FORMATS)}"
        if self.only_format and resolve_format(fmt, self.weights) != resolve_format(self.only_format, self.weights):
            return (f"this agent serves {self.only_format} weights only (its --weights, or weights in its config"
                    f" file) and the master computes in {fmt}: start the master with --weights "
                    f"{self.only_format}, or drop the agent's setting")
        return None

    def _profile(self, f: dict, peer: bytes, address: str | None = None) -> Message:
        """Measure this device for a master about to plan (edge_agent/profile.py), and echo its link probes (to its
        UDP port at the address of its control connection, nowhere else)."""
        from halo.edge_agent.profile import measured_profile

        try:
            request = ProfileRequest.from_fields(f)
        except ControlError as e:
            request, reason = None, f"bad profile request: {e}"
        else:
            reason = self._mismatch(request.model_sha256) or self._format_refusal(request.weights)
        if reason is None and self.loading is not None:
            reason = f"busy: loading a share for master {self.loading.master}; profile it when it is ready"
        if reason is None and self.session is not None and peer != self.session.peer:
            if request.take_over:
                # the asking master says hello next; the old one hears "no session", not "taken over" (a profile
                # need not be followed by a hello)
                self._end_session()
            else:
                idle = time.monotonic() - self.session.last_seen
                reason = (f"busy: serving master {self.session.master} (its last message {idle:.0f} s ago; a session "
                          f"silent for {IDLE_SESSION_S:.0f} s ends, this one in {max(0.0, IDLE_SESSION_S - idle):.0f} s)"
                          ": profile it when it is idle (generate takes it over)")
        try:
            answer = reason or measured_profile(self, request, address)
        except (KeyError, TypeError, ValueError, HaloError) as e:
            answer = f"bad profile request: {e}"
        if isinstance(answer, str):
            self.served["refused"] += 1
            log.warning("refused to profile for master %s: %s", str(f.get("master", "?"))[:64], answer)
            return Message("refused", {"reason": answer})
        return Message("profile", answer)

    def _worker_for(self, hello: Hello) -> tuple:
        """What a hello asks for, checked now (raises HaloError / KeyError / ValueError when it cannot be served):
        build(progress) -> the device worker (run in the loading thread), and the sync settings."""
        c = self.weights.config
        layout = GroupLayout.for_model(c, hello.mlp_group_size, hello.vocab_group_size)
        context, share = hello.context, Shares(**hello.share)
        if len(share.attention) != c.n_layers or len(share.mlp) != c.n_layers or not 0 < context <= c.max_seq_len:
            raise HaloError("the plan does not fit this model (layers or context)")
        for name, groups, count in (("attention", share.attention, layout.n_attention_groups),
                                    ("mlp", share.mlp, layout.n_mlp_groups), ("lm_head", [share.lm_head], layout.n_vocab_groups)):
            for layer, ids in enumerate(groups):
                if any(g >= count for g in ids) or len(set(ids)) != len(ids):
                    raise HaloError(f"the plan's {name} groups {sorted(ids)[-3:]} (layer {layer}) are not distinct "
                                    f"groups of this model's {count}")
        fmt = hello.weights  # the master's choice, so the whole cluster computes alike
        refusal = self._format_refusal(fmt)
        if refusal:
            raise HaloError(refusal)
        sync = SyncSettings.from_json(hello.sync)
        if sync.policy.uses_udp and (hello.udp is None or hello.node_id == 0):
            raise HaloError(f"--sync {sync.mode} runs over UDP, but the hello opens no UDP session (or node id 0)")
        streams = sync.policy.remap and resolve_format(fmt, self.weights) != "fp32"
        self._check_budget(share, layout, context, fmt, hello.slots, streams, sync.policy.remap)
        ranks = sync.policy.remap and sync.predict and any(ranks_next_layer_itself(sync.policy, share.mlp, l)
                                                            for l in range(c.n_layers))
        predictors = self._predictors(layout) if ranks else None  # (over UDP the master's MLP inputs bring its rankings)
        prepared = self._prepared(fmt, layout) if sync.policy.remap else None
        # a new session keeps the previous one's shards whose groups stay here (after a sticky re-plan, most)
        if self.retired and not self.retired[0].compatible(self.weights, layout, context, fmt, self.threads, hello.slots):
            self.retired = None  # nothing of it serves this hello: its memory goes back before the build
        previous = self.session.worker if self.session is not None else self.retired[0] if self.retired else None

        kept = kept_bytes(largest_pass_vector_bytes(c.dim, context, hello.slots), PARTIALS_KEPT)

        def build(progress) -> DeviceWorker:
            self.udp.bytes_kept = kept  # what the budget leaves them (a larger vector alone is kept all the same)
            worker = DeviceWorker(self.weights, layout, share, context, fmt, self.threads, remap=sync.policy.remap,
                                  predictors=predictors, load_overlap=sync.load_overlap, reuse=previous,
                                  progress=progress, memory_budget=self.memory_budget, prepared=prepared,
                                  reserved=kept,
                                  slots=hello.slots)
            if memory_limit() is not None:  # pages of code and model evicted under the limit: no 8 MB read-around
                log.info("under a memory limit: %.0f MB of mapped files read at random", read_mapped_files_at_random() / 1e6)
            return worker

        return build, sync

    def _check_budget(self, share: Shares, layout: GroupLayout, context: int, fmt: str, slots: int,
                      streams: bool = False, remap: bool = False) -> None:
        """Refuse a share whose weights (in the session's format) and KV caches exceed the memory budget. streams: HALO
        mode with compact weights, whose MLP groups the budget bounds (a cache, read again from storage when evicted:
        DeviceWorker), so the share needs only the least such a cache holds, two layers of its ranks. remap without
        streams (HALO mode in float32): every MLP group of its layers is held, any may be ranked its way (the share's
        count alone let an agent take twice its budget)."""
        weights, cache = share_memory(share, layout, self.weights, fmt, context, slots)
        streams = streams and any(share.mlp)
        mlp_only = Shares([[]] * len(share.mlp), share.mlp, [])
        if streams:  # (the worker checks the same: remap.py's minimum_capacity of its largest layer's ranks)
            mlp = share_memory(mlp_only, layout, self.weights, fmt, context, 0)[0]
            per_group = mlp / sum(len(groups) for groups in share.mlp)
            weights -= mlp - minimum_capacity(int(per_group * max(len(groups) for groups in share.mlp)))
        elif remap and any(share.mlp):
            every = Shares([[]] * len(share.mlp), [list(range(layout.n_mlp_groups)) if g else [] for g in share.mlp], [])
            weights += (share_memory(every, layout, self.weights, fmt, context, 0)[0]
                        - share_memory(mlp_only, layout, self.weights, fmt, context, 0)[0])
        if weights + cache > self.memory_budget:
            streamed = (" with two layers of its MLP groups held (HALO mode reads the rest again)" if streams else
                        " with every MLP group of its layers (HALO mode in float32 holds them all; --weights int8 or "
                        "a GGUF's native blocks are read as needed)" if remap and any(share.mlp) else "")
            raise HaloError(f"the share needs {(weights + cache) / 1e6:.1f} MB (weights {weights / 1e6:.1f} MB in {fmt}"
                            f"{streamed}, "
                            f"KV cache {cache / 1e6:.1f} MB for {context} positions x {slots} slot(s)) but this agent's "
                            f"memory budget is {self.memory_budget / 1e6:.1f} MB (halo-agent --memory-budget; default "
                            f"{100 * MEMORY_SHARE:.0f} % of the memory available at start): give this device less work "
                            "(a plan from its measured memory, or a shorter --context, or fewer --slots) or more memory")

    def session_key(self, udp: UdpSession) -> bytes:
        """The key of the session a hello or profile request opens (wire.session_key)."""
        return wire.session_key(self.udp_key, bytes.fromhex(udp.nonce), udp.session)

    def _join_udp(self, udp: UdpSession | None, sync: SyncSettings, node_id: int, address: str | None) -> None:
        """Our UDP identity in the session, its key, and where the master's endpoint is (from the control plane)."""
        if udp is None:
            return
        self.udp.join(udp.session, node_id, self.session_key(udp))
        self.udp.segment, self.udp.whole_vectors = sync.udp_gso, sync.whole_vectors
        if address:
            self.udp.peers[MASTER] = (address, udp.port)
        if sync.inject_plr:
            from halo.transport.loss import LossInjector

            self.udp.send_hook = LossInjector(seed=sync.seed + 1000 * node_id, drop=sync.inject_plr)

    def _prepared(self, fmt: str, layout: GroupLayout):
        """The MLP groups `halo-agent prepare` wrote for this model, format and group size (HALO mode builds re-mapped
        groups from them); None: built from the model file (said once per format)."""
        from halo.compute.prepared import find_prepared

        prepared = find_prepared(self.weights, self.model_sha256, fmt, layout)
        fmt = resolve_format(fmt, self.weights)
        if prepared is None and fmt != "fp32" and fmt not in self._said_unprepared:
            self._said_unprepared.add(fmt)
            log.info("no prepared MLP groups for --weights %s: HALO mode builds them from the model file, and under a "
                     "memory budget converts a group again whenever it reads it again (SmolLM2: ~2x slower tokens); "
                     "once per device: halo-agent prepare --model %s --weights %s", fmt, self.weights.source, fmt)
        return prepared

    def _predictors(self, layout: GroupLayout):
        """The model's predictors, loaded once; what they made this process grow by (their onnxruntime sessions,
        run once: a session allocates at its first run) is reported as `predictors_bytes` (a memory limit for HALO
        mode is sized from the share plus this runtime memory), as the agent's cgroup counts it."""
        if self._predictor_set is None:
            from halo.host.memory import charged_bytes
            from halo.predictors.store import load_predictors

            before = charged_bytes()
            predictors = load_predictors(self.weights, layout, self.predictors_dir)
            for layer in predictors.layers:
                predictors.scores(layer, np.zeros(predictors.dim, np.float32))
            self._predictors_bytes = max(0, charged_bytes() - before)
            self._predictor_set = predictors
        self._predictor_set.check_fits(layout, self.weights.config)  # (a later session may group otherwise)
        return self._predictor_set

    def _fill(self, message: Message) -> Message:
        """A new session's KV caches from the residual stream the master recorded: [layers, T, D] for layers where
        this agent holds heads (the master sends each of them), positions 0..T-1 (instead of a replay)."""
        worker, layers = self.session.worker, message.fields.get("layers")
        x = np.asarray(message.arrays[0], dtype=np.float32) if len(message.arrays) == 1 else None
        if not isinstance(layers, list) or not layers or any(type(l) is not int for l in layers) \
                or not set(layers) <= set(worker.attention) or len(set(layers)) != len(layers):
            return Message("error", {"reason": f"fill names layers {layers!r}; this agent holds heads of layers "
                                               f"{sorted(worker.attention)}"})
        if x is None or x.ndim != 3 or x.shape[0] != len(layers) or x.shape[2] != worker.config.dim \
                or not 0 < x.shape[1] <= worker.context:
            return Message("error", {"reason": f"fill carries {None if x is None else x.shape}, expected [{len(layers)}, "
                                               f"T <= {worker.context}, {worker.config.dim}]"})
        for layer, inputs in zip(layers, x):
            worker.fill(layer, inputs)
        return Message("ok")

    def _block(self, message: Message) -> Message | None:
        """A block over the control connection (reliable and halo-tcp modes)."""
        f, dim = message.fields, self.weights.config.dim
        batched = f.get("start_pos") == -1  # a batched pass: each row's slot and position ride as a second array
        if len(message.arrays) != 1 + batched:
            return Message("error", {"reason": "a block carries its input (and, a batched pass, its rows) as arrays"})
        x = np.asarray(message.arrays[0], dtype=np.float32)
        kind, layer, reply_by = f.get("kind"), f.get("layer"), f.get("reply", "tcp")
        if x.ndim != 2 or x.shape[1] != dim:
            return Message("error", {"reason": f"block input has shape {x.shape}, expected [T, {dim}]"})
        if (kind not in ("attention", "mlp", "lm_head") or not isinstance(layer, int) or reply_by not in ("tcp", "udp", "none")
                or not isinstance(f.get("epoch", 0), int) or not isinstance(f.get("start_pos", 0), int)):
            return Message("error", {"reason": f"bad block header kind={kind!r} layer={layer!r} reply={reply_by!r}"})
        if reply_by == "udp" and MASTER not in self.udp.peers:
            return Message("error", {"reason": "no UDP address of the master (its hello named no UDP port)"})
        epoch, answer, start = int(f.get("epoch", 0)), [], int(f.get("start_pos", 0))
        if batched:
            where = np.asarray(message.arrays[1])
            try:
                if where.shape != (len(x), 2) or where.dtype.kind not in "iu":
                    raise ValueError(f"rows of shape {where.shape} ({where.dtype}) for {len(x)} tokens")
                start = Rows.from_table(where[:, 0].tolist(), where[:, 1].tolist())
            except ValueError as e:
                return Message("error", {"reason": f"a batched block's rows make no sense: {e}"})

        def send(out, status, compute_ms, cpu_ms):
            if status is Status.RANKING_MISMATCH and reply_by != "udp":  # over UDP the partial's status says it
                answer.append(Message("error", {"reason": f"ranking of layer {layer} differs from the master's "
                                                          "(different predictors or onnxruntime build)"}))
            elif reply_by == "tcp":
                answer.append(Message("partial", {"kind": kind, "layer": layer, "compute_ms": compute_ms,
                                                  "cpu_ms": cpu_ms}, [np.asarray(out, dtype=np.float32)]))
            elif reply_by == "udp":
                self.session.rounds.send_partial(epoch, out, status, compute_ms)

        self.session.rounds.run(Block(kind, layer), epoch, x, start, int(f.get("digest", 0)), send)
        return answer[0] if answer else None
