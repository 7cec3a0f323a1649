"""One agent as the master sees it: where it is, what it computes, how it is doing.

A `RemoteAgent` owns the control connection to one agent (a ZeroMQ DEALER with the cluster key) and
everything the master knows about it: its node id (its sender id on UDP; the master is 0), its share,
its UDP address (from its hello reply: the control plane, never a datagram, says where a peer is),
its profile, counters and when it was last heard from.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
import zmq

from halo.compute.shares import Block, Shares
from halo.errors import HaloError
from halo.sync.modes import UNKNOWN_SETTINGS
from halo.transport.reliable import Message, MessageError, decode, encode

# A wrong key fails every handshake (zmq reconnects every ~0.1-0.2 s: named within a second); a lossy radio link
# fails one now and then (1 in 40 on the bed's wifi-bad profile, the agent seeing EAGAIN mid-handshake), which the
# next reconnect completes: named only when it happens this many times in a row
HANDSHAKE_ATTEMPTS = 3


class AgentError(HaloError):
    """An agent refused, failed or went silent."""


class AgentSilent(AgentError):
    """No reply came within the wait, and the connection is not known to be gone (it may only be slow)."""


@dataclass
class AgentStats:
    requests: int = 0  # replies received over the control connection
    wait_ms: float = 0.0  # time the master spent waiting for those replies
    compute_ms: float = 0.0  # the agent's own compute, as it reports it
    reply_ms: float = 0.0  # UDP modes: from sending a round's input to holding the agent's partial (or giving up)
    cpu_ms: float = 0.0
    bytes_sent: int = 0  # over the control connection (all of a round's data in the TCP sync modes)
    bytes_received: int = 0


@dataclass
class RemoteAgent:
    node_id: int  # 1..254; its UDP sender id
    endpoint: str  # tcp://host:port of its control socket
    share: Shares
    socket: object  # zmq DEALER
    timeout_s: float
    name: str = ""
    profile: dict = field(default_factory=dict)
    udp_address: tuple | None = None
    weight_bytes: int = 0
    kept_groups: int = 0  # groups whose kernels it kept from its previous session (a sticky re-plan)
    loads_ahead: bool = False  # HALO: it reads its groups of the next layer from storage as soon as it predicts them
    stats: AgentStats = field(default_factory=AgentStats)
    last_heard: float = field(default_factory=time.monotonic)  # last datagram or reply (liveness)
    vocab_ids: np.ndarray | None = None  # the vocabulary rows of its LM-head slice
    monitor: object = None  # zmq monitor socket of the control connection: why a connection fails
    link: str = "connecting"  # connecting, connected, secured (handshake done), retrying / reconnecting (after a failed
    # handshake), disconnected, refused
    keyed: bool = True  # this master holds the cluster key (CURVE), else plaintext
    handshake_failures: int = 0  # security handshakes failed in a row (one alone may be a lossy link's)

    def __post_init__(self):
        self.name = self.name or f"agent-{self.node_id}"

    @classmethod
    def connect(cls, context, endpoint: str, key, insecure: bool, timeout_s: float, node_id: int, share: Shares | None,
                **fields) -> "RemoteAgent":
        """Its control connection (keyed, or plaintext with insecure), watched by a monitor that tells a refused key
        or a security mismatch from a dead device; a send never blocks longer than a reply may take."""
        from halo.transport.reliable import client_socket

        sock = client_socket(context, key, insecure, endpoint)
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        monitor = sock.get_monitor_socket()
        sock.connect(endpoint)
        return cls(node_id, endpoint, share, sock, timeout_s, monitor=monitor, keyed=key is not None, **fields)

    @property
    def host(self) -> str:
        return self.endpoint.split("://", 1)[-1].rsplit(":", 1)[0]

    def holds(self, block: Block) -> bool:
        return self.share.holds(block)

    def width(self, block: Block, dim: int) -> int:
        """Values per token of its partial of a block (0: it holds none, an acknowledgement)."""
        if not self.holds(block):
            return 0
        return len(self.vocab_ids) if block.kind == "lm_head" else dim

    def send(self, kind: str, fields: dict, arrays=()) -> None:
        frames = encode(Message(kind, fields, list(arrays)))
        try:
            self.socket.send_multipart(frames)
        except zmq.Again:  # the socket's send timeout: its connection is gone or stuck
            raise AgentError(f"could not send {kind!r} to agent {self} within {self.timeout_s:.1f} s: it stopped, "
                             "crashed or lost its network") from None
        self.stats.bytes_sent += sum(memoryview(f).nbytes for f in frames)

    def receive(self, what: str) -> Message:
        t = time.perf_counter()
        if not self._wait(t + self.timeout_s):
            if self.link in ("disconnected", "refused"):
                raise AgentError(f"agent {self} did not answer {what}: {self._why_silent()}")
            raise AgentSilent(f"agent {self} did not answer {what} within {self.timeout_s:.1f} s: {self._why_silent()}")
        frames = self.socket.recv_multipart()
        self.stats.bytes_received += sum(len(f) for f in frames)
        try:
            reply = decode(frames)
        except MessageError as e:
            raise AgentError(f"agent {self} sent a malformed reply to {what}: {e}") from None
        self.stats.requests += 1
        self.stats.wait_ms += 1e3 * (time.perf_counter() - t)
        self.last_heard = time.monotonic()
        if reply.kind in ("error", "refused"):
            reason = str(reply.fields.get("reason"))
            hint = (" (it runs an older halo than this master, which does not know these settings: install the same "
                    "halo version on every device)" if UNKNOWN_SETTINGS in reason else "")
            raise AgentError(f"agent {self} {reply.kind} {what}: {reason}{hint}")
        return reply

    def _wait(self, deadline: float) -> bool:
        """Until a reply is ready (True) or the deadline; a failed security handshake raises at once."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        if self.monitor is not None:
            poller.register(self.monitor, zmq.POLLIN)
        while (left := deadline - time.perf_counter()) > 0:
            events = dict(poller.poll(max(1, int(1000 * left))))
            if self.socket in events:
                return True
            if self.monitor in events:
                self._read_monitor()
                if self.link in ("disconnected", "refused"):  # no reply can come: no use waiting for one
                    return self.socket.poll(0) != 0
        return False

    def gone(self) -> bool:
        """Whether its control connection closed or was refused (no agent process there any more)."""
        if self.monitor is not None:
            self._read_monitor()
        return self.link in ("disconnected", "refused")

    def _read_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                self.link = "connected"
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.link, self.handshake_failures = "secured", 0
            elif kind == zmq.EVENT_DISCONNECTED:  # after a failed handshake: zmq connects again (not given up yet)
                self.link = "retrying" if self.handshake_failures else "disconnected"
            elif kind == zmq.EVENT_CONNECT_RETRIED:  # a connect failed, or (after a disconnect) one is scheduled
                self.link = {"retrying": "reconnecting", "connecting": "refused", "reconnecting": "refused"}.get(
                    self.link, self.link)  # refused: nobody listens there (any more)
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                mismatch = kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                    event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
                self.handshake_failures += 1  # zmq reconnects and tries again by itself
                if mismatch or self.handshake_failures >= HANDSHAKE_ATTEMPTS:
                    raise AgentError(f"agent {self} refused the security handshake: " + self._handshake_advice(mismatch))

    def _handshake_advice(self, mismatch: bool) -> str:
        if not self.keyed:  # a plaintext agent accepts a plaintext master: this one wants the key
            return ("master and agent disagree on security: this master runs plaintext (--insecure), the agent holds "
                    "the cluster key; give the master --key (or start the agent with --insecure on a trusted bed)")
        if mismatch:
            return ("master and agent disagree on security: the agent runs plaintext (--insecure), this master holds "
                    "the cluster key; start the agent with --key, or the master with --insecure")
        return ("it holds another cluster key (or runs plaintext); copy the coordinator's cluster.key to "
                "/etc/halo/cluster.key on the agent, or pass the same --key to both")

    def _why_silent(self) -> str:
        if self.monitor is not None:
            self._read_monitor()
        if self.link in ("connecting", "refused"):
            return "nothing accepted a connection there (no agent running, wrong address or port, or a firewall)"
        if self.link == "disconnected":
            return "its connection closed (the agent process ended, or its host went down)"
        if self.handshake_failures:  # fewer than HANDSHAKE_ATTEMPTS in the wait, none succeeded
            times = f"{self.handshake_failures} time{'s' if self.handshake_failures > 1 else ''}"
            return (f"its security handshake failed {times} (a lossy link fails one now and then; every one failing "
                    "points to the key): " + self._handshake_advice(False))
        return "it stopped, crashed or lost its network"

    def close(self) -> None:
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def report(self) -> dict:
        return {"name": self.name, "endpoint": self.endpoint, "node_id": self.node_id, "profile": self.profile,
                "weight_bytes": self.weight_bytes, "heads": sum(map(len, self.share.attention)),
                "mlp_groups": sum(map(len, self.share.mlp)), "vocab_groups": len(self.share.lm_head),
                **{k: round(v, 3) for k, v in asdict(self.stats).items()}}

    def __str__(self) -> str:
        return f"{self.name} ({self.endpoint})"


def ask_status(endpoints: list[str], key=None, insecure: bool = False, timeout_s: float = 1.0) -> dict[str, dict]:
    """Each endpoint's answer to a `status` request (its fields), or {"error": why} where none came within timeout_s:
    why as a master's request says it (a refused security handshake with the fix, nobody listening, silence). All
    are asked at once: the wait is timeout_s at most, however many do not answer."""
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    answers, agents = {}, {}
    try:
        for i, endpoint in enumerate(endpoints):
            agents[endpoint] = RemoteAgent.connect(context, endpoint, key, insecure, timeout_s, i + 1, None, name=endpoint)
            agents[endpoint].send("status", {})
        deadline = time.monotonic() + timeout_s
        for endpoint, agent in agents.items():
            agent.timeout_s = max(0.001, deadline - time.monotonic())
            try:
                answers[endpoint] = agent.receive("status").fields
            except AgentError as e:
                answers[endpoint] = {"error": str(e).replace(f"agent {agent} ", "", 1)}
            finally:
                agent.close()
    finally:
        context.destroy(linger=0)
    return answers
