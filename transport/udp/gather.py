"""Gathering one epoch's vectors from a set of peers until complete or their deadlines (GatherPolicy), one Inbound
per peer: parity repairs, NACKs after a gap, datagrams of later epochs kept for their gather, NACKs and probes
answered meanwhile.

A role of UdpEndpoint (halo/transport/udp/endpoint.py): the methods here run on the one endpoint object."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from halo.transport import erasure, wire
from halo.transport.udp.base import PeerStats
from halo.transport.udp.send import PARITY_PREFIX

EARLY_KEPT = 4096  # datagrams of future epochs held for their gather
TAIL_S = 0.002  # a vector's tail, parity and copies behind its first datagram (GatherPolicy.gap_s's NACK gap alike)


@dataclass(frozen=True)
class PeerDeadline:
    """One peer's own deadlines in a gather (seconds from its start), in place of the policy's round-wide ones: a
    peer's turnaround and its spread are its link's and device's, not the round's."""

    loss_s: float  # with evidence of loss
    late_s: float  # without


@dataclass(frozen=True)
class GatherPolicy:
    """UdpEndpoint's gathers of an epoch's vectors."""

    deadline_s: float = 0.010  # peers not critical, with evidence of loss, stop being waited for after this
    hard_deadline_s: float | None = None  # critical peers get this long (None: the deadline)
    late_deadline_s: float | None = None  # peers not critical and without evidence of loss (None: the deadline)
    critical: frozenset = frozenset()
    nack: frozenset | bool = False  # peers whose holes are NACKed (True: every peer)
    silent_s: float | None = None  # a peer owed data that has sent nothing for this long is chased (on_silent)
    stop_on_newer: bool = False  # return as soon as an expected peer sends a newer epoch (it has moved on)
    per_peer: Mapping[int, PeerDeadline] = field(default_factory=dict)  # non-critical peers' own deadlines
    # NACK this long after the last chunk when the burst's tail has not come, and again every nack_retry_s. Not
    # shorter: a sender descheduled mid-burst on a busy device (a scheduler slice is milliseconds) was NACKed
    # at 0.5 ms and answered every retry at 1 ms: duplicates, and parity switched on at 0 % loss
    gap_s: float = 0.002
    nack_retry_s: float = 0.003


@dataclass
class GatherResult:
    values: dict[int, np.ndarray]  # peer -> vector (missing chunks zero-filled)
    masks: dict[int, np.ndarray]  # peer -> bool per chunk, True = arrived (or recovered)
    done_s: dict[int, float] = field(default_factory=dict)  # peer -> seconds until its vector was complete
    heard: set = field(default_factory=set)  # peers that sent at least one valid datagram of the epoch
    lossy: set = field(default_factory=set)  # peers that showed loss (holes, NACKs, chases)

    @property
    def complete(self) -> bool:
        return all(m.all() for m in self.masks.values())

    def delivered_fraction(self) -> float:
        total = sum(len(m) for m in self.masks.values())
        return sum(int(m.sum()) for m in self.masks.values()) / total if total else 1.0


class Inbound:
    """One peer's vector of one epoch as it arrives: chunk payloads, parity, timers, what is still missing.
    Payloads are kept as they came and decoded once, when the gather ends (`vector`)."""

    __slots__ = ("peer", "dtype", "per", "count", "n_values", "got", "received", "payloads", "parities", "heard",
                 "nacked", "lossy", "chased", "completed_at", "next_nack", "next_silent", "nack", "end", "loss_end", "origin",
                 "parity_expected", "whole_bytes", "held_until", "heard_at")

    def __init__(self, peer: int, n_values: int | None, dtype: int, end: float, loss_end: float, nack: bool,
                 silent_at: float, parity_expected: bool = False):
        self.peer, self.dtype, self.nack, self.n_values = peer, dtype, nack, n_values
        self.parity_expected = parity_expected  # the peer has sent parity this session: wait for it at the tail
        self.end, self.loss_end = end, loss_end  # until when we wait: without / with evidence of loss
        self.held_until = 0.0  # ... or while the gather waits for another peer anyway (Gatherer._hold)
        self.heard_at = 0.0  # when its first datagram of this vector came
        self.per = wire.values_per_chunk(dtype)
        self.whole_bytes = wire.payload_bytes(self.per, dtype)  # a whole chunk's payload
        self.count = None if n_values is None else wire.chunk_count(n_values, dtype)  # None: learn from chunks
        self.got = bytearray(self.count or 0)
        self.received = 0
        self.payloads: dict[int, bytes] = {}
        self.parities: dict[int, list] = {}  # first chunk of a group -> [group size, P or None, Q or None]
        self.heard = self.nacked = self.lossy = self.chased = False
        self.completed_at: float | None = None
        self.next_nack = float("inf")  # armed by the first chunk: never NACK blindly
        self.next_silent = silent_at
        # counter - index of the vector's first transmission: its data chunks are packed one after the other, so
        # they share this; a chunk sent again (NACK, chase) was packed later and has a larger one
        self.origin: int | None = None

    @property
    def complete(self) -> bool:
        return self.count is not None and self.received == self.count

    def own_until(self) -> float:
        """A vector with a hole is waited for until its loss deadline, and at least TAIL_S past its first datagram
        (at most its late deadline): the rest of it, its parity and its copies follow the head within the link's
        rate, so a head that came in the spread's tail was cut before its tail could mend it (HALO on wifi-busy:
        a third of the drops were of partials heard with one chunk of two, cut at the moment they came)."""
        if not self.lossy:
            return self.end
        return max(self.loss_end, min(self.end, self.heard_at + TAIL_S)) if self.heard else self.loss_end

    def until(self) -> float:
        return max(self.held_until, self.own_until())

    def owed(self, now: float) -> bool:
        return not self.complete and now < self.until()

    def accept(self, header: wire.Header, payload: bytes, stats: PeerStats, late: bool) -> None:
        """Take one valid datagram of this epoch from this peer; problems are counted, never raised."""
        kind, dtype, _, _, _, counter, index, count, _ = header
        if self.count is None and dtype == self.dtype:
            self.count = count  # the size is what the sender's chunks say (whole chunks)
            self.n_values = count * self.per
            self.got = bytearray(count)
        if dtype != self.dtype or count != self.count:
            stats.rejected["malformed"] += 1
            return
        if not self.heard:
            self.heard, self.heard_at = True, time.perf_counter()
        if late:
            stats.rejected["late"] += 1  # past its deadline a peer's data only says it is alive
            return
        if kind == wire.DATA:
            if self.got[index]:
                stats.rejected["duplicate"] += 1
                return
            if len(payload) != self._payload_bytes(index):
                stats.rejected["bad_length"] += 1
                return
            if self.received < index and not self.nacked:
                self.lossy = True  # a hole before this chunk: chunks arrive in order unless lost
            self._store(index, payload)
            stats.chunks_received += 1
            if self._sent_again(counter - index):
                stats.chunks_recovered_nack += 1
        elif kind in wire.PARITIES:
            size = PARITY_PREFIX.unpack_from(payload)[0] if len(payload) > PARITY_PREFIX.size else 0
            group = self.parities.get(index) or [size, None, None]
            if not 0 < size <= count - index or group[0] != size:
                stats.rejected["malformed"] += 1
                return
            if self.complete:  # every data chunk is in (what happens when nothing was lost): nothing to rebuild
                return
            group[1 if kind == wire.PARITY else 2] = payload[PARITY_PREFIX.size:]
            self.parities[index] = group
        else:  # NACKs and probes are answered by the endpoint, never taken as a vector's chunks
            stats.rejected["malformed"] += 1
            return
        if self.parities:
            stats.chunks_recovered_parity += self._repair_with_parity()

    def fits(self, run, on_time: bool) -> bool:
        """Whether a whole vector (UdpEndpoint._whole_runs) is what accept() would store, chunk by chunk, into this
        state, which has nothing yet: on time, our dtype, our size, the last chunk's length ours."""
        if self.received or self.parities or not on_time or run.dtype != self.dtype or \
                (self.count is not None and run.count != self.count):
            return False
        return len(run.payloads[-1]) == (self.whole_bytes if self.count is None else self._payload_bytes(run.count - 1))

    def fill(self, run, now: float) -> None:
        """A whole vector that fits, stored as accept() on each of its datagrams would store it."""
        if self.count is None:
            self.count, self.n_values = run.count, run.count * self.per
        self.got = bytearray(b"\x01" * run.count)
        self.received = run.count
        self.payloads = dict(enumerate(run.payloads))
        self.heard = True
        self.origin = run.counters[0]  # (fits: nothing was stored before, so no origin or completion either)
        self.completed_at = now

    def _sent_again(self, origin: int) -> bool:
        """Whether a data chunk whose counter - index is `origin` is a re-sent copy rather than its first
        transmission. Only these count as recovered by NACK: an original that arrives after a NACK was late, not
        lost (counting it made a descheduled sender look like a lossy link)."""
        if self.origin is None or origin < self.origin:
            self.origin = origin
        return origin > self.origin

    def _payload_bytes(self, index: int) -> int:
        if index < self.count - 1:  # a whole chunk (all but the last)
            return self.whole_bytes
        return wire.payload_bytes(min(self.per, self.n_values - index * self.per), self.dtype)

    def _store(self, index: int, payload: bytes) -> None:
        self.got[index] = 1
        self.received += 1
        self.payloads[index] = payload

    def _repair_with_parity(self) -> int:
        """Parity groups missing no more chunks than their parity at hand can rebuild (erasure.py): rebuilt."""
        repaired = 0
        for start, (size, p, q) in list(self.parities.items()):
            present = {i - start: self.payloads[i] for i in range(start, start + size) if self.got[i]}
            if len(present) == size:
                del self.parities[start]
                continue
            rebuilt = erasure.rebuild(present, size, p, q)
            if rebuilt is None:
                continue
            for position, chunk in rebuilt.items():
                length = self._payload_bytes(start + position)
                if length > len(chunk):
                    break  # a parity shorter than the chunk it should cover: a forgery; wait for a NACK
                self._store(start + position, chunk[:length])
                repaired += 1
            self.lossy = True
            del self.parities[start]
        return repaired

    def arm_nack(self, header: wire.Header, payload: bytes, now: float, gap_s: float) -> None:
        """The burst's tail came with holes: NACK now; else after a short gap without news. The tail is the
        last data chunk, or, from a peer that sends parity, the last group's last parity chunk: the parity
        right behind the data usually rebuilds the holes (a NACK before it came was answered for nothing)."""
        if self.complete or not self.nack or self.count is None:  # None: nothing valid came yet (e.g. another dtype)
            return
        self.next_nack = now if self.is_tail(header, payload) else min(self.next_nack, now + gap_s)

    def is_tail(self, header: wire.Header, payload: bytes) -> bool:
        """Whether this is the last datagram the sender sends of the vector (data, then P and Q per group)."""
        if header.kind == wire.DATA:
            return header.index >= self.count - 1 and not self.parity_expected
        size, chunks = PARITY_PREFIX.unpack_from(payload) if len(payload) > PARITY_PREFIX.size else (0, 1)
        return header.index + size >= self.count and (header.kind == wire.PARITY_Q or chunks == 1)

    def missing(self) -> np.ndarray:
        return np.flatnonzero(np.frombuffer(bytes(self.got), dtype=np.uint8) == 0).astype("<u2")

    def mask(self) -> np.ndarray:
        return np.frombuffer(bytes(self.got), dtype=np.uint8).astype(bool) if self.count else np.zeros(1, bool)

    def vector(self) -> np.ndarray:
        """The values, missing chunks zero-filled (decoded once, here)."""
        values = np.zeros(self.n_values or 0, dtype=np.float32)
        if self.dtype in (wire.FLOAT32, wire.FLOAT16) and self.received == self.count and self.count:
            raw = b"".join(self.payloads[i] for i in range(self.count))
            values[:] = np.frombuffer(raw, "<f4" if self.dtype == wire.FLOAT32 else "<f2")
            return values
        for i, payload in self.payloads.items():
            n = min(self.per, self.n_values - i * self.per)
            try:
                values[i * self.per:i * self.per + n] = wire.decode_values(payload, self.dtype, n)
            except wire.WireError:
                self.got[i] = 0  # cannot be: lengths were checked on arrival; treat as missing
        return values


