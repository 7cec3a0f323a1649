"""The master of a tensor-parallel cluster: one token's forward pass over agents (reliable mode).

`DistributedModel` has the same interface as the single-process `Transformer` (forward, reset,
max_seq_len), so `generate()` drives either. Per block, the master sends the normed input to every
agent holding groups of that block, computes its own share meanwhile (HALO: the master is a worker
too), then adds the partial sums into the residual in a fixed order (own share, then agents in plan
order), so the result is deterministic. The LM head's vocabulary slices are gathered into full logits.

A plan (scheduler) says how many groups of each block every device takes; Algorithm 3's priority
ranks become concrete group indices here (rank r = group r until HALO mode re-maps them per token).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import HaloError
from .model import DEFAULT_CONTEXT
from .neuron_groups import AttentionShard, GroupLayout, LmHeadShard, MlpShard
from .ops import Rotary, rmsnorm
from .weights import ModelWeights

DEFAULT_TIMEOUT_S = 2.0


class AgentError(HaloError):
    """An agent refused, failed or went silent."""


@dataclass
class Shares:
    """The groups one device computes: heads and MLP groups per layer, LM-head vocabulary groups."""

    attention: list[list[int]]
    mlp: list[list[int]]
    lm_head: list[int]


def shares_from_plan(plan, n_layers: int) -> list[Shares]:
    """Concrete group indices per participant (plan order, master first) from a TensorParallelPlan."""
    out = []
    ranks = {kind: plan.priority_ranks(kind) for kind in ("attention", "mlp", "lm_head")}
    for j in range(plan.n):
        out.append(Shares(
            attention=[list(range(*ranks["attention"][j, l])) for l in range(n_layers)],
            mlp=[list(range(*ranks["mlp"][j, l])) for l in range(n_layers)],
            lm_head=list(range(*ranks["lm_head"][j, 0]))))
    return out


def even_plan(weights: ModelWeights, layout: GroupLayout, n_devices: int, compute: list[float] | None = None,
              context: int = DEFAULT_CONTEXT):
    """A plan for n equal local devices (or devices with the given relative compute), all taking part."""
    from .scheduler.profiles import Cluster, DeviceProfile, model_profile
    from .scheduler.tp_plan import build_plan

    compute = compute or [1.0] * n_devices
    devices = tuple(DeviceProfile(f"device-{i}", 64e9, c * 1e9, is_master=i == 0) for i, c in enumerate(compute))
    profile = model_profile(weights.config, "fp32", mlp_group_size=layout.mlp_group_size,
                            vocab_group_size=layout.vocab_group_size)
    # every device stays a participant (one may get no groups): the caller has one agent per device
    return build_plan(Cluster(devices, context=context, weights="fp32"), profile, "minmax", prune=False)


@dataclass
class AgentLink:
    name: str
    endpoint: str
    socket: object
    timeout_s: float
    stats: dict = field(default_factory=lambda: {"requests": 0, "wait_ms": 0.0, "compute_ms": 0.0, "cpu_ms": 0.0})
    profile: dict = field(default_factory=dict)
    udp_port: int | None = None
    weight_bytes: int = 0

    def send(self, kind: str, fields: dict, arrays=()) -> None:
        from .transport.reliable import Message, encode

        self.socket.send_multipart(encode(Message(kind, fields, list(arrays))))

    def receive(self, what: str):
        from .transport.reliable import MessageError, decode

        t = time.perf_counter()
        if not self.socket.poll(int(self.timeout_s * 1000)):
            raise AgentError(f"agent {self.name} ({self.endpoint}) did not answer {what} within {self.timeout_s:.1f} s: "
                             "it stopped, crashed or lost its network")
        try:
            reply = decode(self.socket.recv_multipart())
        except MessageError as e:
            raise AgentError(f"agent {self.name} ({self.endpoint}) sent a malformed reply to {what}: {e}") from None
        self.stats["requests"] += 1
        self.stats["wait_ms"] += 1e3 * (time.perf_counter() - t)
        if reply.kind in ("error", "refused"):
            raise AgentError(f"agent {self.name} ({self.endpoint}) {reply.kind} {what}: {reply.fields.get('reason')}")
        return reply


class DistributedModel:
    def __init__(self, weights: ModelWeights, shares: list[Shares], endpoints: list[str], key=None,
                 insecure: bool = False, layout: GroupLayout | None = None, max_seq_len: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, hello_timeout_s: float = 10.0, probe_links: bool = True,
                 fmt: str = "fp32"):
        import zmq

        from .loader import model_fingerprint
        from .transport.reliable import PROTOCOL_VERSION, client_socket

        if len(endpoints) != len(shares) - 1:
            raise HaloError(f"the plan has {len(shares)} participants: the master and {len(shares) - 1} agents, "
                            f"but {len(endpoints)} agent addresses were given")
        c = self.config = weights.config
        self.layout = layout or GroupLayout.for_model(c)
        self.max_seq_len = min(c.max_seq_len, max_seq_len or DEFAULT_CONTEXT)
        self.weights = weights
        self.rotary = Rotary(c, self.max_seq_len)
        own = shares[0]
        self.attention = {l: AttentionShard(weights.layers[l], self.layout, h, self.max_seq_len, fmt)
                          for l, h in enumerate(own.attention) if h}
        self.mlp = {l: MlpShard(weights.layers[l], self.layout, g, fmt) for l, g in enumerate(own.mlp) if g}
        self.lm_head = LmHeadShard(weights.lm_head, self.layout, own.lm_head, fmt) if own.lm_head else None
        self.shares = shares
        # who holds groups of which block, and the vocabulary rows of each agent's LM-head slice, worked
        # out once: the per-token loop only looks them up
        self.holders = {(kind, l): [i for i, sh in enumerate(shares[1:]) if getattr(sh, kind)[l]]
                        for kind in ("attention", "mlp") for l in range(c.n_layers)}
        self.vocab_ids = [np.concatenate([np.arange(r.start, r.stop) for r in map(self.layout.vocab_rows, sh.lm_head)])
                          if sh.lm_head else None for sh in shares[1:]]
        self.pos = 0
        self.step = 0
        self.own_compute_ms = 0.0  # the master's own share, summed over every forward (wall clock)
        self.own_cpu_ms = 0.0  # the same in CPU time: what it costs without other processes on the cores
        self.context = zmq.Context()
        self.links: list[AgentLink] = []
        hello = {"protocol": PROTOCOL_VERSION, "model_sha256": model_fingerprint(weights.source),
                 "context": self.max_seq_len, "mlp_group_size": self.layout.mlp_group_size,
                 "vocab_group_size": self.layout.vocab_group_size, "master": os.uname().nodename, "weights": fmt}
        try:
            for i, (endpoint, share) in enumerate(zip(endpoints, shares[1:]), start=1):
                sock = client_socket(self.context, key, insecure)
                sock.connect(endpoint)
                link = AgentLink(f"agent-{i}", endpoint, sock, hello_timeout_s)  # loading weights may take a while
                link.send("hello", {**hello, "attention": share.attention, "mlp": share.mlp, "lm_head": share.lm_head})
                self.links.append(link)
            for link in self.links:
                reply = link.receive("hello")
                link.name = f"{reply.fields.get('name', link.name)}#{self.links.index(link) + 1}"
                link.profile = reply.fields.get("profile", {})
                link.udp_port = reply.fields.get("udp_port")
                link.weight_bytes = int(reply.fields.get("weight_bytes", 0))
                link.timeout_s = timeout_s
            if probe_links:
                self._probe_links(key)
        except BaseException:
            self.close()
            raise

    def _probe_links(self, key) -> None:
        """Measure each agent's link (loss, RTT, bandwidth) over UDP: the scheduler's PLR and latency."""
        from .transport.probe import probe
        from .transport.udp import UdpEndpoint

        endpoint = UdpEndpoint(key.udp_key if key else bytes(32), 0, 0, bind=("0.0.0.0", 0))
        try:
            for link in self.links:
                if not link.udp_port:
                    continue
                host = link.endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
                result = probe(endpoint, (host, int(link.udp_port)), count=50, interval_s=0.0002, burst=16, wait_s=0.05)
                link.profile = {**link.profile, "link": result.to_json()}
        finally:
            endpoint.close()

    # ---- the forward pass ------------------------------------------------------------------------------------
    def _block(self, kind: str, layer: int, x: np.ndarray, start: int, own) -> np.ndarray:
        """Send x to the agents that hold groups of this block, compute the own share, add everything."""
        holders = [self.links[i] for i in self.holders[(kind, layer)]]
        for link in holders:
            link.send("block", {"kind": kind, "layer": layer, "start_pos": start}, [x])
        t, cpu = time.perf_counter(), time.thread_time()
        total = own() if own is not None else np.zeros_like(x)
        self.own_compute_ms += 1e3 * (time.perf_counter() - t)
        self.own_cpu_ms += 1e3 * (time.thread_time() - cpu)
        for link in holders:
            reply = link.receive(f"{kind} of layer {layer} at position {start} (step {self.step})")
            partial = reply.arrays[0] if reply.arrays else None
            if partial is None or partial.shape != x.shape:
                raise AgentError(f"agent {link.name} returned a {kind} partial of shape "
                                 f"{None if partial is None else partial.shape}, expected {x.shape}")
            link.stats["compute_ms"] += float(reply.fields.get("compute_ms", 0.0))
            link.stats["cpu_ms"] += float(reply.fields.get("cpu_ms", 0.0))
            total = total + partial
        return total

    def forward(self, tokens, start_pos: int | None = None) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        start = self.pos if start_pos is None else start_pos
        if tokens.ndim != 1 or len(tokens) == 0 or tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError("forward needs a non-empty 1-D sequence of valid token ids")
        if start + len(tokens) > self.max_seq_len:
            raise ValueError(f"{start + len(tokens)} positions exceed the context length {self.max_seq_len}")
        eps, w = self.config.norm_eps, self.weights
        x = np.array(w.tok_embeddings[tokens], dtype=np.float32)
        for l in range(self.config.n_layers):
            h = rmsnorm(x, w.layers[l].attn_norm, eps)
            shard = self.attention.get(l)
            x = x + self._block("attention", l, h, start,
                                (lambda s=shard, h=h: s.forward(h, start, self.rotary)) if shard else None)
            h = rmsnorm(x, w.layers[l].mlp_norm, eps)
            shard = self.mlp.get(l)
            x = x + self._block("mlp", l, h, start, (lambda s=shard, h=h: s.forward(h)) if shard else None)
        h = rmsnorm(x[-1:], w.final_norm, eps)
        logits = np.empty(self.config.vocab_size, dtype=np.float32)
        holders = [(link, ids) for link, ids in zip(self.links, self.vocab_ids) if ids is not None]
        for link, _ in holders:
            link.send("block", {"kind": "lm_head", "layer": -1, "start_pos": start}, [h])
        if self.lm_head is not None:
            t, cpu = time.perf_counter(), time.thread_time()
            logits[self.lm_head.token_ids] = self.lm_head.forward(h)[0]
            self.own_compute_ms += 1e3 * (time.perf_counter() - t)
            self.own_cpu_ms += 1e3 * (time.thread_time() - cpu)
        for link, ids in holders:
            reply = link.receive(f"the LM head at position {start} (step {self.step})")
            if not reply.arrays or reply.arrays[0].shape != (1, len(ids)):
                raise AgentError(f"agent {link.name} returned LM-head logits of the wrong shape")
            logits[ids] = reply.arrays[0][0]
        self.pos = start + len(tokens)
        self.step += 1
        return logits

    def report(self) -> list[dict]:
        """Per agent: profile, share, and the time the master spent waiting for it vs its own compute."""
        out = []
        for link, share in zip(self.links, self.shares[1:]):
            out.append({"name": link.name, "endpoint": link.endpoint, "profile": link.profile,
                        "weight_bytes": link.weight_bytes,
                        "heads": sum(map(len, share.attention)), "mlp_groups": sum(map(len, share.mlp)),
                        "vocab_groups": len(share.lm_head), **{k: round(v, 3) for k, v in link.stats.items()}})
        return out

    def reset(self) -> None:
        self.pos = 0
        self.step = 0
        for shard in self.attention.values():
            shard.reset()
        for link in self.links:
            link.send("reset", {})
        for link in self.links:
            link.receive("reset")

    def close(self) -> None:
        for link in self.links:
            try:
                link.send("bye", {})
            except Exception:  # noqa: BLE001 - closing must not fail
                pass
        self.context.destroy(linger=100)


class LocalCluster:
    """Start N halo-agent processes on loopback (with a throwaway cluster key) and stop them on exit.

    Children die with the master (PR_SET_PDEATHSIG), so a crash or Ctrl-C leaves no orphans. The
    N + 1 processes share this machine's cores: each (the master too, while the cluster runs) gets
    cores // (N + 1) BLAS threads, because oversubscribed BLAS threads spin and slow everyone ~3x."""

    def __init__(self, n: int, model_path: str | None = None, startup_timeout_s: float = 30.0):
        self.n, self.model_path, self.timeout = n, model_path, startup_timeout_s
        self.processes: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        self._dir = None
        self.key = None

    def __enter__(self) -> "LocalCluster":
        from .transport.reliable import generate_key

        from threadpoolctl import threadpool_limits

        threads = max(1, (os.cpu_count() or 1) // (self.n + 1))
        self._limits = threadpool_limits(threads)
        self._dir = tempfile.TemporaryDirectory(prefix="halo-local-")
        key_path = Path(self._dir.name) / "cluster.key"
        self.key = generate_key(key_path)
        try:
            for i in range(self.n):
                argv = [sys.executable, "-m", "halo.edge_agent", "--listen", "tcp://127.0.0.1:0", "--key", str(key_path),
                        "--name", f"local-{i + 1}", "--log-level", "WARNING", "--threads", str(threads)]
                if self.model_path:
                    argv += ["--model", str(self.model_path)]
                self.processes.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                                                       preexec_fn=_die_with_parent))
            for p in self.processes:
                self.endpoints.append(_read_endpoint(p, self.timeout))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        for p in self.processes:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._dir:
            self._dir.cleanup()
        if getattr(self, "_limits", None) is not None:
            self._limits.restore_original_limits()


def _die_with_parent() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _read_endpoint(process: subprocess.Popen, timeout_s: float) -> str:
    import select

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.1)
        if ready:
            line = process.stdout.readline()
            if line.startswith("LISTENING "):
                return line.split()[1]
            if not line and process.poll() is not None:
                break
    raise HaloError(f"a local agent did not start within {timeout_s:.0f} s (exit code {process.poll()})")
