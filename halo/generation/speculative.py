"""Speculative decoding: draft a few tokens cheaply, verify them in one pass through the model.

A decode step through the cluster costs one sync round per synced block whatever the number of positions it
carries, and on a real link every round costs a network round trip. A *verification pass* runs the last
chosen token and k drafted ones at once; the target model's logits at each position say how many drafts it
would itself have chosen. Accepted drafts cost no round of their own.

Drafts come from the text itself (prompt lookup: the last few tokens found earlier in the prompt or output,
and what followed them there) or from a small model on the master (`DraftModel`, same tokenizer). Both draft
greedily, so a draft is a point mass and the acceptance rule is the standard one for it: greedy decoding
accepts a draft where it is the argmax; sampling accepts draft d with probability p(d) and otherwise draws
from p with d removed, so every token is distributed as the target model's sampler says.

Exactness: a pass of at most `STEPWISE_TOKENS` runs position by position on every device (halo/compute/worker.py), so
its logits are bit for bit those of decoding the tokens one by one: greedy output with speculation is the
output without it. Drafts beyond the accepted ones leave K/V entries past the position the next pass starts
at; attention reads positions up to its own, and the next pass overwrites them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from halo.compute.worker import STEPWISE_TOKENS
from halo.errors import ConfigError
from halo.generation.sampling import Sampler, check_finite

MAX_DRAFTS = STEPWISE_TOKENS - 1  # the last chosen token rides in the pass too


@dataclass(frozen=True)
class SpeculationSettings:
    """max_drafts: the most drafted tokens one pass verifies (0: no speculation); the number used adapts to the
    running acceptance (`DraftBudget`). ngram: prompt lookup matches the last `ngram` .. `min_ngram` tokens."""

    max_drafts: int = 0
    ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        for name in ("max_drafts", "ngram", "min_ngram"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"--speculate settings: {name} must be an integer, got {value!r}")
        if not 0 <= self.max_drafts <= MAX_DRAFTS:
            raise ConfigError(f"--speculate must be 0 (off) to {MAX_DRAFTS} drafted tokens a pass, got {self.max_drafts}")
        if not 1 <= self.min_ngram <= self.ngram <= 16:
            raise ConfigError(f"--lookup-ngram must satisfy 1 <= min <= max <= 16, got {self.min_ngram}..{self.ngram}")

    @property
    def enabled(self) -> bool:
        return self.max_drafts > 0


class Drafter(Protocol):
    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `context` (the prompt and every token chosen so far)."""
        ...