class Gatherer:
    """Gathering one epoch's vectors from a set of peers until complete or their deadlines (GatherPolicy), one Inbound
    per peer: parity repairs, NACKs after a gap, datagrams of later epochs kept for their gather, NACKs and probes
    answered meanwhile."""

    def gather(self, epoch: int, expected: dict[int, int | None], dtype: int = wire.FLOAT32,
               policy: GatherPolicy = GatherPolicy(), on_silent=None, on_stale=None) -> GatherResult:
        """Wait for one epoch's vectors: expected maps peer id -> number of values, or None when the receiver
        cannot know it (the sender pads to whole chunks and the count says the size). Per peer the gather
        ends when its vector is complete or at its deadline (policy), but no peer is cut while another is still
        awaited (_hold); what is already queued when it starts
        arrived in time, whatever the clock says. `on_silent(peer)` chases a peer still owed data that has
        sent nothing for policy.silent_s (again every silent_s); `on_stale(header, address)` sees datagrams
        of older epochs (a peer re-sending an input we already answered)."""
        start = time.perf_counter()
        inbound = self._open_inbound(start, expected, dtype, policy, on_silent)
        early, self._early = self._early, []
        drained, newer = False, False
        while not newer:
            now = time.perf_counter()
            self._hold(inbound)
            waiting = [s for s in inbound.values() if s.owed(now)]
            if not waiting and drained:
                break
            wake = min([s.until() for s in waiting] + [s.next_nack for s in waiting]
                       + [s.next_silent for s in waiting if not s.heard] or [now])
            if not drained:
                queued = {h.sender for h, _, _ in early}
                arrivals = early + list(self._receive_gathering(epoch, inbound, 0.0, True, on_stale, queued))
            else:
                arrivals = early or self._receive_gathering(epoch, inbound, wake - now, False, on_stale)
            early, on_time, drained = [], not drained, True
            for header, payload, address in arrivals:
                newer |= self._take(epoch, header, payload, address, inbound, on_time, on_stale, policy)
            now = time.perf_counter()
            for state in waiting:
                if not state.heard and now >= state.next_silent:
                    # it may have lost all of its input, or be computing still: chasing is recovery, but silence
                    # is no hole, so the peer keeps the late deadline (marking it lossy dropped it at once: the
                    # chase comes after the loss deadline)
                    state.chased = True
                    on_silent(state.peer)
                    state.next_silent = now + policy.silent_s
                if not state.complete and now >= state.next_nack and state.peer in self.peers:
                    self._nack(epoch, state)
                    state.next_nack = now + policy.nack_retry_s
        return self._close_gather(start, inbound)

    @staticmethod
    def _hold(inbound: dict[int, Inbound]) -> None:
        """No peer is cut while the gather still waits for another: each incomplete one is owed (its chunks taken,
        its holes NACKed, its silence chased) until the latest own deadline among them. Cutting one sooner saves no
        time, only loses its partial (HALO on wifi-busy: 4.9 -> 4.5 % of the agents' partials dropped; most drops
        are of the peer awaited last)."""
        last = max((s.own_until() for s in inbound.values() if not s.complete), default=0.0)
        for state in inbound.values():
            state.held_until = last

    def _open_inbound(self, start: float, expected: dict, dtype: int, policy: GatherPolicy, on_silent) -> dict:
        hard = start + (policy.hard_deadline_s if policy.hard_deadline_s is not None else policy.deadline_s)
        loss_end = start + policy.deadline_s
        late_end = start + (policy.late_deadline_s if policy.late_deadline_s is not None else policy.deadline_s)
        silent_at = start + policy.silent_s if on_silent and policy.silent_s else float("inf")
        inbound = {}
        for p, n in expected.items():
            own = policy.per_peer.get(p)
            if p in policy.critical:
                until, until_lossy = hard, hard
            elif own is not None:
                until, until_lossy = start + max(own.late_s, own.loss_s), start + own.loss_s
            else:
                until, until_lossy = max(late_end, loss_end), loss_end
            inbound[p] = Inbound(p, n, dtype, until, until_lossy, policy.nack is True or p in (policy.nack or ()),
                                 silent_at, p in self.parity_from)
        return inbound

    def _receive_gathering(self, epoch: int, inbound: dict, timeout_s: float, on_time: bool, on_stale,
                           queued: set = frozenset()):
        """_receive during a gather: a batch that is whole vectors of the gathered epoch from peers whose Inbound
        has nothing yet (the usual partials) goes into them a vector at a time (Inbound.fill); any other batch
        comes out datagram by datagram, for _take. A peer with datagrams out that way (or `queued`: kept from
        before, not taken yet) gets no vector filled before they are taken."""
        if self.codec.state is None or not self.whole_vectors:
            yield from self._receive(timeout_s)
            return
        wait, more, out = max(timeout_s, 0.0), True, set(queued)
        while more:
            batch = wire._datagrams.receive(self.sock.fileno(), self.codec.state, self.session, wait, wire.Header)
            wait, more = 0.0, len(batch) == wire._datagrams.RECV_BATCH  # fewer: the queue was empty
            runs = self._whole_runs(batch, epoch) if batch and not more else None
            now = time.perf_counter()
            senders = [run.sender for run in runs or () if run.stale is None]
            if runs and len(set(senders)) == len(senders) and not out.intersection(senders) and all(
                    run.stale is not None and on_stale is None or run.epoch == epoch and run.sender in inbound
                    and inbound[run.sender].fits(run, on_time or now <= inbound[run.sender].until()) for run in runs):
                for run in runs:  # as _take takes each datagram
                    self._take_run(run)
                    if run.parity:
                        self.parity_from.add(run.sender)
                    if run.stale is not None:
                        self.stats[run.sender].rejected["stale"] += 1
                    else:
                        inbound[run.sender].fill(run, now)
                continue
            out.update(item[0].sender for item in batch if item.__class__ is not str)
            yield from self._checked(batch)

    def _take(self, epoch: int, header: wire.Header, payload: bytes, address, inbound: dict[int, Inbound],
              on_time: bool, on_stale, policy: GatherPolicy) -> bool:
        """Route one datagram during a gather; True when an expected peer has moved on to a newer epoch."""
        kind, sender, h_epoch = header.kind, header.sender, header.epoch
        if kind == wire.NACK:
            self._answer_nack(header, payload)
            state = inbound.get(sender)
            if state is not None and not state.complete:  # it lost part of the input it answers: its partial comes
                state.lossy = True  # a round trip late at best, so the loss deadline applies to it, not the late one
            return False
        if kind == wire.PROBE:
            self._answer_probe(header, payload, address)
            return False
        if kind != wire.DATA:
            self.parity_from.add(sender)
        if h_epoch != epoch:
            if h_epoch < epoch:
                self.stats[sender].rejected["stale"] += 1
                if on_stale is not None:
                    on_stale(header, address)
                return False
            self._keep_early(header, payload, address)  # a later synchronization: keep it for that gather
            return policy.stop_on_newer and sender in inbound
        state = inbound.get(sender)
        if state is None:
            self.stats[sender].rejected["unexpected"] += 1
            return False
        now = time.perf_counter()
        state.accept(header, payload, self.stats[sender], late=not on_time and now > state.until())
        if state.count is not None and state.received == state.count:  # complete
            if state.completed_at is None:
                state.completed_at = now
        else:
            state.arm_nack(header, payload, now, policy.gap_s)
        return False

    def _keep_early(self, header: wire.Header, payload: bytes, address) -> None:
        if len(self._early) < EARLY_KEPT:
            self._early.append((header, payload, address))
        else:
            self.stats[header.sender].rejected["early_overflow"] += 1

    def _nack(self, epoch: int, state: Inbound) -> None:
        self._sendto(self.pack(wire.NACK, state.dtype, epoch, 0, 1, state.missing().tobytes()[:wire.MAX_PAYLOAD]),
                     self.peers[state.peer])
        self.stats[state.peer].nacks_sent += 1
        state.nacked = state.lossy = True

    def _close_gather(self, start: float, inbound: dict[int, Inbound]) -> GatherResult:
        waited_ms = 1e3 * (time.perf_counter() - start)
        for peer, state in inbound.items():
            stats = self.stats[peer]
            stats.chunks_missing += (state.count - state.received) if state.count is not None else 0
            stats.chunks_expected += state.count or 0
            stats.sync_ms.append(waited_ms)
        return GatherResult({p: s.vector() for p, s in inbound.items()}, {p: s.mask() for p, s in inbound.items()},
                            {p: s.completed_at - start for p, s in inbound.items() if s.completed_at is not None},
                            {p for p, s in inbound.items() if s.heard}, {p for p, s in inbound.items() if s.lossy or s.chased})

    def pending_epochs(self, peer: int, after: int, timeout_s: float, on_stale=None) -> list[int]:
        """Epochs beyond `after` that `peer` has sent datagrams of (oldest first), waiting up to timeout_s
        for the first; the datagrams stay queued for the gathers that follow. Answers NACKs and probes
        meanwhile; older datagrams go to on_stale."""
        self._pend(self._receive(timeout_s), peer, after, on_stale)
        return sorted({h.epoch for h, _, _ in self._early if h.sender == peer and h.epoch > after})

    def _pend(self, arrivals, peer: int, after: int, on_stale) -> None:
        """pending_epochs' handling of each (header, payload, address) that arrived."""
        for header, payload, address in arrivals:
            if header.kind == wire.NACK:
                self._answer_nack(header, payload)
            elif self._answer_probe(header, payload, address):
                continue
            elif header.sender == peer and header.epoch > after:
                self._keep_early(header, payload, address)
            elif header.sender == peer and on_stale is not None:
                self.stats[peer].rejected["stale"] += 1
                on_stale(header, address)

    def request_all(self, epoch: int, peer: int, n_values: int | None, dtype: int = wire.FLOAT32) -> None:
        """A NACK for every chunk of a vector we expect but have not seen a chunk of (its sender has it);
        n_values None: size unknown, ask for as many chunks as one NACK can name."""
        if peer not in self.peers:
            return
        count = wire.chunk_count(n_values, dtype) if n_values is not None else wire.MAX_PAYLOAD // 2
        self._sendto(self.pack(wire.NACK, dtype, epoch, 0, 1, np.arange(count, dtype="<u2").tobytes()[:wire.MAX_PAYLOAD]),
                     self.peers[peer])
        self.stats[peer].nacks_sent += 1
