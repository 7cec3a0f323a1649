"""How the coordinator reaches a stage worker: a native worker over the control plane, or a stage it
runs itself. The browser worker's link lives in halo/pipeline/browser.py. Every link has the same
methods: probe() -> profile fields, open(start, stop, context, fmt) -> ready fields, forward(inputs,
start_pos, head) -> arrays, reset(), close(); a worker that is gone raises `StageFailed`, one that
refuses raises `StageRefused` (re-planning cannot fix a refusal, it can replace a lost worker)."""

from __future__ import annotations

import os
import time

import numpy as np

from halo.errors import HaloError

from halo.pipeline.protocol import STAGE_PROTOCOL, message_bytes
from halo.pipeline.stage import HeadRequest


class StageRefused(HaloError):
    """A worker answered, but refused or failed the request (wrong model, bad input, a bug)."""


class StageFailed(HaloError):
    """A worker stopped answering or its connection dropped: re-plan without it."""

    def __init__(self, worker: str, message: str):
        super().__init__(message)
        self.worker = worker


class Traffic:
    """Bytes the coordinator sent to and received from workers."""

    def __init__(self):
        self.sent = 0
        self.received = 0

    @property
    def total(self) -> int:
        return self.sent + self.received


def measure_link(ping, payload_bytes: int = 1 << 20, rounds: int = 3) -> tuple[float, float]:
    """(RTT seconds, bandwidth bits/s) of a link: the median round trip of an empty ping(arrays), and of
    one echoing a payload (it crosses the link twice)."""
    rtts, bulk = [], []
    payload = np.zeros(payload_bytes, dtype=np.uint8)
    for _ in range(rounds):
        t = time.perf_counter()
        ping([])
        rtts.append(time.perf_counter() - t)
        t = time.perf_counter()
        ping([payload])
        bulk.append(time.perf_counter() - t)
    rtt = float(np.median(rtts))
    return rtt, 2 * 8 * payload_bytes / max(float(np.median(bulk)) - rtt, 1e-6)


