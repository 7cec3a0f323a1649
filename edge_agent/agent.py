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
from dataclasses import dataclass, field

import numpy as np

from halo.distributed import rank_range
from halo.errors import HaloError
from halo.linear import FORMATS
from halo.loader import load_weights, model_fingerprint
from halo.neuron_groups import AttentionShard, GroupLayout, LmHeadShard, MlpShard
from halo.ops import Rotary, rmsnorm
from halo.remap import Remapper
from halo.sync import (ATTENTION, LM_HEAD, MLP, PREFIX, STATUS_KV_GAP, STATUS_OK, STATUS_RANKING_MISMATCH,
                       SyncSettings, frame)
from halo.transport.reliable import (PROTOCOL_VERSION, ClusterKey, Message, MessageError, decode, encode,
                                     server_socket, start_authenticator)

log = logging.getLogger("halo.agent")
IDLE_SESSION_S = 60.0  # a session with no message for this long is over (the master is gone)


@dataclass
class Session:
    master: str
    layout: GroupLayout
    attention: dict  # layer -> AttentionShard
    mlp: dict  # layer -> MlpShard (static groups; empty in HALO mode, where remap computes the MLP)
    lm_head: LmHeadShard | None
    rotary: Rotary
    last_seen: float
    peer: bytes = b""
    sync: SyncSettings = field(default_factory=SyncSettings)
    remap: Remapper | None = None
    mlp_ranks: dict = field(default_factory=dict)  # layer -> (a, b) in HALO mode
    last_epoch: int = 0  # newest UDP broadcast handled
    kv_gap: bool = False  # an attention input never arrived: our KV caches are incomplete until reset