class PromptLookup:
    """Drafts from the text so far: the most recent earlier occurrence of its last n tokens (n from `ngram` down
    to `min_ngram`), and the tokens that followed it there, as many as the text before the two agrees (a match of
    one token drafts one: a word repeated is rarely a passage repeated; each rejected draft costs a position's
    compute and bytes on every link). Free to compute; strong wherever the output copies its input (rewriting,
    summarizing, code edits), silent (no drafts, a plain decode step) elsewhere."""

    def __init__(self, ngram: int = 3, min_ngram: int = 1):
        self.ngram, self.min_ngram = ngram, min_ngram

    def propose(self, context: list[int], k: int) -> list[int]:
        if k <= 0 or len(context) < 2:
            return []
        tokens = np.asarray(context, dtype=np.int64)
        for n in range(min(self.ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            # windows of tokens[:-1]: every earlier n-gram that has at least one token after it
            windows = sliding_window_view(tokens[:-1], n)
            found = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(found):
                at = int(found[-1])
                agree = n  # how far back the text before the occurrence and before the end agree (up to k)
                while agree < k and at - (agree - n) > 0 and tokens[at - (agree - n) - 1] == tokens[-agree - 1]:
                    agree += 1
                return tokens[at + n:at + n + min(k, agree)].tolist()
        return []


class DraftModel:
    """Drafts greedily from a small model on the master (`--draft MODEL`: the same tokenizer). Its KV cache keeps
    the context it last saw; each proposal feeds only what changed since (the accepted drafts and the target's
    own token), so a draft costs one small decode step."""

    def __init__(self, model, target_vocab_size: int):
        vocab = model.config.vocab_size
        if vocab != target_vocab_size:
            raise ConfigError(f"the draft model has a vocabulary of {vocab} tokens, the model {target_vocab_size}: "
                              "a draft model must share the model's tokenizer")
        self.model = model
        self.cached: list[int] = []  # tokens whose K/V the draft model holds, in order

    def propose(self, context: list[int], k: int) -> list[int]:
        room = self.model.max_seq_len - len(context)
        k = min(k, room)
        if k <= 0:
            return []
        common = 0
        for a, b in zip(self.cached, context):
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)  # at least one token to feed: its logits are the first draft's
        logits = self.model.forward(context[common:], start_pos=common)
        self.cached = list(context)
        drafts: list[int] = []
        while True:
            drafts.append(int(np.argmax(logits)))
            if len(drafts) == k:
                return drafts
            logits = self.model.forward(drafts[-1:], start_pos=len(self.cached))
            self.cached.append(drafts[-1])

    def reset(self) -> None:
        self.cached = []


class DraftBudget:
    """How many tokens to draft next: one more after a pass that accepted every draft (two while all keep being
    accepted), one fewer after a rejection; between 1 and max_drafts. A rejected draft costs compute (each
    position of a pass is computed) but no round."""

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self.k = max(1, max_drafts // 2)

    def update(self, drafted: int, accepted: int) -> None:
        """After a pass that verified `drafted` (>= 1) drafts and accepted `accepted` of them."""
        self.k = min(self.max_drafts, self.k + 2) if accepted == drafted else max(1, self.k - 1)


@dataclass
class SpeculationStats:
    """What speculation did in one generation: passes after the prompt, tokens drafted, drafts accepted."""

    passes: int = 0
    drafting_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens the passes produced (accepted drafts + one chosen by the model each pass)
    rounds_per_pass: int | None = None  # the model's synced blocks per pass (None: one process, no rounds)
    draft_ms: float = 0.0
    per_pass: list[int] = field(default_factory=list)  # drafts accepted, per drafting pass

    def record(self, drafted: int, chosen: int) -> None:
        """A pass that verified `drafted` drafts and yielded `chosen` tokens (the accepted drafts and one more)."""
        self.passes += 1
        self.tokens += chosen
        if drafted:
            self.drafting_passes += 1
            self.drafted += drafted
            self.accepted += chosen - 1
            self.per_pass.append(chosen - 1)

    def discard(self, n: int) -> None:
        """The last pass's last n tokens were not used (they came after its EOS, or past the budget): neither
        produced nor accepted (the figures overstated a pass that ended the text)."""
        if n <= 0:
            return
        self.tokens -= n
        if self.per_pass:  # (the pass's own last token is among the n, never an accepted draft)
            cut = min(n - 1, self.per_pass[-1])
            self.per_pass[-1] -= cut
            self.accepted -= cut

    @property
    def rounds_per_token(self) -> float | None:
        """Sync rounds a token cost (None: one process, or no pass yet)."""
        if self.rounds_per_pass is None or not self.tokens:
            return None
        return self.passes * self.rounds_per_pass / self.tokens

    def to_json(self) -> dict:
        out = {"passes": self.passes, "drafting_passes": self.drafting_passes, "drafted": self.drafted,
               "accepted": self.accepted,
               "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
               "tokens_per_pass": round(self.tokens / self.passes, 4) if self.passes else None,
               "draft_ms": round(self.draft_ms, 3)}
        if self.rounds_per_token is not None:
            out["rounds_per_token"] = round(self.rounds_per_token, 3)
        return out


class Speculator:
    """One generation's speculative passes: drafts (`drafter`, default prompt lookup) as many as the budget and the
    room left allow, the pass through the model, the tokens it yields, the figures."""

    def __init__(self, settings: SpeculationSettings, drafter: Drafter | None, sampler: Sampler,
                 rounds_per_pass: int | None = None):
        self.drafter = drafter or PromptLookup(settings.ngram, settings.min_ngram)
        self.budget = DraftBudget(settings.max_drafts)
        self.sampler = sampler
        self.stats = SpeculationStats(rounds_per_pass=rounds_per_pass)
        if hasattr(self.drafter, "reset"):
            self.drafter.reset()

    def next_pass(self, model, context: list[int], room: int) -> list[int]:
        """context: the prompt and the tokens chosen so far, the last not yet through the model; room: the most
        tokens the pass may add beyond the one it always yields (the token budget, the context left)."""
        t = time.perf_counter()
        drafts = self.drafter.propose(context, min(self.budget.k, room)) if room > 0 else []
        self.stats.draft_ms += (time.perf_counter() - t) * 1e3
        logits = model.forward(context[-1:] + drafts, start_pos=len(context) - 1, all_logits=True)
        chosen = accept(logits, drafts, self.sampler)
        self.stats.record(len(drafts), len(chosen))
        if drafts:
            self.budget.update(len(drafts), len(chosen) - 1)
        return chosen


def accept(logits: np.ndarray, drafts: list[int], sampler: Sampler) -> list[int]:
    """The tokens a verification pass yields: the drafts the model accepts, in order, then one token of its own
    (the correction at the first rejection, or the next one after them all). logits [len(drafts) + 1, V]: the
    model's at the last chosen token and at each draft."""
    check_finite(logits)
    out: list[int] = []
    for i, draft in enumerate(drafts):
        probs = sampler.probabilities(logits[i])
        if probs is None:  # greedy: the draft stands where it is the model's own choice
            choice = int(np.argmax(logits[i]))
            if choice != draft:
                return out + [choice]
        elif sampler.rng.random() >= probs[draft]:  # accepted with probability p(draft) (a point-mass draft)
            rest = probs.copy()
            rest[draft] = 0.0  # rejected: p without the draft, renormalized (max(p - q, 0) for q = the point mass)
            return out + [sampler.draw(rest / rest.sum())]
        out.append(draft)
    return out + [sampler(logits[len(drafts)])]


def speculation_from(speculate: int | None, draft: str | None, vocab_size: int, context: int | None = None,
                     threads: int = 1) -> tuple[SpeculationSettings, DraftModel | None]:
    """--speculate K and --draft MODEL (generate, serve) as settings and a drafter (None: prompt lookup); the draft
    model is loaded here in its own weight format, checked against the model's vocabulary."""
    k = speculate if speculate is not None else (4 if draft else 0)
    settings = SpeculationSettings(max_drafts=k)
    if not draft:
        return settings, None
    if not k:
        raise ConfigError("--draft drafts tokens for --speculate K: give K >= 1 (or leave --speculate out: 4)")
    from halo.arguments import check_path
    from halo.compute.linear import resolve_format
    from halo.compute.transformer import Transformer
    from halo.model.catalog import resolve_model
    from halo.model.loader import load_weights

    path = str(resolve_model(draft))
    check_path("--draft", path, "model file or directory")
    weights = load_weights(path)
    model = Transformer(weights, fmt=resolve_format("native", weights), max_seq_len=context, threads=threads)
    return settings, DraftModel(model, vocab_size)