class NativeStage:
    """A halo-stage-worker over CURVE-authenticated ZeroMQ. The connection's monitor reports a
    dropped TCP connection at once, so a killed worker is noticed without waiting for the timeout."""

    kind = "native"
    rejoins = True  # a restarted worker at the same address can be asked again and re-planned over

    def __init__(self, context, endpoint: str, key, insecure: bool, timeout_s: float, model_sha256: str,
                 traffic: Traffic | None = None, hello_timeout_s: float = 30.0):
        self.endpoint, self.name, self.timeout_s, self.hello_timeout_s = endpoint, endpoint, timeout_s, hello_timeout_s
        self.model_sha256, self.traffic = model_sha256, traffic or Traffic()
        self.context, self.key, self.insecure = context, key, insecure
        self.session = os.urandom(8).hex()
        self._connect()

    def _connect(self) -> None:
        import zmq

        from halo.transport.reliable import client_socket

        self.socket = client_socket(self.context, self.key, self.insecure, self.endpoint)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        self.socket.connect(self.endpoint)
        self.connected_once = False
        self.alive = True
        self.calls = 0  # requests sent: each carries its number, the worker echoes it

    def reconnect(self) -> None:
        """The worker came back at its address (it answered a status probe). ZeroMQ has kept reconnecting this
        socket all along, and nothing is queued on it (a dead link sends nothing): forget the failure and the
        connection events seen since. A request queued before the failure may still reach the restarted
        worker; its answer (an error: no session) carries an old call number and is skipped. (A new socket
        instead raced the old one's closing: the new socket's hello went unanswered in half the runs.)"""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        self.connected_once = False
        while self.monitor.poll(0):
            self.connected_once = recv_monitor_message(self.monitor)["event"] == zmq.EVENT_CONNECTED  # the last one
        self.alive = True

    def status_probe(self):
        """A separate socket with a status request in flight (halo/runtime/replanning.py's Membership polls it)."""
        from halo.runtime.replanning import status_probe

        return status_probe(self.context, self.endpoint, self.key, self.insecure)

    def _call(self, kind: str, fields: dict, arrays=(), what: str = "", timeout_s: float | None = None):
        import zmq

        from halo.transport.reliable import Message, MessageError, decode, encode

        if not self.alive:
            raise StageFailed(self.name, f"stage worker {self.name} is gone")
        self.calls += 1
        frames = encode(Message(kind, {**fields, "call": self.calls}, list(arrays)))
        self.traffic.sent += message_bytes(frames)
        self.socket.send_multipart(frames)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.alive = False
                raise StageFailed(self.name, f"stage worker {self.name} did not answer {what or kind} within "
                                             f"{timeout_s:.1f} s: it stopped, crashed or lost its network")
            events = dict(poller.poll(int(1000 * left) + 1))
            if self.monitor in events:
                from zmq.utils.monitor import recv_monitor_message

                event = recv_monitor_message(self.monitor)["event"]
                if event == zmq.EVENT_CONNECTED:
                    self.connected_once = True
                elif event == zmq.EVENT_DISCONNECTED and self.connected_once:
                    self.alive = False
                    raise StageFailed(self.name, f"stage worker {self.name} dropped its connection during {what or kind} "
                                                 "(it stopped, or it does not hold our cluster key)")
            if self.socket in events:
                raw = self.socket.recv_multipart()
                self.traffic.received += message_bytes(raw)
                try:
                    reply = decode(raw)
                except MessageError as e:
                    raise StageRefused(f"stage worker {self.name} sent a malformed reply to {what or kind}: {e}") from None
                if reply.fields.get("call", self.calls) != self.calls:
                    continue  # the late answer to a request sent before the worker failed (a restarted one: an error)
                if reply.kind in ("error", "refused"):
                    raise StageRefused(f"stage worker {self.name} {reply.kind} {what or kind}: {reply.fields.get('reason')}")
                return reply

    def probe(self, fmt: str = "fp32") -> dict:
        reply = self._call("probe", {"model_sha256": self.model_sha256, "weights": fmt}, what="the profile probe",
                           timeout_s=self.hello_timeout_s)
        self.name = f"{reply.fields.get('name', self.endpoint)}@{self.endpoint.split('://')[-1]}"
        return dict(reply.fields)

    def link(self) -> tuple[float, float]:
        return measure_link(lambda arrays: self._call("ping", {}, arrays, what="a ping"))

    def open(self, start: int, stop: int, context: int, fmt: str) -> dict:
        self.session = os.urandom(8).hex()
        reply = self._call("hello", {"protocol": STAGE_PROTOCOL, "model_sha256": self.model_sha256, "context": context,
                                     "start": start, "stop": stop, "weights": fmt, "session": self.session},
                           what=f"hello for units [{start}, {stop})", timeout_s=self.hello_timeout_s)
        return dict(reply.fields)

    def forward(self, inputs: np.ndarray, start_pos: int, head: HeadRequest) -> tuple[list[np.ndarray], float]:
        reply = self._call("forward", {"session": self.session, "start_pos": start_pos, "head": head.to_json()},
                           [inputs], what=f"the forward pass at position {start_pos}")
        return reply.arrays, float(reply.fields.get("compute_ms", 0.0))

    def reset(self) -> None:
        self._call("reset", {"session": self.session})

    def close(self) -> None:
        if self.alive:
            try:
                from halo.transport.reliable import Message, encode

                self.socket.send_multipart(encode(Message("bye", {"session": self.session})))
            except Exception:  # noqa: BLE001 - closing must not fail
                pass
        self.socket.close(linger=100)
        self.monitor.close(linger=0)


class LocalStage:
    """A stage the coordinator computes itself (the plan gives units to the master device)."""

    kind = "local"

    def __init__(self, weights, name: str = "master", threads: int = 1, device: str = "cpu"):
        self.weights, self.name, self.threads, self.device = weights, name, threads, device
        self.engine = None
        self.alive = True

    def probe(self, fmt: str = "fp32") -> dict:
        from halo.pipeline.engines import make_engine
        from halo.pipeline.profile import time_engine

        c = self.weights.config
        make = lambda a, b: make_engine(self.weights, a, b, 64, fmt, self.threads, self.device)  # noqa: E731
        per_layer, overhead = time_engine(make, c.n_layers, c.dim)
        import psutil

        engine = make(1, 2)
        return {"engine": engine.engine, "layer_s": per_layer, "overhead_s": overhead,
                "memory_bytes": float(psutil.virtual_memory().available), "name": self.name,
                "weight_format": engine.weight_format}

    def link(self) -> tuple[float, float]:
        return 0.0, 1e12

    def open(self, start: int, stop: int, context: int, fmt: str) -> dict:
        from halo.pipeline.engines import make_engine

        t = time.perf_counter()
        self.engine = make_engine(self.weights, start, stop, context, fmt, self.threads, self.device)
        return {"name": self.name, "engine": self.engine.engine, "weight_bytes": self.engine.weight_nbytes,
                "load_ms": 1e3 * (time.perf_counter() - t)}

    def forward(self, inputs: np.ndarray, start_pos: int, head: HeadRequest) -> tuple[list[np.ndarray], float]:
        t = time.perf_counter()
        out = self.engine.forward(inputs, start_pos, head)
        return out, 1e3 * (time.perf_counter() - t)

    def reset(self) -> None:
        if self.engine is not None:
            self.engine.reset()

    def close(self) -> None:
        self.engine = None
