"""The generation loop: prefill the prompt, then decode one token at a time.

Works with any model that has `forward(tokens, start_pos, all_logits) -> logits of the last token (or of each)`,
`reset()` and `max_seq_len`: the single-process reference or the distributed master.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from halo.errors import ConfigError, HaloError
from halo.generation.sampling import Sampler, SamplingSettings
from halo.generation.speculative import Drafter, SpeculationSettings, SpeculationStats, Speculator
from halo.model.tokenizer import Tokenizer


PREFILL_VECTOR_BYTES = 512 << 10  # a prompt's pass: [T, dim] float32 vectors of at most this (see prefill)


def prefill_chunk(dim: int) -> int:
    """Tokens a prompt's pass takes at once: a power of two (at least 16) whose [T, dim] float32 vector stays within
    PREFILL_VECTOR_BYTES (Llama-3.1-8B's width: 32; SmolLM2's: 128; stories260K's: 2048)."""
    return 1 << max(4, (PREFILL_VECTOR_BYTES // (4 * dim)).bit_length() - 1)


def largest_pass_vector_bytes(dim: int, context: int, slots: int = 1) -> int:
    """The largest [T, dim] float32 vector a pass sends: a prompt's chunk (at most the context) or a batch's rows."""
    return 4 * dim * max(min(prefill_chunk(dim), context), slots)


def prefill(model: "LanguageModel", prompt_ids: list[int]) -> np.ndarray:
    """The prompt's passes, `prefill_chunk` tokens each: the logits of its last token. A cluster's round carries
    each agent's [T, dim] partial sum over UDP at once: a 512-token prompt on the Llama-3.1-8B shape made 8.4 MB
    partials that 3 agents sent together into the master's 4 MB receive buffer, and the recovery of 300,000 dropped
    datagrams took minutes a round. The single process takes the same passes, so both round alike (a prompt passed
    whole rounds differently from one passed in pieces: 4e-4 on the logits of TinyLlama's shape)."""
    config = getattr(model, "config", None)
    chunk = prefill_chunk(config.dim) if config is not None else max(1, len(prompt_ids))
    for at in range(0, max(1, len(prompt_ids)), chunk):  # (an empty prompt: the model says what it needs)
        logits = model.forward(prompt_ids[at:at + chunk])
    return logits


class LanguageModel(Protocol):
    max_seq_len: int

    def forward(self, tokens: list[int] | np.ndarray, start_pos: int | None = None,
                all_logits: bool = False) -> np.ndarray: ...

    def reset(self) -> None: ...


@dataclass
class GenerationResult:
    text: str  # the generated continuation (without the prompt)
    token_ids: list[int]  # generated ids
    prompt_ids: list[int]
    stop_reason: str  # "eos", "max_new_tokens", "context_full" or "stop" (the caller's stopped(): a stop string)
    prefill_ms: float
    decode_ms: list[float] = field(default_factory=list)  # per token a pass after the prompt yielded: its time / its tokens
    speculation: SpeculationStats | None = None

    @property
    def ms_per_token(self) -> float:
        return float(np.mean(self.decode_ms)) if self.decode_ms else 0.0

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt_ids,
            "stop_reason": self.stop_reason,
            "timings": {"prefill_ms": round(self.prefill_ms, 3), "mean_ms_per_output_token": round(self.ms_per_token, 3),
                        "median_ms_per_output_token": round(float(np.median(self.decode_ms)), 3) if self.decode_ms else 0.0,
                        "output_tokens": len(self.token_ids)},
            **({"speculation": self.speculation.to_json()} if self.speculation else {}),
        }


class GenerationCancelled(HaloError):
    """The caller's `cancelled()` said stop; `result` holds what was generated until then."""

    def __init__(self, result: GenerationResult):
        super().__init__(f"generation cancelled after {len(result.token_ids)} tokens")
        self.result = result


def encode_prompt(tokenizer: Tokenizer, prompt: str, context: int) -> list[int]:
    """The prompt's token ids (BOS first), or ConfigError where it is empty or leaves no room in the context."""
    prompt_ids = tokenizer.encode(prompt, bos=True)
    if not prompt_ids:
        raise ConfigError("the prompt encodes to no tokens and the tokenizer has no BOS token: give a prompt")
    if len(prompt_ids) >= context:
        raise ConfigError(f"the prompt has {len(prompt_ids)} tokens; the context holds {context}")
    return prompt_ids


class Continuation:
    """What each chosen token does to one generation, in order: it ends it (EOS, the token budget, a full context) or
    joins the text, streamed to on_text piece by piece. generate() and the serving engine's batches both use it."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], max_new_tokens: int, context: int,
                 on_text: Callable[[str], None] | None = None, stop_at_eos: bool = True,
                 stopped: Callable[[], bool] | None = None):
        """stopped: asked after each token's text went to on_text; True ends the generation there ("stop": the
        caller's stop string is complete: a speculative pass's later tokens are not the text's, nor its usage)."""
        if max_new_tokens < 0:
            raise ConfigError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
        self.tokenizer, self.max_new_tokens, self.context = tokenizer, max_new_tokens, context
        self.on_text, self.stop_at_eos, self.stopped = on_text, stop_at_eos, stopped
        # the continuation's first piece keeps its leading space unless the prompt was empty
        self.emit = tokenizer.stream(at_start=len(prompt_ids) == 1 and prompt_ids[0] == tokenizer.bos_id)
        self.result = GenerationResult("", [], prompt_ids, "max_new_tokens", 0.0)
        self.pieces: list[str] = []

    def take(self, token: int) -> bool:
        """One chosen token; True: the generation ends here."""
        result = self.result
        if self.stop_at_eos and token in self.tokenizer.eos_ids:
            result.stop_reason = "eos"
            return True
        result.token_ids.append(token)
        piece = self.emit(token)
        self.pieces.append(piece)
        if self.on_text and piece:
            self.on_text(piece)
        if self.stopped is not None and self.stopped():
            result.stop_reason = "stop"
            return True
        if len(result.token_ids) == self.max_new_tokens:
            return True
        if len(result.prompt_ids) + len(result.token_ids) >= self.context:
            result.stop_reason = "context_full"
            return True
        return False

    def text_so_far(self) -> str:
        return "".join(self.pieces)

    def finish(self) -> GenerationResult:
        """The whole text, once the last token was taken (the detokenizer's held-back tail streamed too)."""
        tail = self.emit(None)
        if self.on_text and tail:
            self.on_text(tail)
        self.result.text = self.text_so_far() + tail
        return self.result


def generate(model: LanguageModel, tokenizer: Tokenizer, prompt: str, max_new_tokens: int,
             sampling: SamplingSettings = SamplingSettings(), on_text: Callable[[str], None] | None = None,
             stop_at_eos: bool = True, cancelled: Callable[[], bool] | None = None,
             speculation: SpeculationSettings = SpeculationSettings(), drafter: Drafter | None = None,
             stopped: Callable[[], bool] | None = None) -> GenerationResult:
    """Generate up to max_new_tokens after the prompt (BOS is prepended). on_text receives each new
    piece of text as soon as it is decoded. `cancelled` is asked before every forward pass: when it
    returns True the loop stops there (no message goes to the agents for this request any more) and
    raises GenerationCancelled; the model needs no cleanup, the next generation resets it.
    speculation: draft up to `max_drafts` tokens a pass (halo/generation/speculative.py) with `drafter` (default: prompt
    lookup); greedy output is the same as without it, sampled output has the same distribution."""
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    prompt_ids = encode_prompt(tokenizer, prompt, model.max_seq_len)
    sample = Sampler(sampling)
    going = Continuation(tokenizer, prompt_ids, max_new_tokens, model.max_seq_len, on_text, stop_at_eos, stopped)
    result = going.result

    def check_cancelled() -> None:
        if cancelled is not None and cancelled():
            result.text = going.text_so_far()
            raise GenerationCancelled(result)

    def next_pass() -> list[int]:
        """One forward pass after the prompt: the token(s) it yields."""
        if speculator is None:
            return [sample(model.forward(result.token_ids[-1:]))]
        context = prompt_ids + result.token_ids
        room = min(max_new_tokens - len(result.token_ids) - 1, model.max_seq_len - len(context))
        return speculator.next_pass(model, context, room)

    check_cancelled()
    model.reset()
    speculator = None
    if speculation.enabled:
        speculator = Speculator(speculation, drafter, sample, getattr(model, "rounds_per_pass", None))
        result.speculation = speculator.stats
    t0 = time.perf_counter()
    logits = prefill(model, prompt_ids)
    result.prefill_ms = (time.perf_counter() - t0) * 1e3
    chosen, pass_ms = ([sample(logits)] if max_new_tokens else []), None
    while chosen:
        end = next((i for i, token in enumerate(chosen) if going.take(token)), None)
        used = len(chosen) if end is None else end + 1
        if pass_ms is not None:  # a pass's time over the tokens it gave the output (not those past an EOS)
            result.decode_ms.extend([pass_ms / used] * used)
            if speculator is not None:
                speculator.stats.discard(len(chosen) - used)
        if end is not None:
            break
        check_cancelled()
        t = time.perf_counter()
        chosen = next_pass()
        pass_ms = (time.perf_counter() - t) * 1e3
    return going.finish()
