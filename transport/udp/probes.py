"""Link probes: echoed to a peer's address as the control plane gave it (never to an address a datagram claims);
`serve` answers NACKs and probes between sessions' rounds.

A role of UdpEndpoint (halo/transport/udp/endpoint.py): the methods here run on the one endpoint object."""

from __future__ import annotations

import time

from halo.transport import wire


class ProbeServer:
    """UdpEndpoint's answers to link probes, and serving between rounds."""

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
