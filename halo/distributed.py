"""The master of a tensor-parallel cluster: one forward pass over agents, in any sync mode.

`DistributedModel` has the same interface as the single-process `Transformer` (forward, reset,
max_seq_len), so `generate()` drives either. Per block, the master sends the residual stream to every
agent holding groups of that block (each applies the block's RMSNorm itself), computes its own share
meanwhile (HALO: the master is a worker too), then adds the partial sums in a fixed order (own share,
then agents in plan order), so the result is deterministic. The LM head's vocabulary slices are
gathered into full logits. How inputs and partial sums travel, and what may be dropped, is the sync
mode (halo/sync.py); `_block_relaxed` is the relaxed merge.

A plan (scheduler) says how many groups of each block every device takes; Algorithm 3's priority
ranks become concrete group indices here: rank r = group r, except MLP groups in HALO mode, which
halo/remap.py re-maps per token.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ConfigError, HaloError
from .model import DEFAULT_CONTEXT
from .neuron_groups import AttentionShard, GroupLayout, LmHeadShard, MlpShard
from .ops import Rotary, rmsnorm
from .sync import PREFIX, POINTS, STATUS_KV_GAP, STATUS_RANKING_MISMATCH, AdaptiveDeadline, LossLedger, SyncSettings, frame
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
    last_heard: float = field(default_factory=time.monotonic)  # last datagram or reply from it (liveness)

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
    """The master: same interface as `Transformer` (forward, reset, max_seq_len), over agents.

    Every block's input travels as the residual stream (each device applies the block's RMSNorm
    itself: the predictors read the residual). How it and the partial sums travel is the sync mode
    (halo/sync.py): reliable = the control connection; lossy / halo = UDP with deadlines and recovery;
    halo-tcp = TCP for broadcasts and critical partials, UDP for the rest."""

    def __init__(self, weights: ModelWeights, shares: list[Shares], endpoints: list[str], key=None,
                 insecure: bool = False, layout: GroupLayout | None = None, max_seq_len: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, hello_timeout_s: float = 10.0, probe_links: bool = True,
                 fmt: str = "fp32", sync: SyncSettings | None = None, predictors: str | None = None):
        import zmq

        from .loader import model_fingerprint
        from .transport.reliable import PROTOCOL_VERSION, client_socket

        self.sync = sync or SyncSettings()
        if self.sync.semantic and fmt != "fp32":
            raise ConfigError(f"--sync {self.sync.mode} re-maps MLP groups per token and loads them on the fly: "
                              "it needs --weights fp32")
        if len(endpoints) != len(shares) - 1:
            raise HaloError(f"the plan has {len(shares)} participants: the master and {len(shares) - 1} agents, "
                            f"but {len(endpoints)} agent addresses were given")
        c = self.config = weights.config
        self.layout = layout or GroupLayout.for_model(c)
        self.max_seq_len = min(c.max_seq_len, max_seq_len or DEFAULT_CONTEXT)
        self.weights = weights
        self.rotary = Rotary(c, self.max_seq_len)
        self.timeout_s = timeout_s
        own = shares[0]
        self.attention = {l: AttentionShard(weights.layers[l], self.layout, h, self.max_seq_len, fmt)
                          for l, h in enumerate(own.attention) if h}
        self.lm_head = LmHeadShard(weights.lm_head, self.layout, own.lm_head, fmt) if own.lm_head else None
        self.shares = shares
        self.remap = None
        self.mlp = {}
        if self.sync.semantic:  # MLP shares are rank ranges, re-mapped to groups per token
            from .loader import load_predictors
            from .remap import Remapper

            self.predictor_set = load_predictors(weights, predictors) if self.sync.predict else None
            self.remap = Remapper(weights, self.layout, {l: rank_range(g) for l, g in enumerate(own.mlp) if g},
                                  self.predictor_set, self.sync.load_overlap)
        else:
            self.mlp = {l: MlpShard(weights.layers[l], self.layout, g, fmt) for l, g in enumerate(own.mlp) if g}
        # who holds groups of which block, and the vocabulary rows of each agent's LM-head slice, worked
        # out once: the per-token loop only looks them up
        self.holders = {(kind, l): [i for i, sh in enumerate(shares[1:]) if getattr(sh, kind)[l]]
                        for kind in ("attention", "mlp") for l in range(c.n_layers)}
        self.holders[("lm_head", c.n_layers)] = [i for i, sh in enumerate(shares[1:]) if sh.lm_head]
        self.vocab_ids = [np.concatenate([np.arange(r.start, r.stop) for r in map(self.layout.vocab_rows, sh.lm_head)])
                          if sh.lm_head else None for sh in shares[1:]]
        self.pos = 0
        self.step = 0
        self.forward_id = 0
        self.own_compute_ms = 0.0  # the master's own share, summed over every forward (wall clock)
        self.own_cpu_ms = 0.0  # the same in CPU time: what it costs without other processes on the cores
        self.ledger = LossLedger()
        self.deadline = AdaptiveDeadline(self.sync)
        self.context = zmq.Context()
        self.links: list[AgentLink] = []
        self.udp = None
        hello = {"protocol": PROTOCOL_VERSION, "model_sha256": model_fingerprint(weights.source),
                 "context": self.max_seq_len, "mlp_group_size": self.layout.mlp_group_size,
                 "vocab_group_size": self.layout.vocab_group_size, "master": os.uname().nodename, "weights": fmt,
                 "sync": self.sync.to_json()}
        try:
            if self.sync.udp or probe_links:
                from .transport.udp import UdpEndpoint

                session = int.from_bytes(os.urandom(4), "little") or 1
                self.udp = UdpEndpoint(key.udp_key if key else bytes(32), session, 0, bind=("0.0.0.0", 0))
                hello["udp_session"] = session
                if self.sync.inject_plr:
                    from .transport.loss import LossInjector

                    self.udp.send_hook = LossInjector(seed=self.sync.seed, drop=self.sync.inject_plr)
            for i, (endpoint, share) in enumerate(zip(endpoints, shares[1:]), start=1):
                sock = client_socket(self.context, key, insecure)
                sock.connect(endpoint)
                link = AgentLink(f"agent-{i}", endpoint, sock, hello_timeout_s)  # loading weights may take a while
                link.send("hello", {**hello, "node_id": i, "attention": share.attention, "mlp": share.mlp,
                                    "lm_head": share.lm_head})
                self.links.append(link)
            for link in self.links:
                reply = link.receive("hello")
                link.name = f"{reply.fields.get('name', link.name)}#{self.links.index(link) + 1}"
                link.profile = reply.fields.get("profile", {})
                link.udp_port = reply.fields.get("udp_port")
                link.weight_bytes = int(reply.fields.get("weight_bytes", 0))
                link.timeout_s = timeout_s
            if self.sync.udp and any(not link.udp_port for link in self.links):
                raise AgentError(f"--sync {self.sync.mode} needs every agent's UDP port; upgrade the agents")
            self.addresses = [(link.endpoint.split("://", 1)[-1].rsplit(":", 1)[0], int(link.udp_port or 0))
                              for link in self.links]
            if probe_links:
                self._probe_links()
        except BaseException:
            self.close()
            raise

    def _probe_links(self) -> None:
        """Measure each agent's link (loss, RTT, bandwidth) over UDP: the scheduler's PLR and latency.
        The probes also tell each agent where the master's UDP endpoint is."""
        from .transport.probe import probe

        for link, address in zip(self.links, self.addresses):
            if address[1]:
                result = probe(self.udp, address, count=50, interval_s=0.0002, burst=16, wait_s=0.05)
                link.profile = {**link.profile, "link": result.to_json()}

    # ---- the forward pass ------------------------------------------------------------------------------------
    def forward(self, tokens, start_pos: int | None = None, all_logits: bool = False) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        start = self.pos if start_pos is None else start_pos
        if tokens.ndim != 1 or len(tokens) == 0 or tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError("forward needs a non-empty 1-D sequence of valid token ids")
        if start + len(tokens) > self.max_seq_len:
            raise ValueError(f"{start + len(tokens)} positions exceed the context length {self.max_seq_len}")
        self.forward_id += 1
        if self.remap is not None:
            self.remap.begin()
        w = self.weights
        x = np.array(w.tok_embeddings[tokens], dtype=np.float32)
        for l in range(self.config.n_layers):
            x = x + self._block("attention", l, x, start)
            x = x + self._block("mlp", l, x, start)
        head_input = x if all_logits else x[-1:]
        logits = self._block("lm_head", self.config.n_layers, head_input, start)
        self.pos = start + len(tokens)
        self.step += 1
        return logits if all_logits else logits[0]

    def _own(self, kind: str, layer: int, x: np.ndarray, start: int):
        """The master's own share of a block (None: it holds none)."""
        t, cpu = time.perf_counter(), time.thread_time()
        eps, w = self.config.norm_eps, self.weights
        out = None
        if kind == "attention" and layer in self.attention:
            out = self.attention[layer].forward(rmsnorm(x, w.layers[layer].attn_norm, eps), start, self.rotary)
        elif kind == "mlp":
            h = rmsnorm(x, w.layers[layer].mlp_norm, eps)
            out = self.remap.mlp_partial(layer, h) if self.remap else (self.mlp[layer].forward(h) if layer in self.mlp else None)
        elif kind == "lm_head":
            out = np.zeros((len(x), self.config.vocab_size), dtype=np.float32)
            if self.lm_head is not None:
                out[:, self.lm_head.token_ids] = self.lm_head.forward(rmsnorm(x, w.final_norm, eps))
        self.own_compute_ms += 1e3 * (time.perf_counter() - t)
        self.own_cpu_ms += 1e3 * (time.thread_time() - cpu)
        return out

    def _predict_next(self, kind: str, layer: int, x: np.ndarray) -> None:
        if self.remap is not None and kind == "attention":
            self.remap.predict(layer + 1, x)

    def _merge(self, kind: str, out: np.ndarray, link_index: int, partial: np.ndarray) -> np.ndarray:
        if kind == "lm_head":
            out[:, self.vocab_ids[link_index]] = partial
            return out
        return out + partial

    def _block(self, kind: str, layer: int, x: np.ndarray, start: int) -> np.ndarray:
        """One block: send the residual x to the agents that need it, compute the own share, merge the
        partial outputs (in a fixed order: own share, then agents in plan order; deterministic)."""
        holders = self.holders[(kind, layer)]
        if self.sync.mode == "reliable":
            for i in holders:
                self.links[i].send("block", {"kind": kind, "layer": layer, "start_pos": start}, [x])
            out = self._own(kind, layer, x, start)
            out = np.zeros_like(x) if out is None else out
            for i in holders:
                out = self._merge(kind, out, i, self._tcp_partial(self.links[i], kind, layer, start, len(x)))
            self._predict_next(kind, layer, x)
            return out
        return self._block_relaxed(kind, layer, x, start, holders)

    def _tcp_partial(self, link: AgentLink, kind: str, layer: int, start: int, tokens: int) -> np.ndarray:
        reply = link.receive(f"{kind} of layer {layer} at position {start} (step {self.step})")
        partial = reply.arrays[0] if reply.arrays else None
        width = self.config.dim if kind != "lm_head" else len(self.vocab_ids[self.links.index(link)])
        if partial is None or partial.shape != (tokens, width):
            raise AgentError(f"agent {link.name} returned a {kind} partial of shape "
                             f"{None if partial is None else partial.shape}, expected {(tokens, width)}")
        link.stats["compute_ms"] += float(reply.fields.get("compute_ms", 0.0))
        link.stats["cpu_ms"] += float(reply.fields.get("cpu_ms", 0.0))
        return partial

    def _critical(self, kind: str, layer: int, holders: list[int]) -> set[int]:
        """Agents whose partial must arrive whole (module docstring of halo/sync.py)."""
        if kind == "lm_head" or layer == 0:
            return set(holders)
        if not self.sync.semantic:
            return set()
        if kind == "mlp":
            cut = math.ceil(self.sync.critical_fraction * self.layout.n_mlp_groups)
            return {i for i in holders if rank_range(self.shares[i + 1].mlp[layer])[0] < cut}
        ranking = self.remap.head_rankings.get(layer)
        if ranking is None:
            return set(holders)
        top = set(np.unique(ranking[:, :math.ceil(self.sync.critical_fraction * self.layout.n_heads)]).tolist())
        return {i for i in holders if top & set(self.shares[i + 1].attention[layer])}

    def _block_relaxed(self, kind: str, layer: int, x: np.ndarray, start: int, holders: list[int]) -> np.ndarray:
        from .transport import wire

        T, s = len(x), self.sync
        point = POINTS[kind]
        epoch = wire.make_epoch(self.forward_id, layer, point)
        receivers = list(holders)
        if kind == "attention" and self.remap is not None and layer + 1 < self.config.n_layers:
            # agents with MLP ranks in the next layer predict from this input: they need it too
            receivers += [i for i in self.holders[("mlp", layer + 1)] if i not in holders]
        critical = self._critical(kind, layer, holders)
        digest = self.remap.digest(layer) if (kind == "mlp" and self.remap) else 0
        if s.udp_broadcast:
            payload = frame([T, start, digest, 0], x, wire.values_per_chunk(wire.FLOAT32))
            for i in receivers:
                self.udp.send_vector(self.addresses[i], i + 1, epoch, payload, parity_group=s.parity_group)
        else:  # halo-tcp: inputs over TCP; critical partials come back the same way
            for i in receivers:
                reply = "tcp" if i in critical else ("udp" if i in holders else "none")
                self.links[i].send("block", {"kind": kind, "layer": layer, "start_pos": start, "epoch": epoch,
                                             "digest": digest, "reply": reply}, [x])
        sent = time.perf_counter()
        out = self._own(kind, layer, x, start)
        out = np.zeros_like(x) if out is None else out
        if s.pred_overlap:
            self._predict_next(kind, layer, x)  # while the partial sums are in flight
        over_udp = receivers if s.udp_broadcast else [i for i in holders if i not in critical]
        width = {i: (self.config.dim if kind != "lm_head" else len(self.vocab_ids[i])) if i in holders else 0
                 for i in over_udp}
        expected = {i + 1: PREFIX + T * width[i] for i in over_udp}
        deadline = self.deadline.deadline_s(kind, [i + 1 for i in holders], T)
        must = {i + 1 for i in critical if i + 1 in expected} | {i + 1 for i in receivers if i not in holders}
        nack = set(expected) if s.semantic else must
        recover = set(expected) if s.semantic else must  # lossy: no recovery of plain partials

        def on_silent(peer):
            if peer not in recover:
                return
            if s.udp_broadcast:  # it may have lost its whole input: send it again (it re-sends its partial)
                self.udp.resend(epoch, peer)
            else:  # it has its input (TCP): ask for every chunk of its partial
                self.udp.request_all(epoch + 1, peer, expected[peer], wire.FLOAT32, self.addresses[peer - 1])
        gathered_at = time.perf_counter()
        result = self.udp.gather(epoch + 1, expected, wire.FLOAT32, deadline_s=max(0.0, deadline - (gathered_at - sent)),
                                 nack=nack, must_complete=must, hard_deadline_s=self.timeout_s,
                                 silent_s=max(0.6 * deadline, 0.001), on_silent=on_silent) if expected else None
        if any(i not in critical for i in holders):
            self.ledger.blocks += 1
        for i in holders:
            link = self.links[i]
            if result is None or i + 1 not in expected:
                continue
            values, mask = result.values[i + 1], result.masks[i + 1]
            if i + 1 in must and not mask.all():
                raise AgentError(f"agent {link.name} ({link.endpoint}) did not deliver its {kind} partial of layer "
                                 f"{layer} within {self.timeout_s:.1f} s: it stopped or its link is down")
            now = time.monotonic()
            if i + 1 in result.heard:
                link.last_heard = now
            elif now - link.last_heard > self.timeout_s:
                raise AgentError(f"agent {link.name} ({link.endpoint}) has sent nothing for {now - link.last_heard:.1f} s "
                                 "(every partial since was dropped): it stopped or its link is down")
            if i + 1 in result.done_s:
                self.deadline.observe(kind, i + 1, gathered_at - sent + result.done_s[i + 1], T)
            chunks = len(mask)
            missing = chunks if not mask[0] else int((~mask).sum())  # no prefix: nothing of it can be trusted
            if mask[0]:
                if values[2] == STATUS_KV_GAP:
                    raise AgentError(f"agent {link.name} never received an attention input its KV cache needs "
                                     "(its link lost everything for a second); start the generation again")
                if values[2] == STATUS_RANKING_MISMATCH:
                    raise AgentError(f"agent {link.name} ranked layer {layer}'s groups differently from the master "
                                     "(different predictors or onnxruntime build); use the same halo release "
                                     "everywhere, or --sync lossy")
                link.stats["compute_ms"] += float(values[0])
            self._account(kind, layer, i, T, missing, chunks)
            if missing == chunks:
                continue
            out = self._merge(kind, out, i, values[PREFIX:PREFIX + T * width[i]].reshape(T, width[i]))
        if not s.udp_broadcast:
            for i in holders:
                if i in critical:
                    out = self._merge(kind, out, i, self._tcp_partial(self.links[i], kind, layer, start, T))
        if not s.pred_overlap:
            self._predict_next(kind, layer, x)
        return out

    def _account(self, kind: str, layer: int, i: int, tokens: int, missing: int, chunks: int) -> None:
        share = self.shares[i + 1]
        if kind == "lm_head":
            return
        if kind == "mlp":
            ranks = list(range(*rank_range(share.mlp[layer]))) if self.remap is not None else share.mlp[layer]
        else:
            ranking = self.remap.head_rankings.get(layer) if self.remap is not None else None
            heads = share.attention[layer]
            ranks = ([int(np.flatnonzero(ranking[-1] == h)[0]) for h in heads] if ranking is not None else heads)
        self.ledger.record(kind, layer, len(ranks) * tokens, missing, chunks, ranks if missing else None)

    def report(self) -> list[dict]:
        """Per agent: profile, share, and the time the master spent waiting for it vs its own compute."""
        out = []
        for i, (link, share) in enumerate(zip(self.links, self.shares[1:])):
            row = {"name": link.name, "endpoint": link.endpoint, "profile": link.profile,
                   "weight_bytes": link.weight_bytes,
                   "heads": sum(map(len, share.attention)), "mlp_groups": sum(map(len, share.mlp)),
                   "vocab_groups": len(share.lm_head), **{k: round(v, 3) for k, v in link.stats.items()}}
            if self.udp is not None and self.sync.udp:
                row["udp"] = self.udp.stats[i + 1].to_json()
            out.append(row)
        return out

    def sync_report(self) -> dict:
        """The sync mode, its settings and what it lost (the loss ledger)."""
        out = {"settings": self.sync.to_json(), "loss": self.ledger.to_json()}
        if self.remap is not None:
            out["predict_ms"] = round(self.remap.predict_ms, 3)
            out["load_ms"] = round(self.remap.load_ms, 3)
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
        if self.remap is not None:
            self.remap.close()
        if self.udp is not None:
            self.udp.close()
        self.context.destroy(linger=100)


