"""Several sequences in one forward pass (continuous batching): where each row of the residual stream belongs.

A pass of one sequence names its first position (an int). A pass of several names, per row, the KV-cache slot of
its sequence and its position there: `Rows`. Each slot's rows are consecutive and at consecutive positions (one
request's prompt piece, or its one decode token), so attention runs per slot as it would alone; the other blocks see
rows only. Every device computes each row of a batched pass with the bits of a decode step of its own (the C steps take
the rows together, each weight read once), so a request's tokens do not depend on what it was batched with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from halo.errors import ConfigError, HaloError

class RowsError(HaloError, ValueError):
    """Rows that make no sense, or that a model cannot hold (a slot it lacks, a position past its context): a device
    refuses the pass and goes on."""


MAX_SLOTS = 256  # KV-cache slots one device keeps (a row's slot travels as a float: any such count is exact)
DEFAULT_SLOTS = 8  # halo-master serve's: requests decoded together


def check_slots(slots: int) -> int:
    if not (isinstance(slots, int) and 1 <= slots <= MAX_SLOTS):
        raise ConfigError(f"--slots must be 1..{MAX_SLOTS} (sequences decoded together), got {slots!r}")
    return slots


def check_tokens(tokens, vocab_size: int) -> np.ndarray:
    """A pass's token ids as int64, or ValueError: a non-empty 1-D sequence of ids the vocabulary has."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ValueError("forward needs a non-empty 1-D sequence of token ids")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"token ids must lie in 0..{vocab_size - 1}")
    return tokens


def check_span(start: int, tokens: int, context: int) -> None:
    """A single sequence's pass at positions start..start+tokens-1, or ValueError: inside the context."""
    if start < 0:
        raise ValueError(f"start position {start} is negative")
    if start + tokens > context:
        raise ValueError(f"{start + tokens} positions exceed the context length {context}")


@dataclass(frozen=True)
class Segment:
    """Rows first..last-1 of a pass: one slot's tokens at positions start.."""

    first: int
    last: int
    slot: int
    start: int


@dataclass(frozen=True)
class Rows:
    """A batched pass's rows, as runs of one slot's consecutive positions (Python ints: every round of every device
    reads one, and numpy's per-call cost was most of it)."""

    segments: tuple[Segment, ...]

    def __post_init__(self):
        at, seen = 0, set()
        for s in self.segments:
            if s.first != at or s.last <= s.first or s.slot < 0 or s.start < 0 or s.slot in seen:
                raise RowsError("a pass's rows are runs of one slot's consecutive positions, each slot in one run, "
                                 "none negative")
            at = s.last
            seen.add(s.slot)
        if not self.segments:
            raise RowsError("a batched pass has at least one row")

    @classmethod
    def of(cls, pieces) -> "Rows":
        """From (slot, first position, tokens) per sequence, in row order."""
        segments, at = [], 0
        for slot, start, n in pieces:
            segments.append(Segment(at, at + n, int(slot), int(start)))
            at += n
        return cls(tuple(segments))

    @classmethod
    def from_table(cls, slots, positions) -> "Rows":
        """From each row's slot and position (what travels with a round's input): consecutive rows of one slot at
        consecutive positions form a run."""
        s, p = list(slots), list(positions)
        if len(s) != len(p):
            raise RowsError(f"{len(s)} slots for {len(p)} positions")
        segments, first = [], 0
        for i in range(1, len(s) + 1):
            if i == len(s) or s[i] != s[i - 1] or p[i] != p[i - 1] + 1:
                segments.append(Segment(first, i, int(s[first]), int(p[first])))
                first = i
        return cls(tuple(segments))

    def __len__(self) -> int:
        return self.segments[-1].last

    @cached_property
    def table(self) -> np.ndarray:
        """[T, 2] int32: each row's slot and position (what the wire and the C attention step take; built once: every
        round sends it, every attention block reads it). Read-only."""
        out = np.empty((len(self), 2), dtype=np.int32)
        for s in self.segments:
            out[s.first:s.last, 0] = s.slot
            out[s.first:s.last, 1] = np.arange(s.start, s.start + s.last - s.first)
        out.flags.writeable = False
        return out

    @property
    def last_rows(self) -> np.ndarray:
        """Each sequence's last row: the one whose logits choose its next token."""
        return np.array([s.last - 1 for s in self.segments], dtype=np.int64)

    def last_only(self) -> "Rows":
        """Each sequence's last row alone (the LM head's input)."""
        return Rows.of([(s.slot, s.start + s.last - s.first - 1, 1) for s in self.segments])

    def check(self, tokens: int, context: int, slots: int) -> None:
        """ValueError unless the rows fit `tokens` rows, a context of `context` positions and `slots` slots."""
        if len(self) != tokens:
            raise RowsError(f"{len(self)} rows named for a pass of {tokens} tokens")
        last_slot = max(s.slot for s in self.segments)
        if last_slot >= slots:
            raise RowsError(f"slot {last_slot} named; this model keeps {slots} KV-cache slots (0..{slots - 1})")
        end = max(s.start + s.last - s.first for s in self.segments)
        if end > context:
            raise RowsError(f"position {end - 1} exceeds the context length {context}")
