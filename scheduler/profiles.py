"""What the scheduler plans with: device profiles (from a cluster file or measured) and model profiles.

Units: bytes, FLOP/s, seconds, bits/s. A cluster file is TOML:

    [cluster]
    context = 2048          # tokens of KV cache every plan must hold
    weights = "int4"        # weight format the devices store (fp32, fp16, int8, int4)

    [[device]]
    name = "pi-1"
    address = "192.168.1.20:7070"   # optional; "browser": a tab that opens the worker page (pipeline mode);
                                    # "local" (the master): this process
    memory_mb = 3000                # budget halo may use on the device
    compute_gflops = 14.4           # effective FLOP/s on matrix-vector work
    plr = 0.01                      # packet loss rate of its link, 0..1
    bandwidth_mbps = 100
    latency_ms = 1.0                # one way
    overhead_ms = 0.05              # optional: fixed cost of one block's kernels on the device (dispatch)
    message_ms = 0.05               # optional: CPU time to receive one block input and send its partial
    master = true                   # exactly one device coordinates; default: the first

Measured profiles (halo/distributed/session.py: `measure_cluster`) fill the same fields from a kernel
benchmark on each device, its available memory and a link probe.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from halo.arguments import check_integer, check_number, parse_endpoint
from halo.compute.neuron_groups import default_mlp_group_size
from halo.compute.shares import BYTES_PER_WEIGHT, planning_format
from halo.errors import ConfigError
from halo.model.config import ModelConfig

MB = 1_000_000

KV_BYTES = 4  # halo keeps the KV cache in fp32
SPECIAL_ADDRESSES = ("browser", "local")  # a tab that opens the worker page; the master's own process


@dataclass(frozen=True)
class DeviceProfile:
    """One device as the planner sees it (address "": not reachable by address, e.g. the master)."""

    name: str
    memory_bytes: float
    compute_flops: float
    plr: float = 0.0
    bandwidth_bps: float = 1e9
    latency_s: float = 0.5e-3
    address: str = ""
    is_master: bool = False
    # fixed cost of computing one block's share whatever its size (dispatch), for attention, MLP, LM head
    overhead_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    message_s: float = 0.0  # CPU time to take in one block input and send one partial (framing, syscalls)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a device name must be a non-empty string, got {self.name!r}")
        where = f"device {self.name!r}"
        check_number(self.memory_bytes, f"{where}: the memory budget", 0, low_open=True)
        check_number(self.compute_flops, f"{where}: the compute power", 0, low_open=True)
        check_number(self.plr, f"{where}: plr is a loss rate and", 0, 1, high_open=True)
        check_number(self.bandwidth_bps, f"{where}: the bandwidth", 0, low_open=True)
        check_number(self.latency_s, f"{where}: the latency", 0)
        if not isinstance(self.address, str):
            raise ConfigError(f"{where}: address must be a string such as \"192.168.1.20:7070\", got {self.address!r}")
        if self.address and self.address not in SPECIAL_ADDRESSES:
            try:
                parse_endpoint(self.address)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e} (or \"browser\" for a tab, \"local\" for the master)") from None
        if isinstance(self.overhead_s, (int, float)):  # one figure for every kind of block
            object.__setattr__(self, "overhead_s", (self.overhead_s,) * 3)
        if not isinstance(self.overhead_s, (list, tuple)) or len(self.overhead_s) != 3:
            raise ConfigError(f"{where}: overhead times must be three non-negative numbers, got {self.overhead_s!r:.80}")
        object.__setattr__(self, "overhead_s", tuple(check_number(o, f"{where}: an overhead time", 0)
                                                     for o in self.overhead_s))
        check_number(self.message_s, f"{where}: the message time", 0)


@dataclass(frozen=True)
class Cluster:
    devices: tuple[DeviceProfile, ...]
    context: int = 2048
    weights: str = "int8"

    def __post_init__(self):
        if not self.devices:
            raise ConfigError("the cluster has no devices")
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise ConfigError(f"device names must be unique, got {names}")
        if sum(d.is_master for d in self.devices) > 1:
            raise ConfigError("more than one device says master = true")
        addresses = [parse_endpoint(d.address) for d in self.devices if d.address and d.address not in SPECIAL_ADDRESSES]
        twice = sorted({a for a in addresses if addresses.count(a) > 1})
        if twice:  # one agent planned as two: a busy refusal, or a run re-planned onto the master alone
            raise ConfigError(f"address {twice[0]} is given to more than one device: one agent serves one share")
        if self.weights not in BYTES_PER_WEIGHT:
            raise ConfigError(f"weights = {self.weights!r}: choose one of {', '.join(BYTES_PER_WEIGHT)}")
        # a whole number of tokens, a plain int (a numpy integer could not be saved as JSON, 512.5 could not load)
        object.__setattr__(self, "context", check_integer(self.context, "the cluster's context", 1))

    @property
    def master(self) -> int:
        """Index of the coordinating device (it holds the embeddings and samples tokens)."""
        for i, d in enumerate(self.devices):
            if d.is_master:
                return i
        return 0


def load_cluster(path: str | Path, weights: str = "int8") -> Cluster:
    """weights: the format a file without [cluster] weights plans for (a run's own, where one asks)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: no such cluster file") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the cluster file ({e})") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: nested too deeply for a cluster file") from None
    settings = raw.get("cluster", {})
    tables = raw.get("device", [])
    if not isinstance(settings, dict):
        raise ConfigError(f"{path}: 'cluster' must be a [cluster] table")
    for where, keys, allowed_keys in ((path, raw, ("cluster", "device")), (f"{path}: [cluster]", settings,
                                                                            ("context", "weights"))):
        unknown = sorted(set(keys) - set(allowed_keys))
        if unknown:  # a misspelt [clustre] or contxt planned for the defaults without a word
            raise ConfigError(f"{where} has unknown keys {unknown}; allowed: {', '.join(allowed_keys)}")
    if not isinstance(tables, list) or not all(isinstance(d, dict) for d in tables):
        raise ConfigError(f"{path}: 'device' must be [[device]] tables")
    devices = []
    allowed = {"name", "address", "memory_mb", "compute_gflops", "plr", "bandwidth_mbps", "latency_ms", "master",
               "overhead_ms", "message_ms"}
    for i, d in enumerate(tables):
        where = f"{path}: device #{i + 1}"
        unknown = set(d) - allowed
        if unknown:
            raise ConfigError(f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        missing = sorted({"memory_mb", "compute_gflops"} - set(d))
        if missing:
            raise ConfigError(f"{where} lacks the required key {missing[0]}")
        if not isinstance(d.get("master", False), bool):
            raise ConfigError(f"{where}: master must be true or false, got {d['master']!r}")
        number = {key: check_number(d.get(key, default), f"{where}: {key}")
                  for key, default in (("memory_mb", 0), ("compute_gflops", 0), ("plr", 0.0), ("bandwidth_mbps", 1000),
                                       ("latency_ms", 0.5), ("overhead_ms", 0.0), ("message_ms", 0.0))}
        try:
            devices.append(DeviceProfile(
                name=str(d.get("name", f"device-{i}")), memory_bytes=number["memory_mb"] * MB,
                compute_flops=number["compute_gflops"] * 1e9, plr=number["plr"],
                bandwidth_bps=number["bandwidth_mbps"] * 1e6, latency_s=number["latency_ms"] / 1e3,
                address=d.get("address", ""), is_master=d.get("master", False),
                overhead_s=number["overhead_ms"] / 1e3, message_s=number["message_ms"] / 1e3))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    if not devices:
        raise ConfigError(f"{path}: no [[device]] tables; see `halo-master plan --help` for the format")
    context = check_integer(settings.get("context", 2048), f"{path}: [cluster] context", 1)
    return Cluster(tuple(devices), context, str(settings.get("weights", weights)))


def check_plan_fits(made, config, layout=None) -> None:
    """A given plan (`halo-master plan --out`) was made for a model (made: its ModelProfile) of this one's layers,
    width and, for a tensor-parallel plan (layout), groups; or a ConfigError naming what differs (a TP plan failed as
    an IndexError deep in the shares, a pipeline plan of another model's width ran with its memory figures)."""
    theirs = {"layers": made.n_layers, "width": made.dim}
    ours = {"layers": config.n_layers, "width": config.dim}
    if layout is not None:
        theirs.update({"attention heads": made.attention.count, "MLP groups": made.mlp.count,
                       "LM-head groups": made.lm_head.count})
        ours.update({"attention heads": layout.n_attention_groups, "MLP groups": layout.n_mlp_groups,
                     "LM-head groups": layout.n_vocab_groups})
    differ = [f"{what} {theirs[what]} (this model: {ours[what]})" for what in ours if theirs[what] != ours[what]]
    if differ:
        raise ConfigError(f"the plan was made for another model ({made.name}: {', '.join(differ)}): make one for this "
                          "model with `halo-master plan --model MODEL ... --out plan.json`")


def check_plan_budget(cluster, weights, fmt: str, kv_tokens: int) -> None:
    """A plan (a cluster file's, or a saved one) budgets each device's memory for its [cluster] weights and context:
    a run that needs more (wider weights, a longer context) is refused, naming both (it ran with the file's
    figures ignored: an agent then refused its share for memory, or the run went past a device's budget)."""
    def fits(f: str) -> bool:
        return BYTES_PER_WEIGHT[planning_format(f, weights)] <= BYTES_PER_WEIGHT[cluster.weights] * 1.01

    if not fits(fmt):
        from halo.compute.linear import FORMATS

        would = [f for f in FORMATS if fits(f)]  # (the advice named a --weights the run could not take: int4)
        raise ConfigError(f"the plan budgets memory for {cluster.weights} weights and this run computes in "
                          f"{planning_format(fmt, weights)} (--weights {fmt}): "
                          + (f"pass --weights {would[0]}, or " if would else "")
                          + f"set weights = \"{planning_format(fmt, weights)}\" in the cluster file and plan again")
    if kv_tokens > cluster.context:
        raise ConfigError(f"the plan budgets a KV cache of {cluster.context} tokens and this run needs {kv_tokens} "
                          "(--context x --slots): pass a smaller --context, or set context in the cluster file and "
                          "plan again")


@dataclass(frozen=True)
class BlockProfile:
    """One kind of neuron group: how many per layer, and what one group costs."""

    kind: str  # "attention", "mlp" or "lm_head"
    count: int  # groups per layer (lm_head: in the whole model)
    bytes: float  # weight bytes of one group
    flops: float  # FLOPs of one group per token
    kv_bytes_per_token: float = 0.0  # attention: KV-cache bytes one head needs per token of context


@dataclass(frozen=True)
class ModelProfile:
    name: str
    n_layers: int
    dim: int
    attention: BlockProfile
    mlp: BlockProfile
    lm_head: BlockProfile
    embedding_bytes: float  # held by the master only
    predictor_bytes: float = 0.0  # every participant holds all predictors
    rows: int = 1  # tokens a forward pass carries (a batched server: its slots); flops and vectors are per pass

    @property
    def tp_blocks(self) -> tuple[BlockProfile, BlockProfile]:
        return self.attention, self.mlp

    def total_bytes(self, context: int) -> float:
        """Everything the cluster must hold: weights, KV cache for `context` tokens, embeddings."""
        per_layer = sum(b.count * (b.bytes + b.kv_bytes_per_token * context) for b in self.tp_blocks)
        return self.n_layers * per_layer + self.lm_head.count * self.lm_head.bytes + self.embedding_bytes

    def group_bytes(self, block: BlockProfile, context: int) -> float:
        return block.bytes + block.kv_bytes_per_token * context


def model_profile(config: ModelConfig, weights: str = "int8", name: str = "", mlp_group_size: int | None = None,
                  vocab_group_size: int = 256, predictor_hidden: int = 0, rows: int = 1) -> ModelProfile:
    """Per-group costs of a model; the same decomposition as halo.compute.neuron_groups. rows: tokens a pass carries (a
    server decoding `rows` requests together): a group's compute and a round's vectors grow with them, its weights
    do not, so a plan for a batch weighs compute more against the rounds' fixed costs."""
    if weights not in BYTES_PER_WEIGHT:
        raise ConfigError(f"unknown weight format {weights!r}; choose one of {', '.join(BYTES_PER_WEIGHT)}")
    bpw = BYTES_PER_WEIGHT[weights]
    c = config
    mlp_group_size = mlp_group_size or default_mlp_group_size(c.hidden_dim)
    rep = c.n_heads // c.n_kv_heads
    # one head: its q rows and o columns, plus its share of the K/V rows of its KV head
    head_params = 2 * c.head_dim * c.dim + 2 * c.head_dim * c.dim / rep
    neuron_params = 3 * c.dim
    n_mlp = math.ceil(c.hidden_dim / mlp_group_size)
    n_vocab = math.ceil(c.vocab_size / vocab_group_size)
    mlp_params = neuron_params * c.hidden_dim / n_mlp  # the mean group (a remainder group is smaller)
    vocab_params = c.dim * c.vocab_size / n_vocab
    predictor = 0.0
    if predictor_hidden:
        per_layer = c.dim * predictor_hidden + predictor_hidden * (c.n_heads + n_mlp)
        predictor = 4.0 * c.n_layers * per_layer
    return ModelProfile(
        name=name or f"{c.n_layers}L-{c.dim}d",
        n_layers=c.n_layers, dim=c.dim,
        attention=BlockProfile("attention", c.n_heads, head_params * bpw, 2 * head_params * rows,
                               kv_bytes_per_token=2 * c.head_dim * KV_BYTES / rep),
        mlp=BlockProfile("mlp", n_mlp, mlp_params * bpw, 2 * mlp_params * rows),
        lm_head=BlockProfile("lm_head", n_vocab, vocab_params * bpw, 2 * vocab_params * rows),
        embedding_bytes=c.vocab_size * c.dim * bpw,
        predictor_bytes=predictor,
        rows=rows,
    )


#: Shapes for what-if planning without the weights.
NAMED_CONFIGS = {
    "llama-3.1-8b": ModelConfig(dim=4096, hidden_dim=14336, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                max_seq_len=131072, rope_theta=500000.0),
    "llama-2-13b": ModelConfig(dim=5120, hidden_dim=13824, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000,
                               max_seq_len=4096),
    "llama-2-7b": ModelConfig(dim=4096, hidden_dim=11008, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                              max_seq_len=4096),
    "tinyllama-1.1b": ModelConfig(dim=2048, hidden_dim=5632, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000,
                                  max_seq_len=2048),
    "stories260k": ModelConfig(dim=64, hidden_dim=172, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512,
                               max_seq_len=512),
}


def named_config(name: str) -> ModelConfig:
    try:
        return NAMED_CONFIGS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown model config {name!r}; known: {', '.join(NAMED_CONFIGS)}") from None


MEMORY_HEADROOM = 0.85  # of the memory a device reports available, what a plan may fill


def measured_device(name: str, measured: dict, link: dict | None = None, address: str = "",
                    is_master: bool = False) -> DeviceProfile:
    """A device profile from what the device measured (halo/runtime/measure.py: kernels, message cost,
    available memory) and, for an agent, the master's probe of its link (transport/probe.py). Malformed
    figures raise ConfigError naming the device."""
    try:
        overhead = tuple(float(o) for o in measured["overhead_s"])
        memory = float(measured["memory_available_bytes"]) * MEMORY_HEADROOM
        if measured.get("memory_budget_bytes") is not None:  # an agent's own budget (halo-agent --memory-budget)
            memory = min(memory, float(measured["memory_budget_bytes"]))
        compute, message = float(measured["compute_flops"]), float(measured["message_s"])
        plr = latency = 0.0
        bandwidth = 1e9
        if link:
            # the least round trip: the path's delay without the echo's own waiting (a busy or capped peer's
            # CPU time is in message_s already)
            plr, latency = float(link["plr"]), float(link.get("rtt_ms_min", link["rtt_ms_p50"])) / 2e3
            bandwidth = float(link["bandwidth_bps"]) or bandwidth  # 0: too few burst echoes to tell
        if not math.isfinite(latency):
            raise ConfigError(f"device {name!r}: no probe of its link came back; check its UDP port and firewall")
        return DeviceProfile(name, memory, compute, plr=plr, bandwidth_bps=bandwidth, latency_s=latency, address=address,
                             is_master=is_master, overhead_s=overhead, message_s=message)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"device {name!r} reported a malformed profile ({e!r}); run the same halo version everywhere")


