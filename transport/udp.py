"""UDP synchronization: send a vector as chunks, gather vectors from peers until complete or a deadline.

One `UdpEndpoint` per process. `send_vector` cuts a float vector into chunks (wire.py), optionally
adds XOR parity chunks (one per `parity_group` data chunks) and keeps the chunks of recent epochs so
that it can answer NACKs. `gather` waits for the vectors of one epoch from a set of peers, one
`Inbound` state per peer, as a `GatherPolicy` says:

- without NACKs: it returns when everything is in or the deadline passes; missing chunks are
  zero-filled and reported in the per-peer masks;
- with NACKs (the fast reliable path): single losses per parity group are repaired from parity at
  once, and the sender is asked for what is still missing (a NACK listing chunk indices) after a
  short gap timer, retrying every `nack_retry_s`, until complete or the deadline. Critical peers get
  the hard deadline.

Where a peer is (`peers`) comes from the control plane, never from a datagram: NACKs go there, and a
NACK is answered by sending the chunks again to where the vector first went. Late packets of past
epochs, duplicates, packets of future epochs, and anything `wire.unpack` rejects are counted per
reason and dropped; nothing a peer sends can raise out of `gather`. While gathering, the endpoint
also answers NACKs for vectors it sent and echoes link probes.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from . import wire

RECV_BUFFER_BYTES = 4 << 20
PARITY_PREFIX = struct.Struct("<H")  # data chunks covered by a parity chunk
SENT_VECTORS_KEPT = 512  # vectors kept for NACKs (a late agent may ask for an input it missed)
EARLY_KEPT = 4096  # datagrams of future epochs held for their gather


log = logging.getLogger("halo.transport")


@dataclass
class PeerStats:
    chunks_expected: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    chunks_received: int = 0
    chunks_missing: int = 0  # zero-filled at a deadline
    chunks_recovered_parity: int = 0
    chunks_recovered_nack: int = 0
    nacks_sent: int = 0
    nacks_answered: int = 0
    rejected: dict = field(default_factory=lambda: defaultdict(int))  # reason -> count
    sync_ms: deque = field(default_factory=lambda: deque(maxlen=1000))  # recent gather times involving the peer

    @property
    def observed_plr(self) -> float:
        """Chunks that did not arrive on their first transmission, over chunks expected."""
        lost = self.chunks_missing + self.chunks_recovered_parity + self.chunks_recovered_nack
        return lost / self.chunks_expected if self.chunks_expected else 0.0

    def to_json(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k not in ("rejected", "sync_ms")}
        out["rejected"] = dict(self.rejected)
        out["observed_plr"] = self.observed_plr
        if self.sync_ms:
            out["sync_ms_p50"] = float(np.percentile(self.sync_ms, 50))
            out["sync_ms_p99"] = float(np.percentile(self.sync_ms, 99))
        return out


@dataclass(frozen=True)
class GatherPolicy:
    """How one gather treats its peers (the sync policy of halo/sync/modes.py decides the sets)."""

    deadline_s: float = 0.010  # peers not in `critical` stop being waited for after this
    hard_deadline_s: float | None = None  # peers in `critical` get this long (None: the deadline)
    critical: frozenset = frozenset()
    nack: frozenset | bool = False  # peers whose holes are NACKed (True: every peer)
    silent_s: float | None = None  # a peer owed data that has sent nothing for this long is chased (on_silent)
    stop_on_newer: bool = False  # return as soon as an expected peer sends a newer epoch (it has moved on)
    gap_s: float = 0.0005  # NACK this long after the last chunk when the burst's tail has not come
    nack_retry_s: float = 0.001


@dataclass
class GatherResult:
    values: dict[int, np.ndarray]  # peer -> vector (missing chunks zero-filled)
    masks: dict[int, np.ndarray]  # peer -> bool per chunk, True = arrived (or recovered)
    done_s: dict[int, float] = field(default_factory=dict)  # peer -> seconds until its vector was complete
    heard: set = field(default_factory=set)  # peers that sent at least one valid datagram of the epoch

    @property
    def complete(self) -> bool:
        return all(m.all() for m in self.masks.values())

    def delivered_fraction(self) -> float:
        total = sum(len(m) for m in self.masks.values())
        return sum(int(m.sum()) for m in self.masks.values()) / total if total else 1.0


class Inbound:
    """One peer's vector of one epoch as it arrives: chunks, parity, timers, what is still missing."""

    def __init__(self, peer: int, n_values: int | None, dtype: int, end: float, nack: bool, silent_at: float):
        self.peer, self.dtype, self.end, self.nack = peer, dtype, end, nack
        self.per = wire.values_per_chunk(dtype)
        self.count = None if n_values is None else wire.chunk_count(n_values, dtype)  # None: learn from chunks
        self.values = np.zeros(n_values or 0, dtype=np.float32)
        self.mask = np.zeros(self.count if self.count is not None else 1, dtype=bool)
        self.payloads: dict[int, bytes] = {}
        self.parities: dict[int, tuple[int, bytes]] = {}  # first chunk of a group -> (group size, XOR)
        self.heard = False
        self.nacked = False
        self.completed_at: float | None = None
        self.next_nack = float("inf")  # armed by the first chunk: never NACK blindly
        self.next_silent = silent_at

    @property
    def complete(self) -> bool:
        return bool(self.mask.all())

    def owed(self, now: float) -> bool:
        return not self.complete and now < self.end

    def accept(self, header: wire.Header, payload: bytes, stats: PeerStats, late: bool) -> None:
        """Take one valid datagram of this epoch from this peer; problems are counted, never raised."""
        if self.count is None and header.dtype == self.dtype and header.count > 0:
            self.count = header.count  # the size is what the sender's chunks say (whole chunks)
            self.values = np.zeros(header.count * self.per, dtype=np.float32)
            self.mask = np.zeros(header.count, dtype=bool)
        if header.dtype != self.dtype or header.count != self.count or header.index >= self.count:
            stats.rejected["malformed"] += 1
            return
        self.heard = True
        if late:
            stats.rejected["late"] += 1  # past its deadline a peer's data only says it is alive
            return
        if header.kind == wire.PARITY:
            size = PARITY_PREFIX.unpack_from(payload)[0] if len(payload) >= PARITY_PREFIX.size else 0
            if not 0 < size <= self.count:
                stats.rejected["malformed"] += 1
                return
            self.parities[header.index] = (size, payload[PARITY_PREFIX.size:])
        elif self.mask[header.index]:
            stats.rejected["duplicate"] += 1
            return
        elif not self._store(header.index, payload, stats):
            return
        else:
            stats.chunks_received += 1
            stats.chunks_recovered_nack += int(self.nacked)
        stats.chunks_recovered_parity += self._repair_with_parity(stats)

    def _store(self, index: int, payload: bytes, stats: PeerStats) -> bool:
        n = min(self.per, len(self.values) - index * self.per)
        try:
            self.values[index * self.per:index * self.per + n] = wire.decode_values(payload, self.dtype, n)
        except wire.WireError as e:
            stats.rejected[e.reason] += 1
            return False
        self.mask[index] = True
        self.payloads[index] = payload
        return True

    def _repair_with_parity(self, stats: PeerStats) -> int:
        """Parity groups with exactly one chunk missing and their parity present: XOR it back."""
        repaired = 0
        for start, (size, parity) in list(self.parities.items()):
            members = range(start, min(self.count, start + size))
            missing = [i for i in members if not self.mask[i]]
            if len(missing) != 1:
                continue
            xor = np.frombuffer(parity, dtype=np.uint8).copy()
            for j in members:
                if j != missing[0]:
                    p = np.frombuffer(self.payloads[j], dtype=np.uint8)
                    if len(p) > len(xor):
                        break
                    xor[:len(p)] ^= p
            else:
                n = min(self.per, len(self.values) - missing[0] * self.per)
                length = wire.payload_bytes(n, self.dtype)
                if length <= len(xor) and self._store(missing[0], xor[:length].tobytes(), stats):
                    repaired += 1
        return repaired

    def arm_nack(self, header: wire.Header, now: float, gap_s: float) -> None:
        """The burst's tail came with holes: NACK now; else after a short gap without news."""
        if not self.nack or self.complete:
            return
        last = header.index >= self.count - 1 if header.kind == wire.DATA else True
        self.next_nack = now if last else min(self.next_nack, now + gap_s)

    def missing(self) -> np.ndarray:
        return np.flatnonzero(~self.mask).astype("<u2")


