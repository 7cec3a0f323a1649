"""The endpoint's socket and session, what every role uses: the receive buffer, datagrams packed with our counters
and sent (sendmmsg in C where built), datagrams read and checked (tag, session, format, replay window) with each
refusal counted, statistics per peer.

A role of UdpEndpoint (halo/transport/udp/endpoint.py): the methods here run on the one endpoint object."""

from __future__ import annotations

import logging
import math
import select
import socket
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from halo.host.cores import dedicated_cores
from halo.transport import wire
from halo.transport.udp.send import SENT_BYTES_KEPT, SENT_VECTORS_KEPT, Sent

RECV_BUFFER_BYTES = 4 << 20
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
    chunks_sent_again: int = 0  # of those, sent again because the peer NACKed them, and one a vector resent because
    # the peer said it was lost (resend lost=True); other whole-vector resends are not counted: a chase follows
    # silence, which a slow peer shows as well as a lossy link
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


class EndpointBase:
    """What every role of UdpEndpoint uses: its state (set here), packing and sending, reading and checking."""

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
        self.sent_bytes = 0  # their payloads' bytes (send.SENT_BYTES_KEPT)
        self.vectors_kept = SENT_VECTORS_KEPT  # how many (an agent keeps fewer: send.PARTIALS_KEPT)
        self.bytes_kept = SENT_BYTES_KEPT  # and their bytes at most (a device sets what its memory budget reserved)
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
        self.sent.clear()  # (a re-plan's epochs start again: a NACK must not bring back the last session's vector)
        self.sent_bytes = 0
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

    def _checked(self, batch: list):
        """(header, payload, address) of a receive() batch's valid, fresh datagrams; refusals counted."""
        for item in batch:
            if item.__class__ is str:
                self.stats[-1].rejected[item] += 1
                continue
            header, payload, address, size = item
            if self._fresh(header, size):
                yield header, payload, address
