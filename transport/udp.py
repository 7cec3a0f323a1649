"""UDP synchronization: send a vector as chunks, gather vectors from peers until complete or a deadline.

One `UdpEndpoint` per process. `send_vector` cuts a float vector into chunks (wire.py), optionally
adds XOR parity chunks (one per `parity_group` data chunks) and keeps the chunks of recent epochs so
that it can answer NACKs. `gather` waits for the vectors of one epoch from a set of peers:

- lossy (nack=False): returns when everything is in or the deadline passes; missing chunks are
  zero-filled and reported in the per-peer masks;
- fast reliable (nack=True): repairs single losses per parity group from parity at once, and asks
  the sender for what is still missing (a NACK listing chunk indices) after a short gap timer,
  retrying every `nack_retry_s`, until complete or the deadline.

Late packets of past epochs, duplicates, packets of future epochs, and anything `wire.unpack`
rejects are counted per reason and dropped; nothing a peer sends can raise out of `gather`.
While gathering, the endpoint also answers NACKs from peers for vectors it sent.
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


@dataclass
class GatherResult:
    values: dict[int, np.ndarray]  # peer -> vector (missing chunks zero-filled)
    masks: dict[int, np.ndarray]  # peer -> bool per chunk, True = arrived (or recovered)
    waited_s: float
    done_s: dict[int, float] = field(default_factory=dict)  # peer -> seconds until its vector was complete
    heard: set = field(default_factory=set)  # peers that sent at least one valid datagram of the epoch

    @property
    def complete(self) -> bool:
        return all(m.all() for m in self.masks.values())

    def delivered_fraction(self) -> float:
        total = sum(len(m) for m in self.masks.values())
        return sum(int(m.sum()) for m in self.masks.values()) / total if total else 1.0


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
        self.peer_addresses: dict[int, tuple] = {}  # sender id -> where its last valid datagram came from

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
            self.peer_addresses[header.sender] = address
            yield header, bytes(payload), address

    def _answer_nack(self, header: wire.Header, payload: bytes, address) -> None:
        entry = self.sent.get((header.epoch, header.sender))
        if entry is None or len(payload) % 2:
            self.stats[header.sender].rejected["nack_unknown"] += 1
            return
        _, datagrams = entry
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
                    self._answer_nack(header, payload, address)
                else:
                    self._answer_probe(header, payload, address)
            if left <= 0:
                return

    def gather(self, epoch: int, expected: dict[int, int | None], dtype: int = wire.FLOAT32,
               deadline_s: float = 0.010, nack: bool | set = False, addresses: dict[int, tuple] | None = None,
               gap_s: float = 0.0005, nack_retry_s: float = 0.001, must_complete=(),
               hard_deadline_s: float | None = None, silent_s: float | None = None, on_silent=None,
               on_stale=None, stop_on_newer: bool = False) -> GatherResult:
        """Wait for one epoch's vectors: expected maps peer id -> number of values, or None when the
        receiver cannot know it (the sender then pads to whole chunks and the count says the size).

        nack: NACK missing chunks (True: every peer; a set: those peers). Per peer the gather ends when
        its vector is complete or at `deadline_s`; peers in `must_complete` (critical traffic) get until
        `hard_deadline_s`; data arriving after a peer's deadline is not used (it still counts as heard). A peer still owed data that has sent
        nothing for `silent_s` triggers `on_silent(peer)` (re-send its input: a NACK needs a first
        chunk), again every `silent_s`. `on_stale(header, address)` sees datagrams of older epochs (a
        peer re-sending input we already answered). `stop_on_newer`: return as soon as an expected peer
        sends a newer epoch (it has moved on; this epoch will not complete)."""
        start = time.perf_counter()
        hard = start + (hard_deadline_s if hard_deadline_s is not None else deadline_s)
        ends = {p: hard if p in must_complete else start + deadline_s for p in expected}
        nacking = set(expected) if nack is True else set(nack or ())
        per = wire.values_per_chunk(dtype)
        counts = {p: None if n is None else wire.chunk_count(n, dtype) for p, n in expected.items()}
        values = {p: np.zeros(n or 0, dtype=np.float32) for p, n in expected.items()}
        masks = {p: np.zeros(c if c is not None else 1, dtype=bool) for p, c in counts.items()}
        heard = {p: False for p in expected}
        payloads: dict[int, dict[int, bytes]] = {p: {} for p in expected}
        parities: dict[int, dict[int, bytes]] = {p: {} for p in expected}
        next_nack = {p: float("inf") for p in expected}  # armed by a peer's first chunk: never NACK blindly
        next_silent = {p: start + silent_s if on_silent and silent_s else float("inf") for p in expected}
        nacked = {p: False for p in expected}
        addresses = dict(addresses or {})
        early, self._early = self._early, []
        newer = False
        done: dict[int, float] = {}

        def owed(p, now):
            if masks[p].all():
                return False
            return now < ends[p]

        drained = False  # what is already queued when the gather starts arrived in time, whatever the clock says
        while not newer:
            now = time.perf_counter()
            waiting = [p for p in expected if owed(p, now)]
            if not waiting and drained:
                break
            wake = min([ends[p] for p in waiting] or [now])
            wake = min([wake] + [next_nack[p] for p in waiting if p in nacking]
                       + [next_silent[p] for p in waiting if not heard[p]])
            if not drained:
                arrivals = early + list(self._receive(0.0))
            else:
                arrivals = early if early else self._receive(wake - now)
            early = []
            on_time = not drained
            drained = True
            for header, payload, address in arrivals:
                peer = header.sender
                if header.kind == wire.NACK:
                    self._answer_nack(header, payload, address)
                    continue
                if self._answer_probe(header, payload, address):
                    continue
                stats = self.stats[peer]
                if header.epoch < epoch:
                    stats.rejected["stale"] += 1
                    if on_stale is not None:
                        on_stale(header, address)
                    continue
                if header.epoch > epoch:  # a later synchronization: keep it for that gather
                    if len(self._early) < EARLY_KEPT:
                        self._early.append((header, payload, address))
                    else:
                        stats.rejected["early_overflow"] += 1
                    newer = newer or (stop_on_newer and peer in expected)
                    continue
                if peer not in expected:
                    stats.rejected["unexpected"] += 1
                    continue
                if counts[peer] is None and header.dtype == dtype and 0 < header.count:
                    counts[peer] = header.count  # the size is what the sender's chunks say (whole chunks)
                    values[peer] = np.zeros(header.count * per, dtype=np.float32)
                    masks[peer] = np.zeros(header.count, dtype=bool)
                if header.dtype != dtype or header.count != counts[peer] or header.index >= counts[peer]:
                    stats.rejected["malformed"] += 1
                    continue
                addresses.setdefault(peer, address)
                heard[peer] = True
                if not on_time and time.perf_counter() > ends[peer] and peer not in must_complete:
                    stats.rejected["late"] += 1  # past its deadline a peer's data only confirms it is alive
                    continue
                if header.kind == wire.PARITY:
                    if len(payload) < PARITY_PREFIX.size:
                        stats.rejected["malformed"] += 1
                        continue
                    (size,) = PARITY_PREFIX.unpack_from(payload)
                    if size == 0 or size > counts[peer]:
                        stats.rejected["malformed"] += 1
                        continue
                    parities[peer][header.index] = (size, payload[PARITY_PREFIX.size:])
                elif masks[peer][header.index]:
                    stats.rejected["duplicate"] += 1
                    continue
                else:
                    n = min(per, len(values[peer]) - header.index * per)
                    try:
                        chunk = wire.decode_values(payload, dtype, n)
                    except wire.WireError as e:
                        stats.rejected[e.reason] += 1
                        continue
                    values[peer][header.index * per:header.index * per + n] = chunk
                    masks[peer][header.index] = True
                    payloads[peer][header.index] = payload
                    stats.chunks_received += 1
                    if nacked[peer]:
                        stats.chunks_recovered_nack += 1
                self._repair_with_parity(peer, values, masks, payloads, parities, dtype, per)
                if masks[peer].all() and peer not in done:
                    done[peer] = time.perf_counter() - start
                if peer in nacking and not masks[peer].all():
                    arrived = time.perf_counter()
                    last = header.index >= counts[peer] - 1 if header.kind == wire.DATA else True
                    # the burst's tail came with holes: ask now; else after a short gap without news
                    next_nack[peer] = arrived if last else min(next_nack[peer], arrived + gap_s)
            now = time.perf_counter()
            for peer in expected:
                if masks[peer].all() or not owed(peer, now):
                    continue
                if not heard[peer] and now >= next_silent[peer]:
                    on_silent(peer)
                    next_silent[peer] = now + silent_s
                if peer not in nacking or now < next_nack[peer] or peer not in addresses:
                    continue
                missing = np.flatnonzero(~masks[peer]).astype("<u2")
                datagram = wire.pack(wire.Header(wire.NACK, dtype, self.node_id, self.session, epoch, 0, 1, 0),
                                     missing.tobytes()[:wire.MAX_PAYLOAD], self.key)
                self._sendto(datagram, addresses[peer])
                self.stats[peer].nacks_sent += 1
                nacked[peer] = True
                next_nack[peer] = now + nack_retry_s
        waited = time.perf_counter() - start
        for peer in expected:
            stats = self.stats[peer]
            stats.chunks_missing += int((~masks[peer]).sum()) if counts[peer] is not None else 0
            stats.chunks_expected += counts[peer] or 0
            stats.sync_ms.append(1e3 * waited)
        return GatherResult(values, masks, waited, done, {p for p, h in heard.items() if h})

    def pending_epochs(self, peer: int, after: int, timeout_s: float, on_stale=None) -> list[int]:
        """Epochs beyond `after` that `peer` has sent datagrams of (oldest first), waiting up to timeout_s
        for the first; the datagrams stay queued for the gathers that follow. Answers NACKs and probes
        meanwhile; older datagrams go to on_stale."""
        for header, payload, address in self._receive(timeout_s):
            if header.kind == wire.NACK:
                self._answer_nack(header, payload, address)
            elif self._answer_probe(header, payload, address):
                continue
            elif header.sender == peer and header.epoch > after:
                if len(self._early) < EARLY_KEPT:
                    self._early.append((header, payload, address))
            elif header.sender == peer and on_stale is not None:
                self.stats[peer].rejected["stale"] += 1
                on_stale(header, address)
        return sorted({h.epoch for h, _, _ in self._early if h.sender == peer and h.epoch > after})

    def request_all(self, epoch: int, peer: int, n_values: int | None, dtype: int, address) -> None:
        """A NACK for every chunk of a vector we expect but have not seen a chunk of (its sender has it);
        n_values None: size unknown, ask for as many chunks as one NACK can name."""
        count = wire.chunk_count(n_values, dtype) if n_values is not None else wire.MAX_PAYLOAD // 2
        missing = np.arange(count, dtype="<u2")
        datagram = wire.pack(wire.Header(wire.NACK, dtype, self.node_id, self.session, epoch, 0, 1, 0),
                             missing.tobytes()[:wire.MAX_PAYLOAD], self.key)
        self._sendto(datagram, address)
        self.stats[peer].nacks_sent += 1

    def resend(self, epoch: int, peer: int) -> bool:
        """Send again every chunk of a vector sent to peer in `epoch` (it asked without knowing what
        it missed); False when that vector is no longer kept."""
        entry = self.sent.get((epoch, peer))
        if entry is None:
            return False
        address, datagrams = entry
        for d in datagrams:
            self._sendto(d, address)
        return True

    def _repair_with_parity(self, peer, values, masks, payloads, parities, dtype, per) -> None:
        """A parity group with exactly one chunk missing and its parity present: XOR it back."""
        count = len(masks[peer])
        for start, (size, parity) in list(parities[peer].items()):
            members = range(start, min(count, start + size))
            missing = [i for i in members if not masks[peer][i]]
            if len(missing) != 1:
                continue
            i = missing[0]
            xor = np.frombuffer(parity, dtype=np.uint8).copy()
            for j in members:
                if j != i:
                    p = np.frombuffer(payloads[peer][j], dtype=np.uint8)
                    if len(p) > len(xor):
                        break
                    xor[:len(p)] ^= p
            else:
                n = min(per, len(values[peer]) - i * per)
                length = wire.payload_bytes(n, dtype)
                if length > len(xor):
                    continue
                try:
                    values[peer][i * per:i * per + n] = wire.decode_values(xor[:length].tobytes(), dtype, n)
                except wire.WireError:
                    continue
                masks[peer][i] = True
                payloads[peer][i] = xor[:length].tobytes()
                self.stats[peer].chunks_recovered_parity += 1
