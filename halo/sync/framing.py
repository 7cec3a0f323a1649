"""What master and agents put inside UDP vectors: the epoch of a round, the prefix of each vector, statuses.

The datagram format itself (header, chunks, tag) is transport/wire.py; this module is the one place
that gives its opaque 64-bit epoch and the vector's first floats a meaning, for both sides.

Epoch = (forward pass << 20) | (layer << 4) | sync point. A layer has three sync points for inputs
(attention 0, MLP 2, LM head 4); a partial answering an input carries the input's epoch + 1, so
epochs grow monotonically through a forward pass and a reply never collides with an input.
The forward-pass counter only grows within a session: a re-run of the same positions never reuses
an epoch.

Vectors carry a 4-float prefix (floats hold integers exactly below 2^24, so digests are 24-bit):
- broadcast (an input): [tokens, start position, ranking digest, G + NEXT x has-next], then the input [T, D],
  then (start = ROWS: a batched pass of several sequences, halo/compute/batch.py) each row's KV-cache slot and position
  [T, 2], then (G > 0, HALO's MLP inputs) the master's ranking of the layer's G groups per token [T, G] and (has-next)
  its ranking of the next layer's [T, G], padded with zeros to whole chunks, so a receiver learns the size from
  the chunk count. With the ranking in the input an agent needs no prediction of its own (nor the input of the
  attention block before, which it would predict from): it computes the groups the master ranked; the rankings
  usually ride in the last chunk's padding. The next layer's tells an agent that reads its groups from storage
  (a memory budget) which to read while the master works on the next attention block: it loads ahead without
  running predictors of its own (wire version 5);
- partial (an answer): [compute ms, 0, status, 0].
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from halo.compute.batch import Rows
from halo.compute.remap import ranking_digest

PREFIX = 4
FORWARD_SHIFT, LAYER_SHIFT = 20, 4
MAX_LAYERS = 1 << (FORWARD_SHIFT - LAYER_SHIFT)


class Point(IntEnum):
    """Sync points of a layer's inputs; a partial answering one carries point + 1."""

    ATTENTION = 0
    MLP = 2
    LM_HEAD = 4


class Status(IntEnum):
    """What an agent says about the partial it sends."""

    OK = 1
    RANKING_MISMATCH = 2  # its predictors ranked the layer differently from the master's digest
    KV_GAP = 3  # an attention input never reached it: its KV caches are incomplete until the next reset


class FramingError(ValueError):
    """A vector whose prefix or size makes no sense (a bug or a forgery with a valid tag)."""


@dataclass(frozen=True)
class Epoch:
    forward: int
    layer: int
    point: Point

    def encode(self) -> int:
        if not (0 <= self.layer < MAX_LAYERS and self.forward >= 0):
            raise ValueError(f"epoch fields out of range: forward={self.forward} layer={self.layer}")
        return (self.forward << FORWARD_SHIFT) | (self.layer << LAYER_SHIFT) | int(self.point)

    @classmethod
    def decode(cls, value: int) -> "Epoch":
        """The input epoch a value names (a reply's value decodes to the input it answers)."""
        point = value & ((1 << LAYER_SHIFT) - 1)
        point -= point % 2
        if point not in Point._value2member_map_:
            raise FramingError(f"epoch {value:#x} names no sync point")
        return cls(value >> FORWARD_SHIFT, (value >> LAYER_SHIFT) & (MAX_LAYERS - 1), Point(point))


def reply_epoch(input_epoch: int) -> int:
    """The epoch of the partial that answers an input."""
    return input_epoch + 1


def is_reply(epoch: int) -> bool:
    return bool(epoch & 1)


def attention_inputs_between(after: int, newest: int, layers) -> list[int]:
    """Epochs of attention inputs of `layers` strictly between two input epochs, oldest first: the inputs
    an agent's KV caches need that it has not handled (forward passes are numbered consecutively, so
    every one of them was sent)."""
    first, last = max(1, after >> FORWARD_SHIFT), newest >> FORWARD_SHIFT
    ordered = sorted(layers)
    if ordered and not 0 <= ordered[0] <= ordered[-1] < MAX_LAYERS:
        raise ValueError(f"layers {ordered[0]}..{ordered[-1]} outside 0..{MAX_LAYERS - 1}")
    # Epoch(f, l, ATTENTION).encode(), without an object per layer and round (an agent asks every round)
    epochs = ((f << FORWARD_SHIFT) | (l << LAYER_SHIFT) | int(Point.ATTENTION) for f in range(first, last + 1)
              for l in ordered)
    return [e for e in epochs if after < e < newest]


def forward_passes_between(after: int, newest: int) -> int:
    return (newest >> FORWARD_SHIFT) - (after >> FORWARD_SHIFT)


MAX_RANKED_GROUPS = 1 << 15  # groups a broadcast ranking may order (rankings are int16: ranking_digest)
NEXT = 1 << 16  # added to the prefix's G where the next layer's ranking follows this layer's (exact in float32)
ROWS = -1  # the prefix's start position of a batched pass: each row's slot and position follow the input


