"""UDP synchronization: send a vector as chunks, gather vectors from peers until complete or a deadline.

One `UdpEndpoint` per process. `send_vector` cuts a float vector into chunks (wire.py), packs them
once whatever the number of recipients, optionally adds parity chunks (P, or P and Q: erasure.py; per
`parity_group` data chunks, once the link has shown loss) and keeps the chunks of recent epochs so that it can
answer NACKs. `gather` waits for the vectors of one epoch from a set of peers, one `Inbound` state per
peer, as a `GatherPolicy` says:

- without NACKs: it returns when everything is in or the deadline passes; missing chunks are
  zero-filled and reported in the per-peer masks;
- with NACKs (the fast reliable path): losses a parity group's P and Q can rebuild (two per group)
  are repaired at once, and the sender is asked for what is still missing (a NACK listing chunk indices) after a
  short gap timer, retrying every `nack_retry_s`, until complete or the deadline. Critical peers get
  the hard deadline; a peer that has shown no loss (silent, or arriving in order) gets the looser
  `late_deadline_s`: a partial is dropped for being late only well past the usual turnaround.

Where a peer is (`peers`) comes from the control plane, never from a datagram: NACKs go there, and a
NACK or a re-send goes to where the vector first went, with fresh counters. Every datagram carries a
counter under its tag, so a replayed one is refused before it can change anything. Late packets of
past epochs, duplicates, replays, packets of future epochs, and anything `wire.Codec.unpack` rejects
are counted per reason and dropped; nothing a peer sends can raise out of `gather`. While gathering,
the endpoint also answers NACKs for vectors it sent and echoes link probes.
"""

from __future__ import annotations

import logging
import math
import select
import socket
import struct
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from halo.host.cores import dedicated_cores

from halo.transport import erasure, wire

RECV_BUFFER_BYTES = 4 << 20
PARITY_PREFIX = struct.Struct("<BB")  # data chunks covered by a parity chunk, parity chunks of its group
SENT_VECTORS_KEPT = 512  # vectors kept for NACKs (a late agent may ask for an input it missed)
EARLY_KEPT = 4096  # datagrams of future epochs held for their gather
PARITY_LOSS_THRESHOLD = 0.005  # parity chunks are sent once a link has lost more than this fraction
FD_SETSIZE = 1024

log = logging.getLogger("halo.transport")

BUSY_POLL_MODES = ("auto", "on", "off")
BUSY_POLL_S = 0.005  # how long a wait spins before it sleeps: more than a decode round's gap, far less than a pause


def set_busy_poll(mode: str) -> bool:
    """Whether this process's waits for datagrams spin (BUSY_POLL_S) before they sleep: "on", "off", or "auto"
    (on where the process has dedicated cores). A sleeping core takes tens of microseconds to wake on a VM, at both
    ends of every round; spinning on a core another node needs would slow that node, so auto never spins unpinned.
    Returns what was set (False also where the C transport is not built: nothing to spin in)."""
    if mode not in BUSY_POLL_MODES:
        raise ValueError(f"busy poll: one of {', '.join(BUSY_POLL_MODES)}, not {mode!r}")
    spin = mode == "on" or mode == "auto" and dedicated_cores()
    if wire._datagrams is None:
        if mode == "on":
            log.warning("busy polling needs the C transport (transport/_datagrams.c), which this install lacks")
        return False
    wire._datagrams.set_busy_poll(BUSY_POLL_S if spin else 0.0)
    return spin