def rank_range(ranks: list[int]) -> tuple[int, int]:
    """A device's MLP share of a layer as a rank range [a, b) (Algorithm 3 gives contiguous ranks)."""
    if not ranks:
        return (0, 0)
    a, b = min(ranks), max(ranks) + 1
    if b - a != len(ranks):
        raise ConfigError(f"MLP ranks {ranks} are not one contiguous range; HALO mode needs a priority-rank plan")
    return a, b


def connect(weights: ModelWeights, stack, *, model_path: str | None = None, local_agents: int = 0,
            agents: list[str] | None = None, cluster: str | None = None, plan: str | None = None,
            key: str | None = "/etc/halo/cluster.key", insecure: bool = False, context: int | None = None,
            timeout: float = DEFAULT_TIMEOUT_S, fmt: str = "fp32", sync: SyncSettings | None = None,
            predictors: str | None = None, mode: str = "tp", pipeline: dict | None = None) -> "DistributedModel":
    """A master over agents from one of: local_agents (started here, stopped when `stack` closes), agent
    addresses, a cluster file (planned here) or a saved plan. `stack` (an ExitStack) owns what it starts.
    mode "pipeline" (or a pipeline plan) builds a pipeline coordinator instead (halo/pipeline/connect.py;
    `pipeline` holds its own options)."""
    from .transport.reliable import load_key

    if mode == "pipeline" or (plan and _plan_mode(plan) == "pipeline"):
        from .pipeline.connect import connect_pipeline

        return connect_pipeline(weights, stack, model_path=model_path, local_workers=local_agents, workers=agents,
                                cluster=cluster, plan=plan, key=key, insecure=insecure, context=context,
                                timeout=timeout, fmt=fmt, **(pipeline or {}))

    layout = GroupLayout.for_model(weights.config)
    context = min(weights.config.max_seq_len, context or DEFAULT_CONTEXT)
    cluster_key = None
    if local_agents:
        if local_agents < 0 or agents or cluster:
            raise ConfigError("--local-agents N starts its own agents: do not combine it with --agents or --cluster")
        local = stack.enter_context(LocalCluster(local_agents, model_path, predictors=predictors))
        endpoints, cluster_key = local.endpoints, local.key
    elif agents:
        endpoints = [a if a.startswith("tcp://") else f"tcp://{a}" for a in agents]
    else:
        endpoints = None
    if cluster_key is None and not insecure:
        cluster_key = load_key(key)
    if plan:
        from .scheduler import plan_io

        tp_plan = plan_io.load(plan)
        if isinstance(tp_plan, tuple):
            raise ConfigError(f"{plan} is a pipeline plan; generate needs a tensor-parallel (--mode tp) plan")
    elif cluster:
        from .scheduler.profiles import load_cluster, model_profile
        from .scheduler.tp_plan import plan_tp

        cluster_file = load_cluster(cluster)
        profile = model_profile(weights.config, cluster_file.weights, mlp_group_size=layout.mlp_group_size,
                                vocab_group_size=layout.vocab_group_size)
        tp_plan = plan_tp(cluster_file, profile)
    elif endpoints is not None:
        tp_plan = even_plan(weights, layout, len(endpoints) + 1, context=context)
    else:
        raise ConfigError("no agents: give local_agents, agent addresses, a cluster file or a plan")
    if endpoints is None:
        endpoints = []
        for d in tp_plan.profiles()[1:]:
            if not d.address:
                raise ConfigError(f"device {d.name!r} of the plan has no address; give --agents or set address =")
            endpoints.append(d.address if d.address.startswith("tcp://") else f"tcp://{d.address}")
    shares = shares_from_plan(tp_plan, weights.config.n_layers)
    model = DistributedModel(weights, shares, endpoints, cluster_key, insecure, layout, context, timeout, fmt=fmt,
                             sync=sync, predictors=predictors)
    stack.callback(model.close)
    return model