@dataclass(frozen=True)
class Broadcast:
    tokens: int
    start: int | Rows  # a batched pass: where each row belongs
    digest: int
    x: np.ndarray  # [tokens, dim]
    ranking: np.ndarray | None = None  # [tokens, G] the master's MLP ranking (HALO), most important group first
    next_ranking: np.ndarray | None = None  # [tokens, G] its ranking of the next layer (to load its groups ahead)


def frame_broadcast(x: np.ndarray, start: int | Rows, digest: int, per_chunk: int, ranking: np.ndarray | None = None,
                    next_ranking: np.ndarray | None = None) -> np.ndarray:
    """An input [T, D] at positions start.. or where `Rows` says (and the master's ranking [T, G] of an MLP input, and
    of the next layer's) as one float32 vector, padded to whole chunks of per_chunk values."""
    if isinstance(start, Rows):
        x, start = [x, start.table], ROWS
    else:
        x = [x]
    if ranking is None:
        return _frame([len(x[0]), start, digest, 0], x, per_chunk)
    rankings = [np.asarray(r).reshape(len(x[0]), -1) for r in (ranking, next_ranking) if r is not None]  # exact in float32
    if len({r.shape for r in rankings}) != 1:
        raise ValueError(f"the next layer's ranking {rankings[-1].shape} is not shaped as this layer's {rankings[0].shape}")
    return _frame([len(x[0]), start, digest, rankings[0].shape[1] + NEXT * (len(rankings) - 1)], [*x, *rankings], per_chunk)


def read_broadcast(values: np.ndarray, dim: int) -> Broadcast:
    tokens, start, digest, ranked = int(values[0]), int(values[1]), int(values[2]), values[3]
    table = 2 * tokens if start == ROWS else 0
    if tokens <= 0 or (start < 0 and start != ROWS) or PREFIX + tokens * dim + table > len(values):
        raise FramingError(f"a broadcast of {len(values)} values claims {tokens} tokens at position {start}")
    x = values[PREFIX:PREFIX + tokens * dim].reshape(tokens, dim)
    at = PREFIX + tokens * dim + table
    if table:
        where = values[at - table:at].tolist()
        try:
            if any(v != int(v) for v in where):
                raise ValueError("a row's slot or position is not a whole number")
            start = Rows.from_table(map(int, where[0::2]), map(int, where[1::2]))
        except (ValueError, OverflowError) as e:
            raise FramingError(f"a batched broadcast's rows make no sense: {e}") from None
    if ranked == 0:
        return Broadcast(tokens, start, digest, x)
    count = 2 if ranked > NEXT else 1
    groups = ranked - NEXT * (count - 1)
    if not (0 < groups <= MAX_RANKED_GROUPS and groups == int(groups)) or \
            at + tokens * count * int(groups) > len(values):
        raise FramingError(f"a broadcast of {len(values)} values claims {'a ranking' if count == 1 else 'two rankings'} "
                           f"of {float(groups):g} groups for {tokens} tokens")
    groups = int(groups)
    rankings = [values[at + i * tokens * groups:at + (i + 1) * tokens * groups].reshape(tokens, groups)
                for i in range(count)]
    for r in rankings:
        if not (np.sort(r, axis=1) == np.arange(groups, dtype=np.float32)).all():
            raise FramingError(f"a broadcast's ranking of {groups} groups is not an order of them")
    if ranking_digest(rankings[0]) != digest:
        raise FramingError("a broadcast's ranking does not match the digest it came with")
    return Broadcast(tokens, start, digest, x, *(r.astype(np.int64) for r in rankings))


def frame_partial(out: np.ndarray | None, status: Status, compute_ms: float) -> np.ndarray:
    """A partial output (None: an acknowledgement, no values) as one float32 vector."""
    return _frame([compute_ms, 0, int(status), 0], [] if out is None else [out])


def partial_size(tokens: int, width: int) -> int:
    return PREFIX + tokens * width


@dataclass(frozen=True)
class Partial:
    compute_ms: float
    status: Status
    values: np.ndarray  # [tokens, width]


def read_partial(values: np.ndarray, tokens: int, width: int) -> Partial:
    """The prefix must have arrived (chunk 0); an unknown status is a FramingError."""
    try:
        status = Status(int(values[2]))
    except ValueError:
        raise FramingError(f"unknown partial status {values[2]!r}") from None
    body = values[PREFIX:PREFIX + tokens * width].reshape(tokens, width)
    return Partial(float(values[0]), status, body)


def _frame(prefix: list[float], arrays: list[np.ndarray], per_chunk: int | None = None) -> np.ndarray:
    """The prefix, then the arrays, as one float32 vector padded with zeros to whole chunks of per_chunk values:
    written into one buffer (every round sends one; concatenating, then padding, copied it twice)."""
    sizes = [np.size(a) for a in arrays]
    n = PREFIX + sum(sizes)
    body = np.zeros(n + (-n % per_chunk if per_chunk else 0), dtype=np.float32)
    body[:PREFIX] = prefix
    at = PREFIX
    for array, size in zip(arrays, sizes):
        body[at:at + size] = np.ravel(array)
        at += size
    return body
