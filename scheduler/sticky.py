"""Sticky re-plans: after a device leaves, the others keep their groups and split the lost ones; when it returns, it
takes its own back. Built groups and KV caches stay where they are."""

from __future__ import annotations

import numpy as np

from halo.compute.shares import Shares
from halo.errors import ConfigError
from halo.scheduler.tp_plan import round_counts


def spread_lost(kept: list[Shares], lost: list[Shares]) -> list[Shares]:
    """A sticky re-plan after a loss: every device in `kept` keeps its groups (and the kernels built for them)
    and the groups the `lost` devices held are split among them, block by block, in runs of consecutive groups
    sized by each device's current total (the plan's balance carries over: a device with twice the groups
    takes twice the lost ones; one that held nothing takes nothing unless all held nothing)."""
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
