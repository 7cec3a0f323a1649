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

The roles live in a module each: base.py (the socket, the session, checks), send.py, gather.py, whole.py (the
whole-vector path), probes.py; endpoint.py puts them together.
"""

from halo.transport.udp.base import BUSY_POLL_MODES, BUSY_POLL_S, PeerStats, set_busy_poll, spin_readable
from halo.transport.udp.endpoint import UdpEndpoint
from halo.transport.udp.gather import GatherPolicy, GatherResult, Inbound, PeerDeadline
from halo.transport.udp.send import PARITY_PREFIX, PARTIALS_KEPT, kept_bytes

__all__ = ["BUSY_POLL_MODES", "BUSY_POLL_S", "GatherPolicy", "GatherResult", "Inbound", "PARITY_PREFIX",
           "PARTIALS_KEPT", "PeerDeadline", "PeerStats", "UdpEndpoint", "kept_bytes", "set_busy_poll", "spin_readable"]
