"""UdpEndpoint: one per process, its roles in a module each (base: socket, session, checks; send; gather; whole: the
whole-vector path; probes)."""

from __future__ import annotations

from halo.transport.udp.base import EndpointBase
from halo.transport.udp.gather import Gatherer
from halo.transport.udp.probes import ProbeServer
from halo.transport.udp.send import Sender
from halo.transport.udp.whole import WholeVectors


class UdpEndpoint(Sender, Gatherer, WholeVectors, ProbeServer, EndpointBase):
    """One UDP socket in one session: sends vectors (Sender), gathers an epoch's vectors from peers (Gatherer), takes
    whole vectors a read at a time (WholeVectors), echoes link probes (ProbeServer). The state they share is
    EndpointBase's: the socket, the codec and session, the replay windows, the per-peer statistics, the vectors sent
    (for NACKs) and the datagrams of epochs not gathered yet."""