def _plan_mode(path: str) -> str | None:
    """A plan file's mode, or None where it cannot be read (plan_io.load then says why)."""
    import json

    try:
        return json.loads(Path(path).read_text()).get("mode")
    except (OSError, ValueError, AttributeError):
        return None


class LocalCluster:
    """Start N halo-agent processes on loopback (with a throwaway cluster key) and stop them on exit.

    Children die with the master (PR_SET_PDEATHSIG), so a crash or Ctrl-C leaves no orphans. The
    N + 1 processes share this machine's cores: each (the master too, while the cluster runs) gets
    cores // (N + 1) BLAS threads, because oversubscribed BLAS threads spin and slow everyone ~3x."""

    def __init__(self, n: int, model_path: str | None = None, startup_timeout_s: float = 30.0,
                 predictors: str | None = None, extra_args: tuple = ()):
        self.n, self.model_path, self.timeout = n, model_path, startup_timeout_s
        self.predictors, self.extra_args = predictors, tuple(extra_args)
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
                if self.predictors:
                    argv += ["--predictors", str(self.predictors)]
                argv += list(self.extra_args)
                self.processes.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                                                       preexec_fn=_die_with_parent))
            for p in self.processes:
                self.endpoints.append(read_endpoint(p, self.timeout))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop_processes(self.processes)
        if self._dir:
            self._dir.cleanup()
        if getattr(self, "_limits", None) is not None:
            self._limits.restore_original_limits()


def stop_processes(processes: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM (agents drain and leave), then SIGKILL whoever is still there after grace_s."""
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _die_with_parent() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def read_endpoint(process: subprocess.Popen, timeout_s: float) -> str:
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
