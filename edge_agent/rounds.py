"""The agent's side of every round: compute its partial of a block, send it back, predict the next layer.

Inputs come over the control connection (reliable and halo-tcp modes: `Agent._block`) or as UDP
broadcasts (lossy and halo modes: `poll`). UDP inputs our KV caches need (attention of our layers)
are handled in order and never skipped: one we never saw a datagram of is asked for with a blind
NACK; one that still never comes marks the caches incomplete (`kv_gap`) and every later attention
partial says Status.KV_GAP until the master resets the session. Other inputs are answered only while
current: a newer broadcast means the master has moved on, so an older MLP / LM-head input is skipped.
"""

from __future__ import annotations

import logging
import time
from functools import cached_property

import numpy as np

from halo.compute.batch import Rows
from halo.compute.shares import Block
from halo.errors import HaloError
from halo.sync import Epoch, FramingError, Point, Status, SyncSettings, Transport, ranks_next_layer_itself
from halo.sync.framing import (attention_inputs_between, forward_passes_between, frame_partial, is_reply,
                               read_broadcast, reply_epoch)
from halo.compute.worker import DeviceWorker
from halo.transport import wire
from halo.transport.udp import GatherPolicy, UdpEndpoint

from halo.edge_agent.profile import BlockTimes

log = logging.getLogger("halo.agent")
MASTER = 0  # the master's UDP sender id
KINDS = {Point.ATTENTION: "attention", Point.MLP: "mlp", Point.LM_HEAD: "lm_head"}
MAX_FORWARD_JUMP = 4  # forward passes skipped at once beyond which a jump is not a lost packet
RESEND_INTERVAL_S = 0.002
# A second copy of an input (SyncSettings.copies) follows the first on the link, so it comes within a few ms of our
# answer; a chase (the master re-sending an input it got no partial for) comes no sooner than 12 ms after the input
# went out (deadline.py: 0.6 x the 20 ms late floor). A repeated input this soon after our answer is a copy.
COPY_GRACE_S = 0.010


