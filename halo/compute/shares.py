"""Who computes what: a plan (scheduler) translated into each device's neuron groups.

A plan says how many groups of each block every device takes, and Algorithm 3's priority ranks say
which: rank r = group r, except heads placed by importance (rank r = the r-th most important head of
the layer, from the predictors' profile) and MLP groups in HALO mode, where a device's share of a layer
is a rank range [a, b) that halo/compute/remap.py maps to groups per token. Master and agents both read shares from
here (neither imports the other).
"""

from __future__ import annotations

from dataclasses import dataclass

from halo.compute.neuron_groups import GroupLayout
from halo.errors import ConfigError
from halo.model.quant import KERNEL_CODECS
from halo.model.weights import ModelWeights

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


#: bytes per weight for each storage format (int8/int4: one fp32 scale per block of 128 / 32), and the GGUF
#: block types halo computes in as stored (`--weights native` on a GGUF file: see `planning_format`)
BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1 + 4 / 128, "int4": 0.5 + 4 / 32,
                    **{name: codec.type_size / codec.block for name, codec in KERNEL_CODECS.items()}}


def planning_format(fmt: str, weights) -> str:
    """The BYTES_PER_WEIGHT entry a session's weight format (halo.compute.linear.FORMATS) stands for: "native" is
    the block type most of the model's layer matrices keep (a GGUF Q4_1 file: "Q4_1"), or fp32 for a model
    without compact blocks (types halo has no kernel for are dequantized to fp32 at load)."""
    from collections import Counter

    if fmt != "native":
        return fmt
    codecs = Counter(matrix.codec.name for layer in weights.layers for matrix in vars(layer).values()
                     if getattr(getattr(matrix, "codec", None), "native", False))
    return codecs.most_common(1)[0][0] if codecs else "fp32"


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


