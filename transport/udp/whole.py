"""The whole-vector path: a read batch that is whole vectors (every chunk once, in order, consecutive counters) is
taken a vector at a time instead of a datagram at a time: a round's input in one step (whole_vector), a gather's
usual partials (Gatherer._receive_gathering).

A role of UdpEndpoint (halo/transport/udp/endpoint.py): the methods here run on the one endpoint object."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from halo.transport import wire
from halo.transport.udp.send import PARITY_PREFIX


@dataclass
class WholeRun:
    """UdpEndpoint's whole-vector path."""

    sender: int
    epoch: int
    dtype: int
    count: int
    payloads: list = field(default_factory=list)  # the data chunks' payloads, in order
    counters: list = field(default_factory=list)  # every datagram's, parity included
    bytes: int = 0
    parity: bool = False
    stale: tuple | None = None  # (header, address) of a stale parity datagram, alone in its run (count 0)


class WholeVectors:
    """The whole-vector path: a read batch that is whole vectors (every chunk once, in order, consecutive counters) is
    taken a vector at a time instead of a datagram at a time: a round's input in one step (whole_vector), a gather's
    usual partials (Gatherer._receive_gathering)."""

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