class AgentRounds:
    def __init__(self, worker: DeviceWorker, sync: SyncSettings, udp: UdpEndpoint, served: dict):
        self.worker, self.sync, self.udp, self.served = worker, sync, udp, served
        self.forward = 0  # the master's forward pass we are in
        self.last_epoch = 0  # newest UDP input handled
        self.kv_gap = False  # an attention input never arrived: our KV caches are incomplete until reset
        self._resent: dict[int, float] = {}  # input epoch -> when we last re-sent its partial
        self._answered = (0, 0.0)  # the newest input epoch we answered, and when
        self.times = BlockTimes()  # scheduler hook: running compute estimate (status)

    @cached_property
    def predicts(self) -> bool:
        """HALO over UDP: the master's MLP inputs carry its ranking (and the next layer's, for an agent that loads
        ahead), so we predict only where that starts our loads and no MLP input brings it (predicts_from)."""
        return self.worker.loads_ahead or self.sync.policy.input is not Transport.UDP

    def predicts_from(self, block: Block) -> bool:
        """Whether we rank the next layer from this block's input (over UDP only where the MLP input of this layer,
        which carries the next layer's ranking, does not come to us)."""
        return (self.predicts and self.worker.predicts_from(block)
                and ranks_next_layer_itself(self.sync.policy, self.worker.share.mlp, block.layer))

    def reset(self) -> None:
        self.worker.reset()
        self.kv_gap = False

    # ---- one block ----------------------------------------------------------------------------------
    def run(self, block: Block, epoch: int, x: np.ndarray, start: int | Rows, digest: int, send,
            ranking: np.ndarray | None = None, next_ranking: np.ndarray | None = None) -> None:
        """Compute our partial of a block, hand it to send(out, status, compute_ms, cpu_ms), and predict the
        next layer (before computing, or after sending when prediction overlaps communication). ranking: the
        master's of an MLP block (HALO over UDP), computed instead of ours; next_ranking: its ranking of the next
        layer, whose groups we start loading once our partial is sent."""
        forward = Epoch.decode(epoch).forward
        if forward != self.forward:  # a new forward pass: rankings of the last one must not be reused
            self.forward = forward
            self.worker.begin_forward()
        predicts = self.predicts_from(block)
        if predicts and not self.sync.pred_overlap:
            self._predict(block, x)
        t, cpu = time.perf_counter(), time.thread_time()
        out, status = self._compute(block, x, start, digest, ranking)
        compute_ms = 1e3 * (time.perf_counter() - t)
        self.served["blocks"] += 1
        self.served["compute_ms"] += compute_ms
        self.times.observe(block.kind, len(self.worker.share.groups(block)), compute_ms)  # scheduler hook
        t = time.perf_counter()
        send(out, status, compute_ms, 1e3 * (time.thread_time() - cpu))
        self.served["send_ms"] += 1e3 * (time.perf_counter() - t)
        if predicts and self.sync.pred_overlap:
            self._predict(block, x)
        if next_ranking is not None and block.kind == "mlp":
            self.worker.expect_ranking(block.layer + 1, next_ranking)

    def _predict(self, block: Block, x: np.ndarray) -> None:
        t = time.perf_counter()
        self.worker.predict_next(block, x)
        self.served["predict_ms"] += 1e3 * (time.perf_counter() - t)

    def _compute(self, block: Block, x: np.ndarray, start: int | Rows, digest: int,
                 ranking: np.ndarray | None = None) -> tuple[np.ndarray | None, Status]:
        """Our partial output of a block for the residual x [T, D] (None: we hold none of it, an acknowledgement)."""
        if not self.worker.holds(block):
            if self.predicts_from(block):
                return None, Status.OK  # a listener: it only needed the input to predict
            raise HaloError(f"this agent holds no groups of the {block}")
        if block.kind == "attention" and self.kv_gap:
            return np.zeros_like(x), Status.KV_GAP
        if block.kind == "mlp" and ranking is not None:  # read_broadcast checked it against the digest
            if self.worker.digest(block.layer) not in (0, digest):  # ours differs: what we loaded ahead goes unused
                if not self.served["rankings_overridden"]:
                    log.warning("our predictors ranked layer %d differently from the master's: computing its ranking "
                                "(use the same predictors everywhere, or groups loaded ahead are wasted)", block.layer)
                self.served["rankings_overridden"] += 1
            self.worker.adopt_ranking(block.layer, ranking)
        elif block.kind == "mlp" and self.worker.digest(block.layer) != digest:
            return np.zeros_like(x), Status.RANKING_MISMATCH  # full size, so the master reads the status
        return self.worker.compute(block, x, start), Status.OK

    def send_partial(self, epoch: int, out, status: Status, compute_ms: float) -> None:
        """Our partial of a UDP or TCP input, over UDP (the lossy baseline sends it without parity)."""
        recovered = self.sync.policy.recover_other or self.sync.policy.all_critical
        self._answered = (epoch, time.monotonic())
        self.udp.send_vector({MASTER: self.udp.peers[MASTER]}, reply_epoch(epoch), frame_partial(out, status, compute_ms),
                             dtype=self.sync.partial_dtype,
                             **self.sync.protection(recovered and self.udp.lossy([MASTER])))

    # ---- UDP inputs ---------------------------------------------------------------------------------
    def poll(self) -> bool:
        """Handle the master's broadcasts that have arrived (call when the UDP socket is readable);
        True if a new one did (the session is alive even when no control message comes for minutes)."""
        t = time.perf_counter()
        whole = self.udp.whole_vector(MASTER, self.last_epoch, self._next_in_order, wire.FLOAT32, self._resend_partial)
        if whole is not None:  # the usual round: one whole broadcast queued, the next we need
            self.served["input_wait_ms"] += 1e3 * (time.perf_counter() - t)
            self._answer(*whole)
            return True
        pending = self.udp.pending_epochs(MASTER, self.last_epoch, 0.0, on_stale=self._resend_partial)
        if not pending:
            return False
        newest = pending[-1]
        if forward_passes_between(self.last_epoch, newest) > MAX_FORWARD_JUMP:
            log.warning("broadcast epochs jumped from %#x to %#x: starting over from there", self.last_epoch, newest)
            required = []
        else:
            required = attention_inputs_between(self.last_epoch, newest, self.worker.attention)
        for epoch in required:
            if not self._serve_broadcast(epoch, required=True):
                self.kv_gap = True  # our caches miss a position: refuse attention until the master resets
                self.served["errors"] += 1
                log.warning("never received attention input %#x: KV cache incomplete until the next reset", epoch)
                self.last_epoch = max(self.last_epoch, epoch)
        if newest > self.last_epoch:
            self._serve_broadcast(newest, required=False)
        return True

    def _serve_broadcast(self, epoch: int, required: bool) -> bool:
        """Gather one broadcast (NACKing its holes), compute, send the partial; False: it never came."""
        def ask(_peer):  # not one datagram of it arrived: ask the master for all of it
            self.udp.request_all(epoch, MASTER, None)

        policy = GatherPolicy(deadline_s=1.0, nack=True, stop_on_newer=not required,
                              silent_s=0.005 if required else None)
        t = time.perf_counter()
        result = self.udp.gather(epoch, {MASTER: None}, wire.FLOAT32, policy, on_silent=ask if required else None,
                                 on_stale=self._resend_partial)
        self.served["input_wait_ms"] += 1e3 * (time.perf_counter() - t)
        if not result.complete:  # the master moved on (or went quiet): nothing to answer
            self.served["broadcasts_incomplete"] += 1
            return False
        self._answer(epoch, result.values[MASTER])
        return True

    def _next_in_order(self, epoch: int) -> bool:
        """Whether poll() would serve this broadcast and nothing before it: no jump of forward passes, no attention
        input of ours skipped on the way (whole_vector takes the usual round in one step only then)."""
        return forward_passes_between(self.last_epoch, epoch) <= MAX_FORWARD_JUMP and \
            attention_inputs_between(self.last_epoch, epoch, self.worker.attention) == []

    def _answer(self, epoch: int, values: np.ndarray) -> None:
        """A whole broadcast read: compute our partial and send it (a malformed one is counted and ignored)."""
        try:
            if is_reply(epoch):
                raise FramingError(f"epoch {epoch:#x} is a reply, not an input")
            point = Epoch.decode(epoch)
            broadcast = read_broadcast(values, self.worker.config.dim)
        except FramingError as e:
            self.served["errors"] += 1
            log.warning("ignored a malformed broadcast (epoch %#x): %s", epoch, e)
            return
        self.last_epoch = max(self.last_epoch, epoch)  # only inputs we answer: a bad one must not hide a good one
        block = Block(KINDS[point.point], point.layer)
        try:
            self.run(block, epoch, broadcast.x, broadcast.start, broadcast.digest,
                     lambda out, status, ms, _cpu: self.send_partial(epoch, out, status, ms), broadcast.ranking,
                     broadcast.next_ranking)
        except (HaloError, ValueError) as e:  # (a kernel's refusal too: nothing a master sends stops the agent)
            self.served["errors"] += 1
            log.warning("block refused: %s", e)

    def _resend_partial(self, header: wire.Header, _address) -> None:
        """The master sent an input again that we already answered: our partial got lost (or is late);
        send it again, once per re-sent input. A re-sent input starts at its first chunk, so only that chunk
        asks: answering every stale chunk (each 2 ms at most) made a 64-token LM-head partial (3 MB, ~2,700
        datagrams) go out dozens of times per chase, flooding the master's socket and keeping the agent
        too busy to answer the next control message."""
        if header.kind != wire.DATA or header.index != 0:
            return
        now = time.monotonic()
        just_answered = self._answered[0] == header.epoch and now - self._answered[1] < COPY_GRACE_S
        if self.sync.copies_sent > 1 and just_answered:
            return  # the input's next copy, not a chase: our partial is on its way
        if now - self._resent.get(header.epoch, 0.0) < RESEND_INTERVAL_S:
            return
        self._resent = {e: t for e, t in self._resent.items() if now - t < 1.0}
        self._resent[header.epoch] = now
        # a chase this soon after our answer crossed it (we were slow); later, our partial was lost on its way
        if self.udp.resend(reply_epoch(header.epoch), MASTER, lost=not just_answered):
            self.served["partials_resent"] += 1
