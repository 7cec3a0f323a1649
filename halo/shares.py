"""Who computes what: a plan (scheduler) translated into each device's neuron groups.

A plan says how many groups of each block every device takes, and Algorithm 3's priority ranks say
which: rank r = group r, except heads placed by importance (rank r = the r-th most important head of
the layer, from the predictors' profile) and MLP groups in HALO mode, where a device's share of a layer
is a rank range [a, b) that halo/remap.py maps to groups per token. Master and agents both read shares from
here (neither imports the other).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from halo.errors import ConfigError
from halo.config import DEFAULT_CONTEXT
from halo.neuron_groups import GroupLayout
from halo.weights import ModelWeights

KINDS = ("attention", "mlp", "lm_head")


@dataclass(frozen=True)
class Block:
    """One synchronization unit: a layer's attention or MLP block, or the LM head (layer = n_layers)."""

    kind: str
    layer: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"unknown block kind {self.kind!r}")

    def __str__(self) -> str:
        return "LM head" if self.kind == "lm_head" else f"{self.kind} of layer {self.layer}"


@dataclass
class Shares:
    """The groups one device computes: heads and MLP groups per layer, LM-head vocabulary groups."""

    attention: list[list[int]]
    mlp: list[list[int]]
    lm_head: list[int]

    def groups(self, block: Block) -> list[int]:
        return self.lm_head if block.kind == "lm_head" else getattr(self, block.kind)[block.layer]

    def holds(self, block: Block) -> bool:
        return bool(self.groups(block))

    def to_json(self) -> dict:
        return {"attention": self.attention, "mlp": self.mlp, "lm_head": self.lm_head}


def everything(config, layout: GroupLayout, layers=None, lm_head: bool = True) -> Shares:
    """Every group of `layers` (default: all) and of the LM head: the single-process reference's share, or a
    pipeline stage's."""
    layers = set(range(config.n_layers) if layers is None else layers)
    return Shares(attention=[list(range(layout.n_attention_groups)) if l in layers else [] for l in range(config.n_layers)],
                  mlp=[list(range(layout.n_mlp_groups)) if l in layers else [] for l in range(config.n_layers)],
                  lm_head=list(range(layout.n_vocab_groups)) if lm_head else [])


def shares_from_plan(plan, n_layers: int, head_order=None) -> list[Shares]:
    """Concrete group indices per participant (plan order, master first) from a TensorParallelPlan.

    head_order: [L, H] heads of each layer from the most to the least important (the predictors' profile,
    halo.scheduler.importance); the plan's attention rank r of layer l is then head head_order[l][r], so the
    heads that matter most sit on the master and the most reliable links. None: rank r = head r."""
    ranks = {kind: plan.priority_ranks(kind) for kind in KINDS}
    heads = place_by_rank(ranks["attention"], head_order)
    return [Shares(attention=heads[j],
                   mlp=[list(range(*ranks["mlp"][j, l])) for l in range(n_layers)],
                   lm_head=list(range(*ranks["lm_head"][j, 0])))
            for j in range(plan.n)]


def place_by_rank(ranges, order=None) -> list[list[list[int]]]:
    """Rank ranges [n, L, 2] -> each participant's groups per layer (sorted): ranks [a, b) of layer l are
    groups order[l][a:b] (order: [L, G] groups by importance; None: rank r = group r)."""
    n, n_layers = len(ranges), len(ranges[0]) if len(ranges) else 0
    if order is not None:
        order = [list(map(int, row)) for row in order]
        width = max((int(b) for device in ranges for _, b in device), default=0)
        if len(order) != n_layers or any(sorted(row) != list(range(len(row))) or len(row) < width for row in order):
            raise ConfigError(f"a head order must be a permutation of the groups for each of the {n_layers} layers")
    return [[sorted(order[l][a:b]) if order is not None else list(range(a, b)) for l, (a, b) in enumerate(ranges[j])]
            for j in range(n)]


# even plans by keyword (--plan): the blocks kept whole on the master. "even-mlp": every head there, so a token syncs
# once a layer (its MLP) instead of twice; "even-mlp-only": the LM head too, so no logits slices cross the network;
# "paired-mlp": as even-mlp-only, each layer's MLP halved between the master and one agent in turn (PAIRED_PLANS)
EVEN_PLANS = {"even": (), "even-mlp": ("attention",), "even-mlp-only": ("attention", "lm_head"),
              "paired-mlp": ("attention", "lm_head")}
PAIRED_PLANS = ("paired-mlp",)  # scheduler/tp_plan.py `paired`: for agents that share the master's cores
PLAN_KEYWORDS = ("measured", *EVEN_PLANS)  # what --plan takes besides a plan file


