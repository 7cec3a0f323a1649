"""Sending vectors: chunks packed once for every recipient, parity where a link has shown loss, the vectors of recent
epochs kept to answer NACKs (sent again to where the vector went, never to where a NACK came from).

A role of UdpEndpoint (halo/transport/udp/endpoint.py): the methods here run on the one endpoint object."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from halo.transport import erasure, wire

PARITY_PREFIX = struct.Struct("<BB")  # data chunks covered by a parity chunk, parity chunks of its group
SENT_VECTORS_KEPT = 512  # vectors kept for NACKs (a late agent may ask for an input it missed)
SENT_BYTES_KEPT = 32 << 20  # and at most this many bytes of them: a prompt's pass sends vectors of 32-64 rows (512 kB
# each), and 512 of those held 256 MB that no memory budget counted (HALO agents under a limit were killed by it)
PARTIALS_KEPT = 8  # what an agent keeps of its partials: they are asked for again only while their round is gathered
# (the master runs one round at a time: were rounds ever overlapped, this would have to cover them)
PARITY_LOSS_THRESHOLD = 0.005  # parity chunks are sent once a link has lost more than this fraction


def kept_bytes(largest_vector_bytes: int, vectors: int = SENT_VECTORS_KEPT) -> int:
    """The most the vectors kept for NACKs (at most `vectors` of them) take where none is larger than this: what a
    device's memory budget must leave them (a prompt's pass sends its largest)."""
    return min(SENT_BYTES_KEPT, vectors * largest_vector_bytes)


@dataclass
class Sent:
    """UdpEndpoint's sending of vectors and answers to NACKs."""

    dtype: int
    payloads: list[bytes]
    recipients: dict[int, tuple]  # peer id -> the address it went to
    nbytes: int  # the payloads' bytes


class Sender:
    """Sending vectors: chunks packed once for every recipient, parity where a link has shown loss, the vectors of recent
    epochs kept to answer NACKs (sent again to where the vector went, never to where a NACK came from)."""

    def send_vector(self, recipients: dict[int, tuple], epoch: int, values: np.ndarray, dtype: int = wire.FLOAT32,
                    parity_group: int = 0, parity_chunks: int = 2, copies: int = 1) -> int:
        """Send values as chunks to every recipient (peer id -> address), packed once, with `parity_chunks`
        parity chunks (1: P, XOR; 2: P and Q, erasure.py) per `parity_group` data chunks (0: none), the whole
        `copies` times one after the other (a burst of losses that takes a chunk rarely reaches its copy a vector
        later; each copy packed afresh, so it is no replay of the first); remember them for NACKs. Returns
        datagrams per recipient."""
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        payloads = wire.chunk_payloads(values, dtype)
        datagrams = []
        for _ in range(copies):
            datagrams += self.codec.pack_chunks(wire.DATA, dtype, self.node_id, self.session, epoch, self.counter + 1,
                                                payloads)
            self.counter += len(payloads)
            if parity_group:
                datagrams += self._parity(dtype, epoch, payloads, parity_group, parity_chunks)
        self._send_all(datagrams, list(recipients.values()))
        size = sum(map(len, datagrams))
        for peer in recipients:
            self.stats[peer].sent_bytes += size
            self.stats[peer].chunks_sent += len(datagrams)
        self._keep(epoch, Sent(dtype, payloads, dict(recipients), sum(map(len, payloads))))
        return len(datagrams)

    def _keep(self, epoch: int, entry: Sent) -> None:
        """Remember a vector for NACKs: the newest `vectors_kept` (SENT_VECTORS_KEPT, an agent PARTIALS_KEPT), at most
        `bytes_kept` of them (SENT_BYTES_KEPT, or what the device's budget reserved), always the newest one: its round
        is the one being gathered."""
        old = self.sent.pop(epoch, None)
        self.sent_bytes += entry.nbytes - (old.nbytes if old else 0)
        self.sent[epoch] = entry
        while len(self.sent) > 1 and (len(self.sent) > self.vectors_kept or self.sent_bytes > self.bytes_kept):
            self.sent_bytes -= self.sent.popitem(last=False)[1].nbytes

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

    def resend(self, epoch: int, peer: int, lost: bool = False) -> bool:
        """Send again every chunk of a vector sent to peer in `epoch` (it asked without knowing what it
        missed); False when that vector is no longer kept. lost: the asking says the vector never arrived (an agent
        chased for an input it answered well before: its partial was lost), so one chunk counts as lost on our way
        to the peer, as a NACKed one does: a link that loses whole one-chunk vectors (no hole to NACK) shows its loss
        and gets parity and copies like any other (one, not the vector's every chunk: a chase of a large vector
        would otherwise keep parity on for the rest of the session)."""
        entry = self.sent.get(epoch)
        sent = None if entry is None else self._send_again(epoch, peer, range(len(entry.payloads)))
        self.stats[peer].resends += sent is not None
        if lost and sent:
            self.stats[peer].chunks_sent_again += 1
        return sent is not None

    def _answer_nack(self, header: wire.Header, payload: bytes) -> None:
        """Send the chunks a NACK names again, to where the vector went (never to where the NACK came from)."""
        sent = None if len(payload) % 2 else self._send_again(header.epoch, header.sender,
                                                               np.frombuffer(payload, dtype="<u2"))
        if sent is None:
            self.stats[header.sender].rejected["nack_unknown"] += 1
            return
        self.stats[header.sender].nacks_answered += 1
        self.stats[header.sender].chunks_sent_again += sent  # holes it saw: our way to it loses packets