def spin_readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether sock became readable within timeout_s, spinning as set_busy_poll set (sleeping where it is off)."""
    if wire._datagrams is None:
        return bool(select.select([sock], [], [], timeout_s)[0])
    return wire._datagrams.readable(sock.fileno(), timeout_s)


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
    resends: int = 0  # whole vectors sent again on request
    chunks_sent: int = 0  # datagrams of vectors we sent the peer (parity included)
    chunks_sent_again: int = 0  # of those, sent again because the peer NACKed them (whole-vector resends: not
    # counted, a chase follows silence, which a slow peer shows as well as a lossy link)
    rejected: dict = field(default_factory=lambda: defaultdict(int))  # reason -> count
    sync_ms: deque = field(default_factory=lambda: deque(maxlen=1000))  # recent gather times involving the peer

    @property
    def observed_plr(self) -> float:
        """Chunks that did not arrive on their first transmission, over chunks expected."""
        lost = self.chunks_missing + self.chunks_recovered_parity + self.chunks_recovered_nack
        return lost / self.chunks_expected if self.chunks_expected else 0.0

    @property
    def outbound_plr(self) -> float:
        """Chunks the peer asked for again, over chunks sent it: loss on our way to it, as it sees it."""
        return self.chunks_sent_again / self.chunks_sent if self.chunks_sent else 0.0

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

    deadline_s: float = 0.010  # peers not critical, with evidence of loss, stop being waited for after this
    hard_deadline_s: float | None = None  # critical peers get this long (None: the deadline)
    late_deadline_s: float | None = None  # peers not critical and without evidence of loss (None: the deadline)
    critical: frozenset = frozenset()
    nack: frozenset | bool = False  # peers whose holes are NACKed (True: every peer)
    silent_s: float | None = None  # a peer owed data that has sent nothing for this long is chased (on_silent)
    stop_on_newer: bool = False  # return as soon as an expected peer sends a newer epoch (it has moved on)
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
                 "parity_expected", "whole_bytes")

    def __init__(self, peer: int, n_values: int | None, dtype: int, end: float, loss_end: float, nack: bool,
                 silent_at: float, parity_expected: bool = False):
        self.peer, self.dtype, self.nack, self.n_values = peer, dtype, nack, n_values
        self.parity_expected = parity_expected  # the peer has sent parity this session: wait for it at the tail
        self.end, self.loss_end = end, loss_end  # until when we wait: without / with evidence of loss
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

    def until(self) -> float:
        return self.loss_end if self.lossy else self.end

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
        self.heard = True
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


@dataclass
class Sent:
    """A vector we sent, kept to answer NACKs and requests to send it again."""

    dtype: int
    payloads: list[bytes]
    recipients: dict[int, tuple]  # peer id -> the address it went to


@dataclass
class WholeRun:
    """One whole vector in a batch of datagrams (UdpEndpoint._whole_runs)."""

    sender: int
    epoch: int
    dtype: int
    count: int
    payloads: list = field(default_factory=list)  # the data chunks' payloads, in order
    counters: list = field(default_factory=list)  # every datagram's, parity included
    bytes: int = 0
    parity: bool = False
    stale: tuple | None = None  # (header, address) of a stale parity datagram, alone in its run (count 0)


class UdpEndpoint:
    def __init__(self, key: bytes, session: int, node_id: int, bind: tuple[str, int] = ("127.0.0.1", 0),
                 recv_buffer: int = RECV_BUFFER_BYTES, fast: bool = True):
        self.codec = wire.Codec(key, fast)  # fast: datagrams packed, sent, read and checked in C where it is built
        self.fast = fast
        self.session, self.node_id = session, node_id
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.recv_buffer = self._grow_buffer(recv_buffer)
        if self.recv_buffer < recv_buffer:
            log.warning("UDP receive buffer capped at %d bytes (asked %d): an incast burst may overflow it; "
                        "raise net.core.rmem_max or run as root", self.recv_buffer, recv_buffer)
        self.sock.bind(bind)
        self.address = self.sock.getsockname()
        self.stats: dict[int, PeerStats] = defaultdict(PeerStats)
        self.sent: OrderedDict[int, Sent] = OrderedDict()  # epoch -> what we sent in it
        self.counter = 0  # datagrams packed in this session
        self.windows: dict[int, wire.ReplayWindow] = defaultdict(wire.ReplayWindow)  # sender -> counters seen
        self._scratch = bytearray(wire.MAX_DATAGRAM + 1)
        self._view = memoryview(self._scratch)
        self._early: list[tuple[wire.Header, bytes, tuple]] = []  # datagrams of epochs not gathered yet
        self.probe_replies: list[tuple[int, float, int]] = []  # (sequence, arrival time, bytes)
        self.send_hook = None  # tests and the loss injector may wrap sendto
        self.peers: dict[int, tuple] = {}  # peer id -> its address, from the control plane (never from datagrams)
        self.parity_from: set[int] = set()  # peers that have sent parity this session (wait for it at the tail)
        self.segment = True  # UDP GSO on our sends (SyncSettings.udp_gso): the C path's sendmany, where the kernel has it
        self.whole_vectors = True  # a read batch of whole vectors taken a vector at a time (SyncSettings.whole_vectors)

    @property
    def _sends_in_c(self) -> bool:
        """Whether vectors go out through the C path: built, and no send hook (tests, the loss injector) in the way."""
        return self.codec.state is not None and self.send_hook is None

    @property
    def segmenting(self) -> bool:
        """Whether our sends go out segmented now (UDP GSO): asked for, through the C path, and the kernel taking it."""
        return self.segment and self._sends_in_c and wire._datagrams.segmenting()

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

    def join(self, session: int, node_id: int, key: bytes | None = None) -> None:
        """A new session: its id, our sender id in it, its key (wire.session_key; None: keep ours), no counters seen
        yet, fresh statistics."""
        if key is not None:
            self.codec = wire.Codec(key, self.fast)
        self.session, self.node_id = session, node_id
        self.windows.clear()
        self._early.clear()
        self.stats.clear()
        self.parity_from.clear()

    def rejections(self) -> dict[str, int]:
        """Every datagram refused, by reason, whoever sent it (-1: nothing authenticated, e.g. bad tags)."""
        out: dict[str, int] = defaultdict(int)
        for stats in self.stats.values():
            for reason, count in stats.rejected.items():
                out[reason] += count
        return dict(sorted(out.items()))

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

    def _send_all(self, datagrams: list[bytes], addresses: list[tuple]) -> None:
        """Every datagram to every address: one sendmmsg() in C where it can (with `segment`, a run of equal-sized ones
        to an address as one UDP_SEGMENT message, cut into the same datagrams by the kernel), else one sendto() apiece."""
        if self._sends_in_c and wire._datagrams.sendmany(self.sock.fileno(), datagrams, addresses, self.segment):
            return
        for address in addresses:
            for d in datagrams:
                self._sendto(d, address)

    def pack(self, kind: int, dtype: int, epoch: int, index: int, count: int, payload: bytes) -> bytes:
        """One datagram of ours, with the next counter."""
        self.counter += 1
        return self.codec.pack(kind, dtype, self.node_id, self.session, epoch, self.counter, index, count, payload)

    def send_vector(self, recipients: dict[int, tuple], epoch: int, values: np.ndarray, dtype: int = wire.FLOAT32,
                    parity_group: int = 0, parity_chunks: int = 2) -> int:
        """Send values as chunks to every recipient (peer id -> address), packed once, with `parity_chunks`
        parity chunks (1: P, XOR; 2: P and Q, erasure.py) per `parity_group` data chunks (0: none); remember
        them for NACKs. Returns datagrams per recipient."""
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        payloads = wire.chunk_payloads(values, dtype)
        datagrams = self.codec.pack_chunks(wire.DATA, dtype, self.node_id, self.session, epoch, self.counter + 1, payloads)
        self.counter += len(payloads)
        if parity_group:
            datagrams += self._parity(dtype, epoch, payloads, parity_group, parity_chunks)
        self._send_all(datagrams, list(recipients.values()))
        size = sum(map(len, datagrams))
        for peer in recipients:
            self.stats[peer].sent_bytes += size
            self.stats[peer].chunks_sent += len(datagrams)
        self.sent[epoch] = Sent(dtype, payloads, dict(recipients))
        while len(self.sent) > SENT_VECTORS_KEPT:
            self.sent.popitem(last=False)
        return len(datagrams)

    def lossy(self, peers) -> bool:
        """Whether any of these peers' links has lost more than PARITY_LOSS_THRESHOLD of its chunks, either way
        (what it sent us; what we sent it, by its NACKs: a peer that only receives from us over UDP shows its
        losses no other way): parity then pays for itself (at 0 % loss it is a quarter more datagrams for
        nothing)."""
        return any(max(self.stats[p].observed_plr, self.stats[p].outbound_plr) > PARITY_LOSS_THRESHOLD for p in peers)

    def _parity(self, dtype: int, epoch: int, payloads: list[bytes], group: int, chunks: int) -> list[bytes]:
        """P (and Q) per `group` data chunks: index = the group's first chunk, payload = prefix + parity."""
        out = []
        for start, size, here in erasure.groups(len(payloads), group, chunks):
            members = payloads[start:start + size]
            prefix = PARITY_PREFIX.pack(size, here)
            for kind, parity in zip(wire.PARITIES, erasure.parities(members, here)):
                out.append(self.pack(kind, dtype, epoch, start, len(payloads), prefix + parity))
        return out

    def _send_again(self, epoch: int, peer: int, indices) -> int | None:
        """Chunks of a vector we sent to `peer`, again, with fresh counters, to where it first went: how many
        (None: that vector is no longer kept, or never went to `peer`)."""
        entry = self.sent.get(epoch)
        if entry is None or peer not in entry.recipients:
            return None
        count = len(entry.payloads)
        datagrams = [self.pack(wire.DATA, entry.dtype, epoch, int(i), count, entry.payloads[i])
                     for i in indices if 0 <= i < count]
        self._send_all(datagrams, [entry.recipients[peer]])  # one sendmmsg (a run of them one segmented message)
        return len(datagrams)

    def resend(self, epoch: int, peer: int) -> bool:
        """Send again every chunk of a vector sent to peer in `epoch` (it asked without knowing what it
        missed); False when that vector is no longer kept."""
        entry = self.sent.get(epoch)
        sent = entry is not None and self._send_again(epoch, peer, range(len(entry.payloads))) is not None
        self.stats[peer].resends += sent
        return sent

    # ---- receiving -----------------------------------------------------------------------------------
    def _readable(self, timeout_s: float) -> bool:
        """Wait for a datagram: select() has sub-millisecond timeouts but only takes descriptors below
        FD_SETSIZE (1024); a process holding many (compact kernels, models) falls back to poll (1 ms steps)."""
        timeout_s = max(timeout_s, 0.0)
        if self.sock.fileno() < FD_SETSIZE:
            return bool(select.select([self.sock], [], [], timeout_s)[0])
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(math.ceil(timeout_s * 1000)))

    def _receive(self, timeout_s: float):
        """Yield (header, payload, address) of valid, fresh datagrams that arrive within timeout_s."""
        if self.codec.state is not None:
            yield from self._receive_fast(timeout_s)
            return
        if not self._readable(timeout_s):
            return
        while True:
            try:
                n, address = self.sock.recvfrom_into(self._scratch)
            except (BlockingIOError, InterruptedError, OSError):
                return
            admitted = self.admit(self._view[:n])
            if admitted is not None:
                yield admitted[0], admitted[1], address

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

    def _receive_fast(self, timeout_s: float):
        """_receive with the datagrams read (recvmmsg) and checked (Codec.unpack's checks) in C, a batch at a time."""
        wait, more = max(timeout_s, 0.0), True
        while more:
            batch = wire._datagrams.receive(self.sock.fileno(), self.codec.state, self.session, wait, wire.Header)
            wait, more = 0.0, len(batch) == wire._datagrams.RECV_BATCH  # fewer: the queue was empty
            yield from self._checked(batch)

    def admit(self, datagram: bytes | memoryview) -> tuple[wire.Header, bytes] | None:
        """One received datagram checked (tag, session, format, counter): (header, payload) when valid and
        fresh, else None with the reason counted. Never raises: this is where attacker bytes come in."""
        try:
            header, payload = self.codec.unpack(datagram, self.session)
        except wire.WireError as e:
            self.stats[-1].rejected[e.reason] += 1
            return None
        return (header, bytes(payload)) if self._fresh(header, len(datagram)) else None

    def _fresh(self, header: wire.Header, size: int) -> bool:
        """A checked datagram's counter against its sender's replay window: False (counted) for a copy of one
        already taken; else its bytes are counted as received."""
        if not self.windows[header.sender].accept(header.counter):
            self.stats[header.sender].rejected["replayed"] += 1
            return False
        self.stats[header.sender].received_bytes += size
        return True

    def _answer_nack(self, header: wire.Header, payload: bytes) -> None:
        """Send the chunks a NACK names again, to where the vector went (never to where the NACK came from)."""
        sent = None if len(payload) % 2 else self._send_again(header.epoch, header.sender,
                                                               np.frombuffer(payload, dtype="<u2"))
        if sent is None:
            self.stats[header.sender].rejected["nack_unknown"] += 1
            return
        self.stats[header.sender].nacks_answered += 1
        self.stats[header.sender].chunks_sent_again += sent  # holes it saw: our way to it loses packets

    def _answer_probe(self, header: wire.Header, payload: bytes, address) -> bool:
        """Echo probe requests from a peer's address as the control plane told it (`peers`), never to whatever address
        a datagram claims (a forged probe made every agent a reflector of 1 KB datagrams); returns True when the
        datagram was a probe (handled)."""
        if header.kind != wire.PROBE:
            return False
        if header.index == 0 and tuple(address) not in self.peers.values():
            self.stats[header.sender].rejected["probe_from_unknown_address"] += 1
        elif header.index == 0:
            self._sendto(self.pack(wire.PROBE, header.dtype, header.epoch, 1, 2, payload), address)
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
        inbound = self._open_inbound(start, expected, dtype, policy, on_silent)
        early, self._early = self._early, []
        drained, newer = False, False
        while not newer:
            now = time.perf_counter()
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

    def _open_inbound(self, start: float, expected: dict, dtype: int, policy: GatherPolicy, on_silent) -> dict:
        hard = start + (policy.hard_deadline_s if policy.hard_deadline_s is not None else policy.deadline_s)
        loss_end = start + policy.deadline_s
        late_end = start + (policy.late_deadline_s if policy.late_deadline_s is not None else policy.deadline_s)
        silent_at = start + policy.silent_s if on_silent and policy.silent_s else float("inf")
        inbound = {}
        for p, n in expected.items():
            critical = p in policy.critical
            inbound[p] = Inbound(p, n, dtype, hard if critical else max(late_end, loss_end),
                                 hard if critical else loss_end, policy.nack is True or p in (policy.nack or ()),
                                 silent_at, p in self.parity_from)
        return inbound

    def _take(self, epoch: int, header: wire.Header, payload: bytes, address, inbound: dict[int, Inbound],
              on_time: bool, on_stale, policy: GatherPolicy) -> bool:
        """Route one datagram during a gather; True when an expected peer has moved on to a newer epoch."""
        kind, sender, h_epoch = header.kind, header.sender, header.epoch
        if kind == wire.NACK:
            self._answer_nack(header, payload)
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

    def whole_vector(self, peer: int, after: int, wanted, dtype: int = wire.FLOAT32,
                     on_stale=None) -> tuple[int, np.ndarray] | None:
        """A round's input in one step, the usual case: nothing waits in Python for a gather (_early) and what is
        queued is exactly one whole vector (`_whole_runs`) of `dtype` from `peer`, of an epoch newer than `after`
        that wanted(epoch) takes. Taken as gather(epoch, {peer: None}, dtype) would take it (replay window,
        statistics): (epoch, values). Otherwise None, and what was read went where pending_epochs sends it (kept for
        the gathers that follow, NACKs and probes answered)."""
        if self._early or self.codec.state is None or not self.whole_vectors:
            return None
        start = time.perf_counter()
        batch = wire._datagrams.receive(self.sock.fileno(), self.codec.state, self.session, 0.0, wire.Header)
        runs = self._whole_runs(batch, after + 1) if len(batch) < wire._datagrams.RECV_BATCH else None
        vectors = [run for run in runs or () if run.stale is None]
        whole = wire.payload_bytes(wire.values_per_chunk(dtype), dtype)
        if len(vectors) != 1 or vectors[0].sender != peer or vectors[0].dtype != dtype or vectors[0].epoch <= after \
                or len(vectors[0].payloads[-1]) != whole or not wanted(vectors[0].epoch):
            self._pend(self._checked(batch), peer, after, on_stale)
            return None
        for run in runs:  # in the order they came, as _pend takes them
            self._take_run(run)
            if run.stale is not None and run.sender == peer and on_stale is not None:
                self.stats[peer].rejected["stale"] += 1
                on_stale(*run.stale)
        run = vectors[0]
        self.stats[peer].chunks_expected += run.count
        self.stats[peer].sync_ms.append(1e3 * (time.perf_counter() - start))
        if run.parity:
            self.parity_from.add(peer)
        raw = b"".join(run.payloads)
        return run.epoch, np.frombuffer(raw, "<f4" if dtype == wire.FLOAT32 else "<f2").astype(np.float32)

    def _checked(self, batch: list):
        """(header, payload, address) of a receive() batch's valid, fresh datagrams; refusals counted."""
        for item in batch:
            if item.__class__ is str:
                self.stats[-1].rejected[item] += 1
                continue
            header, payload, address, size = item
            if self._fresh(header, size):
                yield header, payload, address

    def _whole_runs(self, batch: list, stale_before: int) -> list[WholeRun] | None:
        """A receive() batch as whole vectors one after another, or None when it is anything else. A whole vector:
        every data chunk of one (sender, epoch) once, in index order, all but the last of a whole chunk's size,
        then at most its parity (a prefix Inbound.accept takes), with consecutive counters above the sender's newest
        (as the sender packs a vector: one transmission, nothing sent again).
        Parity of an epoch before `stale_before` (what trails a vector completed in an earlier read) may come
        between them, a run of its own (`stale`). What gathers and polls meet when nothing was lost, reordered or
        repeated: taken a run at a time (_take_run), where each datagram through _take costs ~3 us of Python."""
        runs, i, tops = [], 0, {}
        while i < len(batch):
            if batch[i].__class__ is str:
                return None
            first, _, address, size = batch[i]
            top = tops[first.sender] if first.sender in tops else self.windows[first.sender].top
            if first.kind in wire.PARITIES and first.epoch < stale_before and first.counter > top:
                runs.append(WholeRun(first.sender, first.epoch, first.dtype, 0, counters=[first.counter], bytes=size,
                                     parity=True, stale=(first, address)))
                tops[first.sender] = first.counter
                i += 1
                continue
            if first.kind != wire.DATA or first.index != 0 or first.dtype > wire.FLOAT16 or len(batch) - i < first.count:
                return None
            run = WholeRun(first.sender, first.epoch, first.dtype, first.count)
            whole = wire.payload_bytes(wire.values_per_chunk(first.dtype), first.dtype)
            for item in batch[i:]:
                if item.__class__ is str:
                    return None
                header, payload, _, size = item
                if header.sender != run.sender or header.epoch != run.epoch:
                    break
                at = len(run.counters)
                if (header.counter != top + 1 if at else header.counter <= top) or header.dtype != run.dtype or \
                        header.count != run.count:
                    return None  # (a vector's datagrams are packed one after the other: consecutive counters)
                if at < run.count:
                    if header.kind != wire.DATA or header.index != at or (at < run.count - 1 and len(payload) != whole):
                        return None
                    run.payloads.append(payload)
                elif header.kind not in wire.PARITIES or len(payload) <= PARITY_PREFIX.size or \
                        not 0 < payload[0] <= run.count - header.index:
                    return None
                else:
                    run.parity = True
                top = header.counter
                run.counters.append(top)
                run.bytes += size
            if len(run.payloads) < run.count:
                return None
            tops[run.sender] = top
            runs.append(run)
            i += len(run.counters)
        return runs

    def _take_run(self, run: WholeRun) -> None:
        """A run's datagrams taken as _fresh and accept() take them one by one (replay window, statistics)."""
        self.windows[run.sender].accept_ascending(run.counters)
        stats = self.stats[run.sender]
        stats.received_bytes += run.bytes
        stats.chunks_received += run.count

    def request_all(self, epoch: int, peer: int, n_values: int | None, dtype: int = wire.FLOAT32) -> None:
        """A NACK for every chunk of a vector we expect but have not seen a chunk of (its sender has it);
        n_values None: size unknown, ask for as many chunks as one NACK can name."""
        if peer not in self.peers:
            return
        count = wire.chunk_count(n_values, dtype) if n_values is not None else wire.MAX_PAYLOAD // 2
        self._sendto(self.pack(wire.NACK, dtype, epoch, 0, 1, np.arange(count, dtype="<u2").tobytes()[:wire.MAX_PAYLOAD]),
                     self.peers[peer])
        self.stats[peer].nacks_sent += 1