class UdpEndpoint:
    def __init__(self, key: bytes, session: int, node_id: int, bind: tuple[str, int] = ("127.0.0.1", 0),
                 recv_buffer: int = RECV_BUFFER_BYTES):
        if len(key) != wire.KEY_BYTES:
            raise ValueError(f"the cluster key must be {wire.KEY_BYTES} bytes")
        self.key, self.session, self.node_id = key, session, node_id
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.recv_buffer = self._grow_buffer(recv_buffer)
        if self.recv_buffer < recv_buffer:
            log.warning("UDP receive buffer capped at %d bytes (asked %d): an incast burst may overflow it; "
                        "raise net.core.rmem_max or run as root", self.recv_buffer, recv_buffer)
        self.sock.bind(bind)
        self.address = self.sock.getsockname()
        self.stats: dict[int, PeerStats] = defaultdict(PeerStats)
        self.sent: OrderedDict[tuple[int, int], tuple[tuple, list[bytes]]] = OrderedDict()  # (epoch, dest) -> chunks
        self._scratch = bytearray(wire.MAX_DATAGRAM + 1)
        self._early: list[tuple[wire.Header, bytes, tuple]] = []  # datagrams of epochs not gathered yet
        self.probe_replies: list[tuple[int, float, int]] = []  # (sequence, arrival time, bytes)
        self.send_hook = None  # tests and the loss injector may wrap sendto
        self.peers: dict[int, tuple] = {}  # peer id -> its address, from the control plane (never from datagrams)

    def _grow_buffer(self, wanted: int) -> int:
        """Ask for a receive buffer big enough for an incast burst; report what the kernel granted."""
        for option in (getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF):
            if option is None:
                continue
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, option, wanted)
                break
            except OSError:
                continue
        return self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2  # Linux reports double

    def close(self) -> None:
        self.sock.close()

    # ---- sending -------------------------------------------------------------------------------------
    def _sendto(self, datagram: bytes, address) -> None:
        try:
            if self.send_hook is not None:
                self.send_hook(self.sock, datagram, address)
            else:
                self.sock.sendto(datagram, address)
        except (BlockingIOError, InterruptedError, PermissionError, OSError):
            pass  # a full buffer or a local drop is a lost packet; the protocol copes

    def send_vector(self, address, peer: int, epoch: int, values: np.ndarray, dtype: int = wire.FLOAT32,
                    parity_group: int = 0) -> int:
        """Send values as chunks (+ parity), remember them for NACKs; returns datagrams sent."""
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        per = wire.values_per_chunk(dtype)
        count = wire.chunk_count(len(values), dtype)
        payloads = [wire.encode_values(values[i * per:(i + 1) * per], dtype) for i in range(count)]
        datagrams = [wire.pack(wire.Header(wire.DATA, dtype, self.node_id, self.session, epoch, i, count, 0), p, self.key)
                     for i, p in enumerate(payloads)]
        parity = []
        if parity_group > 0:  # parity chunk: index = first chunk of its group, payload = group size + XOR
            for start in range(0, count, parity_group):
                group = payloads[start:start + parity_group]
                xor = np.zeros(max(len(p) for p in group), dtype=np.uint8)
                for p in group:
                    xor[:len(p)] ^= np.frombuffer(p, dtype=np.uint8)
                body = PARITY_PREFIX.pack(len(group)) + xor.tobytes()
                parity.append(wire.pack(wire.Header(wire.PARITY, dtype, self.node_id, self.session, epoch, start,
                                                    count, 0), body, self.key))
        for d in datagrams + parity:
            self._sendto(d, address)
        self.stats[peer].sent_bytes += sum(len(d) for d in datagrams + parity)
        self.sent[(epoch, peer)] = (address, datagrams)
        while len(self.sent) > SENT_VECTORS_KEPT:
            self.sent.popitem(last=False)
        return len(datagrams) + len(parity)

    # ---- receiving -----------------------------------------------------------------------------------
    def _receive(self, timeout_s: float):
        """Yield (header, payload, address) of valid datagrams that arrive within timeout_s."""
        ready, _, _ = select.select([self.sock], [], [], max(timeout_s, 0.0))
        if not ready:
            return
        while True:
            try:
                n, address = self.sock.recvfrom_into(self._scratch)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                header, payload = wire.unpack(memoryview(self._scratch)[:n], self.key, self.session)
            except wire.WireError as e:
                self.stats[-1].rejected[e.reason] += 1
                continue
            self.stats[header.sender].received_bytes += n
            yield header, bytes(payload), address

    def _answer_nack(self, header: wire.Header, payload: bytes) -> None:
        """Send the chunks a NACK names again, to where the vector went (never to where the NACK came from)."""
        entry = self.sent.get((header.epoch, header.sender))
        if entry is None or len(payload) % 2:
            self.stats[header.sender].rejected["nack_unknown"] += 1
            return
        address, datagrams = entry
        for index in np.frombuffer(payload, dtype="<u2"):
            if index < len(datagrams):
                self._sendto(datagrams[index], address)
        self.stats[header.sender].nacks_answered += 1

    def _answer_probe(self, header: wire.Header, payload: bytes, address) -> bool:
        """Echo probe requests; returns True when the datagram was a probe (handled)."""
        if header.kind != wire.PROBE:
            return False
        if header.index == 0:
            echo = wire.Header(wire.PROBE, header.dtype, self.node_id, self.session, header.epoch, 1, 2, 0)
            self._sendto(wire.pack(echo, payload, self.key), address)
        else:
            self.probe_replies.append((header.epoch, time.perf_counter(), len(payload)))
        return True

    def serve(self, duration_s: float) -> None:
        """Answer NACKs and probes (and drop other traffic) for duration_s (0: what is already queued)."""
        end = time.perf_counter() + duration_s
        while True:
            left = end - time.perf_counter()
            for header, payload, address in self._receive(max(left, 0.0)):
                if header.kind == wire.NACK:
                    self._answer_nack(header, payload)
                else:
                    self._answer_probe(header, payload, address)
            if left <= 0:
                return

    def gather(self, epoch: int, expected: dict[int, int | None], dtype: int = wire.FLOAT32,
               policy: GatherPolicy = GatherPolicy(), on_silent=None, on_stale=None) -> GatherResult:
        """Wait for one epoch's vectors: expected maps peer id -> number of values, or None when the receiver
        cannot know it (the sender pads to whole chunks and the count says the size). Per peer the gather
        ends when its vector is complete or at its deadline (policy); what is already queued when it starts
        arrived in time, whatever the clock says. `on_silent(peer)` chases a peer still owed data that has
        sent nothing for policy.silent_s (again every silent_s); `on_stale(header, address)` sees datagrams
        of older epochs (a peer re-sending an input we already answered)."""
        start = time.perf_counter()
        hard = start + (policy.hard_deadline_s if policy.hard_deadline_s is not None else policy.deadline_s)
        silent_at = start + policy.silent_s if on_silent and policy.silent_s else float("inf")
        inbound = {p: Inbound(p, n, dtype, hard if p in policy.critical else start + policy.deadline_s,
                              policy.nack is True or p in (policy.nack or ()), silent_at) for p, n in expected.items()}
        early, self._early = self._early, []
        drained, newer = False, False
        while not newer:
            now = time.perf_counter()
            waiting = [s for s in inbound.values() if s.owed(now)]
            if not waiting and drained:
                break
            wake = min([s.end for s in waiting] + [s.next_nack for s in waiting]
                       + [s.next_silent for s in waiting if not s.heard] or [now])
            arrivals = early + list(self._receive(0.0)) if not drained else early or self._receive(wake - now)
            early, on_time, drained = [], not drained, True
            for header, payload, address in arrivals:
                newer |= self._take(epoch, header, payload, address, inbound, on_time, on_stale, policy)
            now = time.perf_counter()
            for state in waiting:
                if not state.heard and now >= state.next_silent:
                    on_silent(state.peer)
                    state.next_silent = now + policy.silent_s
                if not state.complete and now >= state.next_nack and state.peer in self.peers:
                    self._nack(epoch, state)
                    state.next_nack = now + policy.nack_retry_s
        return self._close_gather(start, inbound)

    def _take(self, epoch: int, header: wire.Header, payload: bytes, address, inbound: dict[int, Inbound],
              on_time: bool, on_stale, policy: GatherPolicy) -> bool:
        """Route one datagram during a gather; True when an expected peer has moved on to a newer epoch."""
        if header.kind == wire.NACK:
            self._answer_nack(header, payload)
            return False
        if self._answer_probe(header, payload, address):
            return False
        stats = self.stats[header.sender]
        if header.epoch < epoch:
            stats.rejected["stale"] += 1
            if on_stale is not None:
                on_stale(header, address)
            return False
        if header.epoch > epoch:  # a later synchronization: keep it for that gather
            self._keep_early(header, payload, address)
            return policy.stop_on_newer and header.sender in inbound
        state = inbound.get(header.sender)
        if state is None:
            stats.rejected["unexpected"] += 1
            return False
        now = time.perf_counter()
        state.accept(header, payload, stats, late=not on_time and now > state.end)
        if state.complete and state.completed_at is None:
            state.completed_at = now
        state.arm_nack(header, now, policy.gap_s)
        return False

    def _keep_early(self, header: wire.Header, payload: bytes, address) -> None:
        if len(self._early) < EARLY_KEPT:
            self._early.append((header, payload, address))
        else:
            self.stats[header.sender].rejected["early_overflow"] += 1

    def _nack(self, epoch: int, state: Inbound) -> None:
        datagram = wire.pack(wire.Header(wire.NACK, state.dtype, self.node_id, self.session, epoch, 0, 1, 0),
                             state.missing().tobytes()[:wire.MAX_PAYLOAD], self.key)
        self._sendto(datagram, self.peers[state.peer])
        self.stats[state.peer].nacks_sent += 1
        state.nacked = True

    def _close_gather(self, start: float, inbound: dict[int, Inbound]) -> GatherResult:
        waited_ms = 1e3 * (time.perf_counter() - start)
        for peer, state in inbound.items():
            stats = self.stats[peer]
            stats.chunks_missing += int((~state.mask).sum()) if state.count is not None else 0
            stats.chunks_expected += state.count or 0
            stats.sync_ms.append(waited_ms)
        return GatherResult({p: s.values for p, s in inbound.items()}, {p: s.mask for p, s in inbound.items()},
                            {p: s.completed_at - start for p, s in inbound.items() if s.completed_at is not None},
                            {p for p, s in inbound.items() if s.heard})

    def pending_epochs(self, peer: int, after: int, timeout_s: float, on_stale=None) -> list[int]:
        """Epochs beyond `after` that `peer` has sent datagrams of (oldest first), waiting up to timeout_s
        for the first; the datagrams stay queued for the gathers that follow. Answers NACKs and probes
        meanwhile; older datagrams go to on_stale."""
        for header, payload, address in self._receive(timeout_s):
            if header.kind == wire.NACK:
                self._answer_nack(header, payload)
            elif self._answer_probe(header, payload, address):
                continue
            elif header.sender == peer and header.epoch > after:
                self._keep_early(header, payload, address)
            elif header.sender == peer and on_stale is not None:
                self.stats[peer].rejected["stale"] += 1
                on_stale(header, address)
        return sorted({h.epoch for h, _, _ in self._early if h.sender == peer and h.epoch > after})

    def request_all(self, epoch: int, peer: int, n_values: int | None, dtype: int = wire.FLOAT32) -> None:
        """A NACK for every chunk of a vector we expect but have not seen a chunk of (its sender has it);
        n_values None: size unknown, ask for as many chunks as one NACK can name."""
        if peer not in self.peers:
            return
        count = wire.chunk_count(n_values, dtype) if n_values is not None else wire.MAX_PAYLOAD // 2
        datagram = wire.pack(wire.Header(wire.NACK, dtype, self.node_id, self.session, epoch, 0, 1, 0),
                             np.arange(count, dtype="<u2").tobytes()[:wire.MAX_PAYLOAD], self.key)
        self._sendto(datagram, self.peers[peer])
        self.stats[peer].nacks_sent += 1

    def resend(self, epoch: int, peer: int) -> bool:
        """Send again every chunk of a vector sent to peer in `epoch` (it asked without knowing what it
        missed); False when that vector is no longer kept."""
        entry = self.sent.get((epoch, peer))
        if entry is None:
            return False
        address, datagrams = entry
        for d in datagrams:
            self._sendto(d, address)
        return True