class Agent:
    def __init__(self, model_path: str | None, listen: str, key: ClusterKey | None, insecure: bool = False,
                 name: str = "agent", weights_format: str = "fp32", threads: int = 1, predictors: str | None = None):
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
        self.served = {"sessions": 0, "blocks": 0, "compute_ms": 0.0, "refused": 0, "errors": 0,
                       "broadcasts_incomplete": 0, "partials_resent": 0}
        self.predictors_dir = predictors
        self._resent: dict[int, float] = {}  # input epoch -> when we last re-sent its partial
        self._predictor_set = None
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
                if self.session is not None and self.session.sync.udp_broadcast:
                    self._udp_round()
                else:
                    self.udp.serve(0)  # answer link probes and NACKs for partials sent over UDP
            if self.socket not in events:
                if self.session and time.monotonic() - self.session.last_seen > IDLE_SESSION_S:
                    log.warning("session with %s idle for %.0f s: dropped", self.session.master, IDLE_SESSION_S)
                    self._end_session()
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

    def _end_session(self) -> None:
        if self.session is not None and self.session.remap is not None:
            self.session.remap.close()
        self.session = None
        self.udp.send_hook = None

    def close(self) -> None:
        self._end_session()
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
                session["sync"] = self.session.sync.mode
                if self.session.sync.udp:
                    session["udp"] = self.udp.stats[0].to_json()
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
            self.session.kv_gap = False
            return Message("ok")
        if message.kind == "bye":
            log.info("session with %s ended", self.session.master)
            self._end_session()
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
            if fmt not in FORMATS:
                return refuse(f"unknown weight format {fmt!r}")
            sync = SyncSettings.from_json(f.get("sync") or {})
            if sync.semantic and fmt != "fp32":
                return refuse(f"sync mode {sync.mode} needs fp32 weights")
            shards_a = {l: AttentionShard(self.weights.layers[l], layout, heads, context, fmt, n)
                        for l, heads in enumerate(attention) if heads}
            remap, ranks = None, {}
            if sync.semantic:  # MLP shares are rank ranges; the groups behind them change per token
                ranks = {l: rank_range(r) for l, r in enumerate(mlp) if r}  # ConfigError -> refused
                predictors = self._predictors() if sync.predict else None
                remap = Remapper(self.weights, layout, ranks, predictors, sync.load_overlap)
                shards_m = {}
            else:
                shards_m = {l: MlpShard(self.weights.layers[l], layout, groups, fmt, n)
                            for l, groups in enumerate(mlp) if groups}
            head = LmHeadShard(self.weights.lm_head, layout, f["lm_head"], fmt, n) if f["lm_head"] else None
            if sync.udp:
                self.udp.session = int(f["udp_session"])
                self.udp.node_id = int(f["node_id"])
                if not 0 < self.udp.node_id < 255:
                    return refuse(f"node id {self.udp.node_id} outside 1..254")
        except HaloError as e:
            return refuse(str(e))
        except (KeyError, TypeError, ValueError) as e:
            return refuse(f"bad hello: {e}")
        if self.session is not None:
            self._end_session()
        self.session = Session(str(f.get("master", "?")), layout, shards_a, shards_m, head, Rotary(c, context),
                               time.monotonic(), sync=sync, remap=remap, mlp_ranks=ranks)
        if sync.inject_plr:
            from halo.transport.loss import LossInjector

            self.udp.send_hook = LossInjector(seed=sync.seed + 1000 * self.udp.node_id, drop=sync.inject_plr)
        nbytes = sum(s.nbytes for s in [*shards_a.values(), *shards_m.values()]) + (head.nbytes if head else 0)
        nbytes += sum(4 * (b - a) * layout.mlp_group_size * 3 * c.dim for a, b in ranks.values())
        log.info("session with %s: %d attention and %d MLP shards, %.1f MB, loaded in %.0f ms", self.session.master,
                 len(shards_a), len(shards_m), nbytes / 1e6, 1e3 * (time.perf_counter() - t))
        self.served["sessions"] += 1
        return Message("ready", {"name": self.name, "weight_bytes": nbytes, "profile": self.profile,
                                 "udp_port": self.udp.address[1]})

    def _predictors(self):
        if self._predictor_set is None:
            from halo.loader import load_predictors

            self._predictor_set = load_predictors(self.weights, self.predictors_dir)
        return self._predictor_set

    def _compute(self, kind: str, layer: int, x: np.ndarray, start: int, digest: int):
        """This agent's partial output of a block for the residual x [T, D] -> (output or None, status)."""
        s, w, eps = self.session, self.weights, self.weights.config.norm_eps
        if kind == "attention":
            if layer not in s.attention:
                return None, STATUS_OK
            if s.kv_gap:
                return np.zeros_like(x), STATUS_KV_GAP
            if start < 0 or start + len(x) > s.rotary.cos.shape[0]:
                raise HaloError(f"positions {start}..{start + len(x) - 1} are outside the context")
            return s.attention[layer].forward(rmsnorm(x, w.layers[layer].attn_norm, eps), start, s.rotary), STATUS_OK
        if kind == "mlp":
            h = rmsnorm(x, w.layers[layer].mlp_norm, eps)
            if s.remap is not None and layer in s.mlp_ranks:
                if s.remap.digest(layer) != digest:  # full size, so the master reads the status
                    return np.zeros_like(x), STATUS_RANKING_MISMATCH
                return s.remap.mlp_partial(layer, h), STATUS_OK
            if layer in s.mlp:
                return s.mlp[layer].forward(h), STATUS_OK
            raise HaloError(f"this agent holds no MLP groups of layer {layer}")
        if kind == "lm_head" and s.lm_head is not None:
            return s.lm_head.forward(rmsnorm(x, w.final_norm, eps)), STATUS_OK
        raise HaloError(f"this agent holds no {kind} groups of layer {layer}")

    def _predict(self, kind: str, layer: int, x: np.ndarray) -> None:
        s = self.session
        if s.remap is not None and kind == "attention" and layer + 1 in s.mlp_ranks:
            s.remap.predict(layer + 1, x)

    def _run_block(self, kind: str, layer: int, x: np.ndarray, start: int, digest: int, send) -> None:
        """Compute, hand the partial to send(output, status, compute_ms, cpu_ms), predict the next layer
        (before computing, or after sending when prediction overlaps communication)."""
        s = self.session
        if kind == "attention" and layer == 0 and s.remap is not None:
            s.remap.begin()
        if not s.sync.pred_overlap:
            self._predict(kind, layer, x)
        t, cpu = time.perf_counter(), time.thread_time()
        out, status = self._compute(kind, layer, x, start, digest)
        compute_ms, cpu_ms = 1e3 * (time.perf_counter() - t), 1e3 * (time.thread_time() - cpu)
        self.served["blocks"] += 1
        self.served["compute_ms"] += compute_ms
        send(out, status, compute_ms, cpu_ms)
        if s.sync.pred_overlap:
            self._predict(kind, layer, x)

    def _block(self, message: Message) -> Message | None:
        """A block over the control connection (reliable and halo-tcp modes)."""
        s, f = self.session, message.fields
        if len(message.arrays) != 1:
            return Message("error", {"reason": "a block carries exactly one array"})
        x = np.asarray(message.arrays[0], dtype=np.float32)
        kind, layer, reply_by = f.get("kind"), f.get("layer"), f.get("reply", "tcp")
        if x.ndim != 2 or x.shape[1] != self.weights.config.dim:
            return Message("error", {"reason": f"block input has shape {x.shape}, expected [T, {self.weights.config.dim}]"})
        if kind not in ("attention", "mlp", "lm_head") or not isinstance(layer, int) or reply_by not in ("tcp", "udp", "none"):
            return Message("error", {"reason": f"bad block header kind={kind!r} layer={layer!r} reply={reply_by!r}"})
        if reply_by == "udp" and 0 not in self.udp.peer_addresses:
            return Message("error", {"reason": "no UDP address of the master yet (its link probe never arrived)"})
        answer = []

        def send(out, status, compute_ms, cpu_ms):
            if status == STATUS_RANKING_MISMATCH:
                answer.append(Message("error", {"reason": f"ranking of layer {layer} differs from the master's "
                                                          "(different predictors or onnxruntime build)"}))
            elif reply_by == "tcp":
                answer.append(Message("partial", {"kind": kind, "layer": layer, "compute_ms": compute_ms,
                                                  "cpu_ms": cpu_ms}, [out.astype(np.float32)]))
            elif reply_by == "udp":
                self._send_partial(int(f["epoch"]) + 1, out, status, compute_ms)

        self._run_block(kind, layer, x, int(f.get("start_pos", 0)), int(f.get("digest", 0)), send)
        return answer[0] if answer else None

    def _send_partial(self, epoch: int, out, status: float, compute_ms: float) -> None:
        body = frame([compute_ms, 0, status, 0], out if out is not None else np.zeros(0, np.float32))
        sync = self.session.sync  # the lossy baseline sends plain partials: no parity to recover from
        self.udp.send_vector(self.udp.peer_addresses[0], 0, epoch, body, parity_group=sync.parity_group if sync.semantic else 0)

    def _resend_partial(self, header, address) -> None:
        """The master sent an input again that we already answered: our partial got lost (or is late);
        send it again (once per re-sent input: its chunks arrive together)."""
        now = time.monotonic()
        if now - self._resent.get(header.epoch, 0.0) < 0.002:
            return
        self._resent = {e: t for e, t in self._resent.items() if now - t < 1.0}
        self._resent[header.epoch] = now
        if self.udp.resend(header.epoch + 1, 0):
            self.served["partials_resent"] += 1

    def _udp_round(self) -> None:
        """Handle the master's UDP broadcasts. Inputs our KV caches need (attention of our layers) are
        handled in order and never skipped: one we never saw a datagram of is requested with a blind
        NACK. Other inputs are answered only while current: a newer broadcast means the master has
        moved on, so an older MLP / LM-head input is skipped."""
        s = self.session
        pending = self.udp.pending_epochs(0, s.last_epoch, 0.0, on_stale=self._resend_partial)
        if not pending:
            return
        newest = pending[-1]
        for epoch in self._kv_inputs_between(s.last_epoch, newest):
            if self.session is not s:
                return
            if not self._handle_broadcast(epoch, required=True):
                s.kv_gap = True  # our caches miss a position: refuse attention until the master resets
                self.served["errors"] += 1
                log.warning("never received attention input %#x: KV cache incomplete until the next reset", epoch)
                s.last_epoch = max(s.last_epoch, epoch)
        if self.session is s and newest > s.last_epoch:
            self._handle_broadcast(newest, required=False)

    def _kv_inputs_between(self, after: int, newest: int) -> list[int]:
        """Attention broadcasts of our head layers with epochs in (after, newest): forward passes are
        numbered consecutively, so every one of them was sent."""
        from halo.transport import wire

        s = self.session
        first, last = max(1, after >> 20), newest >> 20
        if last - first > 4:  # a jump this large is not a lost packet: start over from here
            log.warning("broadcast epochs jumped from %#x to %#x", after, newest)
            return []
        out = [wire.make_epoch(f, l, ATTENTION) for f in range(first, last + 1) for l in sorted(s.attention)]
        return [e for e in out if after < e < newest]

    def _handle_broadcast(self, epoch: int, required: bool) -> bool:
        """Gather one broadcast (NACKing its holes), compute, send the partial; False: it never came."""
        from halo.transport import wire

        s = self.session
        master = self.udp.peer_addresses.get(0)

        def ask(_peer):  # not one datagram of it arrived: ask the master for all of it
            if master is not None:
                self.udp.request_all(epoch, 0, None, wire.FLOAT32, master)

        result = self.udp.gather(epoch, {0: None}, wire.FLOAT32, deadline_s=1.0, nack=True, stop_on_newer=not required,
                                 on_stale=self._resend_partial, silent_s=0.005 if required else None,
                                 on_silent=ask if required else None)
        s.last_seen = time.monotonic()
        if not result.complete:  # the master moved on (or went quiet): nothing to answer
            self.served["broadcasts_incomplete"] += 1
            return False
        v, dim = result.values[0], self.weights.config.dim
        tokens, start, digest = int(v[0]), int(v[1]), int(v[2])
        layer, point = (epoch >> 4) & 0xFFFF, epoch & 0xF
        kind = {ATTENTION: "attention", MLP: "mlp", LM_HEAD: "lm_head"}.get(point)
        if kind is None or tokens <= 0 or PREFIX + tokens * dim > len(v):
            self.served["errors"] += 1
            log.warning("ignored a malformed broadcast (epoch %#x, %d tokens)", epoch, tokens)
            return True
        x = v[PREFIX:PREFIX + tokens * dim].reshape(tokens, dim)
        s.last_epoch = max(s.last_epoch, epoch)  # only inputs we answer: a bad one must not hide a good one
        try:
            self._run_block(kind, layer, x, start, digest,
                            lambda out, status, ms, _cpu: self._send_partial(epoch + 1, out, status, ms))
        except HaloError as e:
            self.served["errors"] += 1
            log.warning("block refused: %s", e)
        return True