def even_plan(weights: ModelWeights, layout: GroupLayout, n_devices: int, compute: list[float] | None = None,
              context: int = DEFAULT_CONTEXT, on_master: tuple[str, ...] = (), paired: bool = False):
    """A plan for n equal local devices (or devices with the given relative compute), all taking part; on_master:
    blocks kept whole on the master (scheduler/tp_plan.py `on_master`): "attention" (one sync round a layer),
    "lm_head" (no logits slices on the wire); paired: each layer's MLP halved between the master and one agent,
    the agents taking the layers in turn (tp_plan.py `paired`)."""
    from halo.scheduler.profiles import Cluster, DeviceProfile, model_profile
    from halo.scheduler.tp_plan import build_plan, check_master_kinds
    from halo.scheduler.tp_plan import on_master as move
    from halo.scheduler.tp_plan import paired as pair

    check_master_kinds(on_master)
    if paired and compute is not None:
        raise ConfigError("a paired plan halves each layer's MLP between the master and one agent: relative compute "
                          "figures do not apply (give an even plan with them)")

    compute = compute or [1.0] * n_devices
    if len(compute) != n_devices:
        raise ConfigError(f"{len(compute)} compute figures for {n_devices} devices")
    devices = tuple(DeviceProfile(f"device-{i}", 64e9, c * 1e9, is_master=i == 0) for i, c in enumerate(compute))
    profile = model_profile(weights.config, "fp32", mlp_group_size=layout.mlp_group_size,
                            vocab_group_size=layout.vocab_group_size)
    # every device stays a participant (one may get no groups): the caller has one agent per device
    plan = build_plan(Cluster(devices, context=context, weights="fp32"), profile, "minmax", prune=False)
    plan = move(plan, tuple(on_master)) if on_master and n_devices > 1 else plan
    return pair(plan) if paired else plan


def share_float32_bytes(share: Shares, layout: GroupLayout, dim: int) -> int:
    """The float32 bytes of a share's weights: what an agent reads (and quantizes) while answering hello."""
    head = dim * layout.head_dim * (2 + 2 * layout.n_kv_heads / layout.n_heads)  # W_q, W_o rows; its part of W_k, W_v
    params = (sum(map(len, share.attention)) * head + sum(map(len, share.mlp)) * 3 * dim * layout.mlp_group_size
              + len(share.lm_head) * layout.vocab_group_size * dim)
    return int(4 * params)


def kv_cache_bytes(share: Shares, layout: GroupLayout, context: int) -> int:
    """The float32 KV cache a share keeps: K and V of the KV heads its query heads read, `context` positions."""
    kv_heads = sum(len({layout.kv_head(h) for h in heads}) for heads in share.attention)
    return 2 * 4 * kv_heads * context * layout.head_dim


def share_memory(share: Shares, layout: GroupLayout, weights: ModelWeights, fmt: str, context: int,
                 slots: int = 1) -> tuple[int, int]:
    """What a share holds in memory: its weights in `fmt` and its KV caches for `context` positions in each of `slots`
    (bytes)."""
    from halo.scheduler.profiles import BYTES_PER_WEIGHT, planning_format

    held = share_float32_bytes(share, layout, weights.config.dim) / 4 * BYTES_PER_WEIGHT[planning_format(fmt, weights)]
    return int(held), kv_cache_bytes(share, layout, context * slots)


def rank_range(ranks: list[int]) -> tuple[int, int]:
    """A device's MLP share of a layer as a rank range [a, b) (Algorithm 3 gives contiguous ranks)."""
    if not ranks:
        return (0, 0)
    a, b = min(ranks), max(ranks) + 1
    if b - a != len(ranks):
        raise ConfigError(f"MLP ranks {ranks} are not one contiguous range; HALO mode needs a priority-rank plan")
    return a, b


def spread_lost(kept: list[Shares], lost: list[Shares]) -> list[Shares]:
    """A sticky re-plan after a loss: every device in `kept` keeps its groups (and the kernels built for them)
    and the groups the `lost` devices held are split among them, block by block, in runs of consecutive groups
    sized by each device's current total (the plan's balance carries over: a device with twice the groups
    takes twice the lost ones; one that held nothing takes nothing unless all held nothing)."""
    from halo.scheduler.tp_plan import round_counts

    if not kept:
        raise ConfigError("no device is left to take the lost groups")
    sizes = np.array([sum(map(len, s.attention)) + sum(map(len, s.mlp)) + len(s.lm_head) for s in kept], float)
    weights = sizes / sizes.sum() if sizes.sum() > 0 else np.full(len(kept), 1 / len(kept))
    out = [Shares([list(a) for a in s.attention], [list(m) for m in s.mlp], list(s.lm_head)) for s in kept]

    n_layers = len(kept[0].attention)

    def split(groups: list[int], layer: int = 0, layers: int = 1) -> list[list[int]]:
        counts = round_counts(weights, len(groups), layers)[:, layer]  # remainders rotate over the blocks
        bounds = np.concatenate([[0], np.cumsum(counts)])
        return [groups[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    for k, kind in enumerate(("attention", "mlp")):
        for layer in range(n_layers):
            gone = sorted(g for s in lost for g in getattr(s, kind)[layer])
            for share, part in zip(out, split(gone, k * n_layers + layer, 2 * n_layers)):
                getattr(share, kind)[layer] = sorted(getattr(share, kind)[layer] + part)
    for share, part in zip(out, split(sorted(g for s in lost for g in s.lm_head))):
        share.lm_head = sorted(share.lm_head + part)
    return out


def take_back(shares: list[Shares], home: Shares) -> list[Shares]:
    """A sticky join: the returning device takes back its `home` share (what it held in the last full plan);
    every other device gives up those groups (the pieces it took when the device left: nothing to build)."""
    def minus(groups: list[int], gone: list[int]) -> list[int]:
        gone = set(gone)
        return [g for g in groups if g not in gone]

    return [Shares([minus(a, h) for a, h in zip(s.attention, home.attention)],
                   [minus(m, h) for m, h in zip(s.mlp, home.mlp)], minus(s.lm_head, home.lm_head)) for s in shares]
