"""Continuous batching: every forward pass carries a row for each running request, and prompt pieces of those that joined.

A request takes a free KV-cache slot (the model keeps `slots` of them: halo/compute/batch.py) as soon as one is free, at any
pass, and gives it back when it ends (EOS, its token budget, a stop string, its client gone, its deadline). Each pass:

- one row per request that is decoding (its last chosen token, at its next position);
- pieces of the prompts still being read, oldest request first, in what the decode rows leave of `pass_rows`
  (generate.prefill_chunk: a pass's vectors stay within what a round carries at once; the engine keeps its slots
  within it), so a long prompt never stalls the others more than one such piece a pass;
- then each request whose last row was in the pass samples its next token with its own sampler.

Every device computes each row of a batched pass as a decode step of its own (the same bits whatever else is in the
pass: halo/compute/worker.py), so a request's greedy text is the text it gets served alone. A slot's stale positions are never
read: a new request writes from position 0 and attends only to positions it wrote.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from halo.compute.batch import Rows
from halo.generation.generate import Continuation
from halo.generation.sampling import Sampler


@dataclass
class Running:
    """One request in the batch: its slot, its prompt, what it has read and chosen."""

    slot: int
    prompt_ids: list[int]
    going: Continuation
    sample: Sampler
    owner: object  # the serving engine's job
    read: int = 0  # positions in its KV cache: prompt tokens read, then tokens fed back
    chosen: int | None = None  # the token sampled last, to be fed in the next pass
    error: Exception | None = None  # its own failure (its sampler's): it alone ends
    joined: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)  # when each token was chosen

    @property
    def prefilling(self) -> bool:
        return self.read < len(self.prompt_ids)

    @property
    def prefill_ms(self) -> float:
        return 1e3 * (self.token_times[0] - self.joined) if self.token_times else 0.0

    @property
    def decode_ms(self) -> list[float]:
        """Per token after the first: the time since the one before (a batch's pace as this request saw it)."""
        return [1e3 * (b - a) for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass(frozen=True)
class Pass:
    """What one forward pass carries: the tokens, where each row goes, and the request of each sequence in it."""

    tokens: list[int]
    rows: Rows
    members: list[Running]  # in row order, one per sequence


def next_pass(running: list[Running], pass_rows: int) -> Pass | None:
    """The rows of the next pass over the running requests (oldest first), or None when none has anything to read:
    every decoding request's row, and prompt pieces in what is left of `pass_rows` (at least one row)."""
    tokens, pieces, members = [], [], []
    budget = max(1, pass_rows - sum(1 for r in running if not r.prefilling and r.chosen is not None))
    for r in running:
        if r.prefilling:
            if budget <= 0:
                continue
            piece = r.prompt_ids[r.read:r.read + budget]
            budget -= len(piece)
        elif r.chosen is not None:
            piece = [r.chosen]
        else:
            continue
        tokens.extend(piece)
        pieces.append((r.slot, r.read, len(piece)))
        members.append(r)
    return Pass(tokens, Rows.of(pieces), members) if members else None


def take_pass(step: Pass, logits: np.ndarray) -> list[Running]:
    """Each member's part of a pass done: positions read; where its last row was its prompt's last token or a decode
    token, its next token sampled and taken. The requests that ended (their Continuation says why, or their `error`)."""
    now, ended = time.perf_counter(), []
    for member, segment, row_logits in zip(step.members, step.rows.segments, logits):
        member.read += segment.last - segment.first
        member.chosen = None
        if member.prefilling:
            continue
        if member.going.max_new_tokens == 0:
            ended.append(member)
            continue
        try:
            token = member.sample(row_logits)
            member.token_times.append(now)
            done = member.going.take(token)
        except Exception as e:  # noqa: BLE001 - a request's own error (its sampler, its text callback) ends it alone
            member.error, done = e, True
        if done:
            ended.append(member)
        else:
            member.chosen = token
    return ended
