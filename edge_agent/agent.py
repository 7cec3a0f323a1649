"""halo-agent: holds its neuron groups of a model and computes their partial outputs on request.

Life of an agent: listen (a CURVE server with the cluster key, or plaintext when told so) -> a master
says hello (protocol version, model sha256, the groups this agent computes) -> the agent loads only
those groups from its local copy of the model (rows and columns sliced out of a memory map: the
other weights are never read) -> blocks arrive (layer, attention/MLP/LM head, position, normed
input) and partial outputs go back -> bye, or the master disappears -> back to listening. Every
message is validated; a bad one is answered with an error and logged, never crashes the agent.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

import numpy as np

from halo.errors import HaloError
from halo.loader import load_weights, model_fingerprint
from halo.neuron_groups import AttentionShard, GroupLayout, LmHeadShard, MlpShard
from halo.ops import Rotary
from halo.transport.reliable import (PROTOCOL_VERSION, ClusterKey, Message, MessageError, decode, encode,
                                     server_socket, start_authenticator)

log = logging.getLogger("halo.agent")
IDLE_SESSION_S = 60.0  # a session with no message for this long is over (the master is gone)


@dataclass
class Session:
    master: str
    layout: GroupLayout
    attention: dict  # layer -> AttentionShard
    mlp: dict  # layer -> MlpShard
    lm_head: LmHeadShard | None
    rotary: Rotary
    last_seen: float
    peer: bytes = b""


class Agent:
    def __init__(self, model_path: str | None, listen: str, key: ClusterKey | None, insecure: bool = False,
                 name: str = "agent", weights_format: str = "fp32", threads: int = 1):
        import zmq

        self.weights = load_weights(model_path)
        self.model_sha256 = model_fingerprint(self.weights.source)
        self.name, self.format, self.threads = name, weights_format, threads
        self.context = zmq.Context()
        self.auth = start_authenticator(self.context, key) if key else None
        self.socket = server_socket(self.context, key, insecure)
        if listen.endswith(":0"):
            port = self.socket.bind_to_random_port(listen.rsplit(":", 1)[0])
            self.endpoint = f"{listen.rsplit(':', 1)[0]}:{port}"
        else:
            self.socket.bind(listen)
            self.endpoint = listen
        self.session: Session | None = None
        self.running = True
        # a UDP endpoint beside the control socket: link probes now, lossy/fast sync in HALO mode
        from halo.transport.udp import UdpEndpoint

        host = self.endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
        udp_key = key.udp_key if key else bytes(32)
        self.udp = UdpEndpoint(udp_key, 0, 255, bind=(host if host != "*" else "0.0.0.0", 0))
        from .profile import device_profile

        self.profile = device_profile()
        self.served = {"sessions": 0, "blocks": 0, "compute_ms": 0.0, "refused": 0, "errors": 0}
        # before anyone can learn our address: a SIGTERM from then on drains instead of killing
        signal.signal(signal.SIGTERM, self.stop)

    def stop(self, *_) -> None:
        self.running = False

    def serve(self) -> None:
        import zmq

        log.info("%s listening on %s (model %s, sha256 %s...)", self.name, self.endpoint, self.weights.source,
                 self.model_sha256[:12])
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.udp.sock.fileno(), zmq.POLLIN)
        while self.running:
            events = dict(poller.poll(200))
            if self.udp.sock.fileno() in events:
                self.udp.serve(0)  # answer link probes
            if self.socket not in events:
                if self.session and time.monotonic() - self.session.last_seen > IDLE_SESSION_S:
                    log.warning("session with %s idle for %.0f s: dropped", self.session.master, IDLE_SESSION_S)
                    self.session = None
                continue
            identity, *frames = self.socket.recv_multipart(zmq.NOBLOCK)
            try:
                reply = self.handle(decode(frames), identity)
            except MessageError as e:
                log.warning("refused a malformed message: %s", e)
                reply = Message("error", {"reason": f"malformed message: {e}"})
            except HaloError as e:
                self.served["errors"] += 1
                log.warning("error: %s", e)
                reply = Message("error", {"reason": str(e)})
            except Exception as e:  # a bug must not take the agent down mid-cluster
                log.exception("unexpected error while handling a message")
                reply = Message("error", {"reason": f"agent error: {type(e).__name__}: {e}"})
            if reply is not None:
                self.socket.send_multipart([identity, *encode(reply)])
        log.info("%s stopping", self.name)
        self.close()

    def close(self) -> None:
        self.udp.close()
        if self.auth:
            self.auth.stop()
        self.context.destroy(linger=0)

    # ---- messages ----------------------------------------------------------------------------------------
    def handle(self, message: Message, peer: bytes = b"") -> Message | None:
        if message.kind == "status":  # anyone holding the key may ask; it changes nothing
            session = None
            if self.session is not None:
                session = {"master": self.session.master, "attention_layers": sorted(self.session.attention),
                           "mlp_layers": sorted(self.session.mlp), "lm_head": self.session.lm_head is not None,
                           "heads": sum(len(s.heads) for s in self.session.attention.values()),
                           "mlp_groups": sum(len(s.groups) for s in self.session.mlp.values())}
            return Message("status", {"name": self.name, "model": self.weights.source, "profile": self.profile,
                                      "session": session, "served": self.served, "udp_port": self.udp.address[1]})
        if message.kind == "hello":  # a new master replaces the old session (the old one is gone or done)
            reply = self._hello(message.fields)
            if self.session is not None and reply.kind == "ready":
                self.session.peer = peer
            return reply
        if self.session is None:
            return Message("error", {"reason": f"'{message.kind}' before hello: no session"})
        if peer != self.session.peer:
            return Message("error", {"reason": "not in session with this agent (another master said hello since)"})
        self.session.last_seen = time.monotonic()
        if message.kind == "block":
            return self._block(message)
        if message.kind == "reset":
            for shard in self.session.attention.values():
                shard.reset()
            return Message("ok")
        if message.kind == "bye":
            log.info("session with %s ended", self.session.master)
            self.session = None
            return Message("ok")
        return Message("error", {"reason": f"unknown message kind {message.kind!r}"})

    def _hello(self, f: dict) -> Message:
        def refuse(reason: str) -> Message:
            self.served["refused"] += 1
            log.warning("refused master %s: %s", f.get("master", "?"), reason)
            return Message("refused", {"reason": reason})

        if f.get("protocol") != PROTOCOL_VERSION:
            return refuse(f"protocol {f.get('protocol')} but this agent speaks {PROTOCOL_VERSION}: upgrade halo")
        if f.get("model_sha256") != self.model_sha256:
            return refuse(f"model mismatch: the master runs sha256 {str(f.get('model_sha256'))[:12]}..., this agent "
                          f"holds {self.model_sha256[:12]}... ({self.weights.source})")
        try:
            c = self.weights.config
            layout = GroupLayout.for_model(c, int(f["mlp_group_size"]), int(f["vocab_group_size"]))
            context = int(f["context"])
            attention, mlp = f["attention"], f["mlp"]
            if len(attention) != c.n_layers or len(mlp) != c.n_layers or not 0 < context <= c.max_seq_len:
                return refuse("the plan does not fit this model (layers or context)")
            t = time.perf_counter()
            n = self.threads
            fmt = f.get("weights") or self.format  # the master's choice, so the whole cluster computes alike
            if fmt not in ("fp32", "int8"):
                return refuse(f"unknown weight format {fmt!r}")
            shards_a = {l: AttentionShard(self.weights.layers[l], layout, heads, context, fmt, n)
                        for l, heads in enumerate(attention) if heads}
            shards_m = {l: MlpShard(self.weights.layers[l], layout, groups, fmt, n)
                        for l, groups in enumerate(mlp) if groups}
            head = LmHeadShard(self.weights.lm_head, layout, f["lm_head"], fmt, n) if f["lm_head"] else None
        except (KeyError, TypeError, ValueError) as e:
            return refuse(f"bad hello: {e}")
        self.session = Session(str(f.get("master", "?")), layout, shards_a, shards_m, head, Rotary(c, context),
                               time.monotonic())
        nbytes = sum(s.nbytes for s in [*shards_a.values(), *shards_m.values()]) + (head.nbytes if head else 0)
        log.info("session with %s: %d attention and %d MLP shards, %.1f MB, loaded in %.0f ms", self.session.master,
                 len(shards_a), len(shards_m), nbytes / 1e6, 1e3 * (time.perf_counter() - t))
        self.served["sessions"] += 1
        return Message("ready", {"name": self.name, "weight_bytes": nbytes, "profile": self.profile,
                                 "udp_port": self.udp.address[1]})

    def _block(self, message: Message) -> Message:
        s, f = self.session, message.fields
        if len(message.arrays) != 1:
            return Message("error", {"reason": "a block carries exactly one array"})
        x = np.asarray(message.arrays[0], dtype=np.float32)
        kind, layer = f.get("kind"), f.get("layer")
        if x.ndim != 2 or x.shape[1] != self.weights.config.dim:
            return Message("error", {"reason": f"block input has shape {x.shape}, expected [T, {self.weights.config.dim}]"})
        t, cpu = time.perf_counter(), time.thread_time()
        if kind == "attention" and layer in s.attention:
            start = int(f["start_pos"])
            if start < 0 or start + len(x) > s.rotary.cos.shape[0]:
                return Message("error", {"reason": f"positions {start}..{start + len(x) - 1} are outside the context"})
            out = s.attention[layer].forward(x, start, s.rotary)
        elif kind == "mlp" and layer in s.mlp:
            out = s.mlp[layer].forward(x)
        elif kind == "lm_head" and s.lm_head is not None:
            out = s.lm_head.forward(x)
        else:
            return Message("error", {"reason": f"this agent holds no {kind} groups of layer {layer}"})
        compute_ms, cpu_ms = 1e3 * (time.perf_counter() - t), 1e3 * (time.thread_time() - cpu)
        self.served["blocks"] += 1
        self.served["compute_ms"] += compute_ms
        return Message("partial", {"kind": kind, "layer": layer, "compute_ms": compute_ms, "cpu_ms": cpu_ms},
                       [out.astype(np.float32)])
