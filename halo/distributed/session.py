"""The master's control plane for one session: profile the agents, say hello, open UDP, probe links.

Before planning (`measure_agents`): a `profile` request to every agent (protocol, model sha256, weight
format, group sizes, the master's UDP session) makes it time its group kernels and report its memory
(halo/runtime/measure.py, cached on the device), and join the master's UDP session so that the
master can probe its link with enough packets to tell 1 % loss from none (transport/probe.py). The
master measures itself the same way; the scheduler plans from the figures, and only then is the
session opened with each participant's share.

Hello tells each agent the protocol, the model's sha256, its share and node id, the sync settings,
the weight format (cluster-wide) and where the master's UDP endpoint listens (its port; the agent
takes the master's address from the control connection). Each agent loads its share in a thread,
reports how far it got ("loading", about every second) and answers "ready" with its own profile and UDP
port. Every blocking call has a bound: a profile within `profile_timeout_s`; a hello's loading may take
any time while it advances, but each step (one block's share built) within `hello_timeout_s` or the
time the whole share takes to read at `LOAD_BYTES_PER_S` (whichever is longer: a 1/5 share of a 1.1B
model is ~0.9 GB of float32 to read and quantize, on a busy Pi core); every later reply within
`timeout_s`, every send within `timeout_s`, and `close` never waits for an agent that is gone.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import zmq

from halo.arguments import MAX_THREADS
from halo.compute.neuron_groups import GroupLayout
from halo.compute.shares import Shares, share_float32_bytes
from halo.errors import ConfigError
from halo.model.config import DEFAULT_CONTEXT
from halo.model.weights import ModelWeights
from halo.sync import SyncSettings

from halo.transport.control import ControlError, Ready
from halo.transport.reliable import Message, encode

from halo.distributed.remote import AgentError, AgentSilent, RemoteAgent

DEFAULT_TIMEOUT_S = 2.0
CONTROL_PATIENCE_S = 30.0  # a control reply's longest wait while its agent still answers link probes
LOAD_BYTES_PER_S = 20e6  # the slowest load a hello allows for: an SD card, or quantizing on a shared core


def hello_timeout_s(share: Shares, layout: GroupLayout, dim: int, floor_s: float) -> float:
    return max(floor_s, share_float32_bytes(share, layout, dim) / LOAD_BYTES_PER_S)


def master_context() -> zmq.Context:
    """A ZeroMQ context whose sockets never linger: one left to the garbage collector (a session a failed
    caller did not close) must not block the process on messages to an agent that is gone. `close`
    still gives a bye 100 ms."""
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    return context


@dataclass(frozen=True)
class MasterSettings:
    context: int = DEFAULT_CONTEXT  # KV-cache length (clamped to the model's)
    slots: int = 1  # KV caches on every device: sequences a batched pass may carry (halo/compute/batch.py, halo-master serve)
    fmt: str = "fp32"  # weight format, cluster-wide
    timeout_s: float = DEFAULT_TIMEOUT_S  # an agent silent this long is an error
    hello_timeout_s: float = 10.0  # agents load their share while answering hello
    profile_timeout_s: float = 60.0  # a first kernel benchmark (a big model in 4-bit on a Pi: many seconds)
    probe_links: bool = True  # measure every link (loss, RTT, bandwidth) at start
    sync: SyncSettings = field(default_factory=SyncSettings)
    predictors: str | None = None  # HALO mode: trained predictors (default: beside the model)
    threads: int = 1  # the master's compute threads for its own share (halo-master --threads; its benchmark's too)

    def __post_init__(self):
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or not 1 <= self.threads <= MAX_THREADS:
            raise ConfigError(f"the master's compute threads must be a whole number from 1 to {MAX_THREADS}, "
                              f"not {self.threads!r}")


@dataclass
class Session:
    agents: dict[int, RemoteAgent]  # by node id
    udp: object | None  # UdpEndpoint
    zmq_context: object

    @classmethod
    def open(cls, weights: ModelWeights, layout: GroupLayout, settings: MasterSettings, context: int,
             shares: list[Shares], endpoints: list[str], key=None, insecure: bool = False,
             meanwhile=None) -> "Session":
        """Hello to every agent (shares and endpoints in plan order: node ids 1, 2, ...). `meanwhile()` runs
        after the hellos are sent, before their answers are awaited: the master builds its own share while the
        agents load theirs (a re-plan's rebuild then takes the slowest device's load, not the sum)."""
        from halo.model.loader import model_fingerprint
        from halo.transport.control import Hello

        session = cls({}, None, master_context())
        try:
            udp = session._open_udp(key, settings) if settings.sync.policy.uses_udp or settings.probe_links else None
            sha = model_fingerprint(weights.source)
            for node_id, (endpoint, share) in enumerate(zip(endpoints, shares), start=1):
                agent = session._connect(node_id, endpoint, share, key, insecure,
                                         hello_timeout_s(share, layout, weights.config.dim, settings.hello_timeout_s), layout)
                hello = Hello(sha, context, layout.mlp_group_size, layout.vocab_group_size, os.uname().nodename,
                              settings.fmt, settings.sync.to_json(), node_id, tuple(map(tuple, share.attention)),
                              tuple(map(tuple, share.mlp)), tuple(share.lm_head), udp, settings.slots)
                agent.send("hello", hello.to_fields())
            if meanwhile is not None:
                meanwhile()
            for agent in session.agents.values():
                session._welcome(agent, settings)
            if settings.sync.policy.uses_udp and any(a.udp_address is None for a in session.agents.values()):
                raise AgentError(f"--sync {settings.sync.mode} needs every agent's UDP port, and one did not say it")
            if settings.probe_links:
                session._probe_links()
        except BaseException:
            session.close()
            raise
        return session

    @classmethod
    def measure(cls, weights: ModelWeights, layout: GroupLayout, settings: MasterSettings, endpoints: list[str],
                key=None, insecure: bool = False, take_over: bool = True, fresh: bool = False) -> list[dict]:
        """Profile every agent and probe its link, one agent at a time (each benchmark runs alone on its
        device, and a shared machine, a test bed, does not skew them). take_over: an agent serving another
        master ends that session (we are about to say hello); else it refuses, busy. fresh: re-run cached
        benchmarks."""
        from halo.model.loader import model_fingerprint
        from halo.transport.control import ProfileRequest
        from halo.transport.probe import PLANNING_INTERVAL_S, PLANNING_PROBES, probe

        session = cls({}, None, master_context())
        try:
            udp, sha = session._open_udp(key, settings), model_fingerprint(weights.source)
            nothing = Shares([[]] * weights.config.n_layers, [[]] * weights.config.n_layers, [])
            results = []
            for node_id, endpoint in enumerate(endpoints, start=1):
                agent = session._connect(node_id, endpoint, nothing, key, insecure, settings.profile_timeout_s, layout)
                request = ProfileRequest(sha, settings.fmt, layout.mlp_group_size, layout.vocab_group_size,
                                         os.uname().nodename, take_over, fresh, node_id, udp)
                agent.send("profile", request.to_fields())
                try:
                    reply = agent.receive("the profile request")  # within profile_timeout_s: a first benchmark
                except AgentError as e:
                    if "before hello" in str(e):
                        raise AgentError(f"{e} (it predates measured plans: upgrade it, or give --plan even)") from None
                    raise
                port = reply.fields.get("udp_port")
                if not isinstance(reply.fields.get("measured"), dict) or not isinstance(port, int):
                    raise AgentError(f"agent {agent} sent a profile without measurements or UDP port; "
                                     "run the same halo version on the master and every agent")
                link = probe(session.udp, (agent.host, port), count=PLANNING_PROBES, interval_s=PLANNING_INTERVAL_S,
                             burst=32, wait_s=0.2)
                results.append({"endpoint": endpoint, "name": str(reply.fields.get("name", agent.name)),
                                "measured": reply.fields["measured"], "profile": reply.fields.get("profile", {}),
                                "link": link.to_json()})
            return results
        finally:
            session.close()

    def _open_udp(self, key, settings: MasterSettings):
        """The master's UDP endpoint of this session, and the session as hellos and profile requests carry it."""
        from halo.transport import wire
        from halo.transport.control import UdpSession
        from halo.transport.reliable import udp_base_key
        from halo.transport.udp import UdpEndpoint

        udp_session, nonce = int.from_bytes(os.urandom(4), "little") or 1, os.urandom(wire.NONCE_BYTES)
        session_key = wire.session_key(udp_base_key(key), nonce, udp_session)
        self.udp = UdpEndpoint(session_key, udp_session, 0, bind=("0.0.0.0", 0))
        self.udp.segment, self.udp.whole_vectors = settings.sync.udp_gso, settings.sync.whole_vectors
        if settings.sync.inject_plr:
            from halo.transport.loss import LossInjector

            self.udp.send_hook = LossInjector(seed=settings.sync.seed, drop=settings.sync.inject_plr)
        return UdpSession(udp_session, nonce.hex(), self.udp.address[1])

    def _connect(self, node_id: int, endpoint: str, share: Shares, key, insecure: bool, timeout_s: float,
                 layout: GroupLayout) -> RemoteAgent:
        vocab = layout.vocab_ids(share.lm_head) if share.lm_head else None
        agent = RemoteAgent.connect(self.zmq_context, endpoint, key, insecure, timeout_s, node_id, share, vocab_ids=vocab)
        self.agents[node_id] = agent
        return agent

    def _welcome(self, agent: RemoteAgent, settings: MasterSettings) -> None:
        """Wait for the agent's "ready". A share that takes long to load is reported on ("loading", every second or
        so, with the blocks built): the agent is given up only when it has built nothing more for the hello
        timeout (its share's size at LOAD_BYTES_PER_S, at least hello_timeout_s), however slow its storage."""
        stall_s, advanced, done = agent.timeout_s, time.monotonic(), -1
        while True:
            reply = agent.receive("hello")
            if reply.kind != "loading":
                break
            built = reply.fields.get("blocks_done")
            if type(built) is not int:
                raise AgentError(f"agent {agent} sent a malformed loading report (blocks_done {built!r})")
            if built > done:
                done, advanced = built, time.monotonic()
            elif time.monotonic() - advanced > stall_s:
                raise AgentError(f"agent {agent} built nothing of its share for {stall_s:.1f} s (at "
                                 f"{reply.fields.get('percent', 0)} % after {reply.fields.get('seconds', '?')} s): its "
                                 "storage or CPU stalls; give it less work or look at the device")
        try:
            ready = Ready.from_fields(reply.fields)
        except ControlError as e:
            raise AgentError(f"agent {agent} answered its hello with a malformed ready: {e}") from None
        agent.name = f"{ready.name}#{agent.node_id}"
        if ready.slots != settings.slots:
            raise AgentError(f"agent {agent} keeps {ready.slots} KV-cache slot(s) where {settings.slots} were asked: it "
                             "predates batched passes; upgrade halo on it, or serve with --slots 1")
        agent.profile, agent.weight_bytes, agent.kept_groups = ready.profile, ready.weight_bytes, ready.kept_groups
        agent.loads_ahead = ready.loads_ahead
        agent.udp_address = (agent.host, ready.udp_port) if ready.udp_port else None
        agent.timeout_s = settings.timeout_s
        agent.socket.setsockopt(zmq.SNDTIMEO, int(settings.timeout_s * 1000))
        if self.udp is not None and agent.udp_address is not None:
            self.udp.peers[agent.node_id] = agent.udp_address

    def _probe_links(self) -> None:
        """Measure each agent's link (loss, RTT, bandwidth) over UDP: the scheduler's PLR and latency."""
        from halo.transport.probe import probe

        for agent in self.agents.values():
            if agent.udp_address is not None:
                result = probe(self.udp, agent.udp_address, count=50, interval_s=0.0002, burst=16, wait_s=0.05)
                agent.profile = {**agent.profile, "link": result.to_json()}

    def reset(self) -> None:
        for agent in self.agents.values():
            agent.send("reset", {})
        for agent in self.agents.values():
            self.receive_control(agent, "reset")

    def receive_control(self, agent: RemoteAgent, what: str):
        """A reply over the control connection (TCP): within timeout_s, or up to CONTROL_PATIENCE_S while the agent
        still echoes link probes over UDP (its process runs and its link carries datagrams). TCP's retransmission
        timeout doubles from 200 ms, so a burst of Wi-Fi losses that takes a segment and its retransmissions holds
        a reply back for seconds: on wifi-bad a reset went unanswered for 2 s in about one run of six, and the
        agent was named stopped."""
        started = time.monotonic()
        while True:
            try:
                return agent.receive(what)
            except AgentSilent as e:  # (a refusal, a malformed reply or a closed connection is final at once)
                waited = time.monotonic() - started
                if agent.gone() or waited >= CONTROL_PATIENCE_S or not self._echoes_probes(agent):
                    raise AgentSilent(f"{e} (waited {waited:.1f} s in all; it answered link probes until then)"
                                      if waited > agent.timeout_s else str(e)) from None

    def _echoes_probes(self, agent: RemoteAgent) -> bool:
        """Whether the agent answers a few UDP link probes within a second: alive, whatever TCP is doing."""
        from halo.transport.probe import probe

        if self.udp is None or agent.udp_address is None:
            return False
        return probe(self.udp, agent.udp_address, count=10, interval_s=0.01, burst=0, wait_s=0.9).echoed > 0

    def close(self, retain: bool = False) -> None:
        """Say bye where that can be done at once; never wait for an agent that is gone. retain: the agents keep
        the session's kernels a while for the next hello (a re-plan)."""
        for agent in self.agents.values():
            try:
                agent.socket.send_multipart(encode(Message("bye", {"retain": retain})), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # no connection to it: nothing to say goodbye to
            agent.close()
        if self.udp is not None:
            self.udp.close()
        self.zmq_context.destroy(linger=100)
