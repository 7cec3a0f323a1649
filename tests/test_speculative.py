"""Speculative decoding: drafted tokens verified in one pass give the tokens of decoding one by one (greedy), the
model's distribution (sampling), on one device and over 1-4 agents in every exact sync mode."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from gguf_models import tiny_gguf
from halo.compute.transformer import Transformer
from halo.distributed import LocalCluster, cluster_model
from halo.errors import ConfigError
from halo.generation.generate import generate
from halo.generation.sampling import Sampler, SamplingSettings
from halo.generation.speculative import DraftModel, PromptLookup, SpeculationSettings, accept
from halo.model.loader import load_tokenizer, load_weights
from halo.sync import SyncSettings

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play. Once upon a time, there was a"


class NoisyOracle:
    """Drafts the reference continuation with every third drafted token wrong: passes accept some drafts and
    reject others, so rewinds happen in the middle of passes."""

    def __init__(self, prompt_len: int, reference: list[int], vocab: int):
        self.prompt_len, self.reference, self.vocab, self.calls = prompt_len, reference, vocab, 0

    def propose(self, context, k):
        self.calls += 1
        done = len(context) - self.prompt_len
        drafts = self.reference[done:done + k]
        return [(t + 1) % self.vocab if (done + i) % 3 == 2 else t for i, t in enumerate(drafts)]


@pytest.mark.parametrize("fmt", ["fp32", "int8", "Q4_0", "Q4_1", "Q8_0"])
def test_a_verification_pass_gives_the_logits_of_decoding_one_by_one_bit_for_bit(stories_weights, fmt, tmp_path):
    """A short pass gives each position a decode step's bits (worker.STEPWISE_TOKENS: the C steps take T positions
    at once, fp32 runs them one by one): through the batched path, a [T, D] pass differed from T decode steps in the
    last bits (6.7e-6 fp32, 1.9e-6 int8, 5.4e-4 on a Q4_0 GGUF), so a near tie could have turned greedy speculation's
    output away from plain decoding's."""
    if fmt.startswith("Q"):  # a GGUF in its own 4/8-bit blocks, GQA (the C steps' attention over shared KV heads)
        weights = load_weights(tiny_gguf(tmp_path / "m.gguf", fmt, seed=5, num_attention_heads=4, num_key_value_heads=2,
                                         hidden_size=128))
        model = Transformer(weights, fmt="native", max_seq_len=128)
        assert model.worker.attention[0].fused and model.worker.lm_head.row_by_row
    else:
        model = Transformer(stories_weights, fmt=fmt, max_seq_len=128)
    tokens, logits = [1], [model.forward([1])]
    for _ in range(8):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(model.forward(tokens[-1:]))
    model.reset()
    model.forward([1])
    model.forward([7, 8, 9, 10], start_pos=1, all_logits=True)  # rejected drafts: their K/V lie beyond, overwritten
    verified = model.forward(tokens[1:7], start_pos=1, all_logits=True)
    for i in range(6):
        assert np.array_equal(verified[i], logits[i + 1]), f"position {i + 1}"


def test_greedy_speculation_gives_the_same_text_on_one_device(stories_weights):
    tokenizer = load_tokenizer(stories_weights)
    model = Transformer(stories_weights, max_seq_len=256)
    plain = generate(model, tokenizer, PROMPT, 80)
    looked_up = generate(model, tokenizer, PROMPT, 80, speculation=SpeculationSettings(max_drafts=6))
    oracle = NoisyOracle(len(plain.prompt_ids), plain.token_ids, stories_weights.config.vocab_size)
    noisy = generate(model, tokenizer, PROMPT, 80, speculation=SpeculationSettings(max_drafts=5), drafter=oracle)
    assert looked_up.token_ids == plain.token_ids and noisy.token_ids == plain.token_ids
    stats = noisy.speculation
    assert 0 < stats.accepted < stats.drafted and stats.passes < len(plain.token_ids) - 1
    assert looked_up.speculation.accepted > 0  # the story repeats itself: lookup finds it
    assert stats.tokens == len(plain.token_ids) - 1 == sum(stats.per_pass) + stats.passes


@pytest.mark.parametrize("n_agents,sync", [(1, "exact"), (2, "tcp"), (3, "exact"), (4, "exact"), (4, "tcp")])
def test_greedy_speculation_over_agents_gives_one_devices_tokens(stories_weights, n_agents, sync):
    tokenizer = load_tokenizer(stories_weights)
    alone = generate(Transformer(stories_weights, max_seq_len=256), tokenizer, PROMPT, 60)
    oracle = NoisyOracle(len(alone.prompt_ids), alone.token_ids, stories_weights.config.vocab_size)
    with LocalCluster(n_agents) as cluster:
        model = cluster_model(stories_weights, cluster.endpoints, cluster.key, context=256, sync=SyncSettings(mode=sync))
        try:
            noisy = generate(model, tokenizer, PROMPT, 60, speculation=SpeculationSettings(max_drafts=5),
                             drafter=oracle)
            looked_up = generate(model, tokenizer, PROMPT, 60, speculation=SpeculationSettings(max_drafts=4))
            rounds = model.rounds_per_pass
        finally:
            model.close()
    assert noisy.token_ids == alone.token_ids and looked_up.token_ids == alone.token_ids
    assert 0 < noisy.speculation.accepted < noisy.speculation.drafted
    # fewer rounds per token than a pass per token: what speculation is for
    spec = noisy.speculation.to_json()
    assert spec["rounds_per_token"] == pytest.approx(rounds * noisy.speculation.passes / noisy.speculation.tokens,
                                                     abs=1e-3)
    assert spec["rounds_per_token"] < rounds


def test_halo_mode_verifies_drafts_too(stories_weights):
    """HALO mode is not exact (it may drop partials), so no equality: the passes run and drafts get accepted."""
    tokenizer = load_tokenizer(stories_weights)
    with LocalCluster(2) as cluster:
        model = cluster_model(stories_weights, cluster.endpoints, cluster.key, context=256,
                              sync=SyncSettings(mode="halo", predict=False))
        try:
            result = generate(model, tokenizer, PROMPT, 40, speculation=SpeculationSettings(max_drafts=4))
        finally:
            model.close()
    assert len(result.token_ids) == 40 and result.speculation.accepted > 0


def test_sampling_keeps_the_models_distribution():
    """The acceptance rule for a point-mass draft d: accept with p(d), else draw from p without d. Whatever the
    draft, the first token is distributed as p (a two-sided tolerance of 5 standard errors over 20000 draws)."""
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03]))
    p = np.exp(logits) / np.exp(logits).sum()
    sampler = Sampler(SamplingSettings(temperature=1.0, seed=3))
    n = 20000
    for draft in (0, 3):
        counts = np.zeros(5)
        for _ in range(n):
            counts[accept(np.stack([logits, logits]), [draft], sampler)[0]] += 1
        tolerance = 5 * np.sqrt(p * (1 - p) / n)
        assert np.all(np.abs(counts / n - p) < tolerance), (draft, counts / n)


def test_greedy_acceptance_stops_at_the_first_disagreement():
    logits = np.full((4, 6), -1.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = logits[3, 5] = 1.0  # the model's choices: 2, 4, 1, then 5
    sampler = Sampler(SamplingSettings())
    assert accept(logits, [2, 4, 1], sampler) == [2, 4, 1, 5]  # all accepted, and the token after them
    assert accept(logits, [2, 3, 1], sampler) == [2, 4]  # the second rejected: the model's own token instead
    assert accept(logits[:1], [], sampler) == [2]


def test_prompt_lookup_takes_the_longest_most_recent_match_as_far_as_it_agrees():
    lookup = PromptLookup(ngram=3)
    assert lookup.propose([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7], 3) == [2, 3]  # "6 7" last seen before "2 3"
    assert lookup.propose([1, 2, 3, 9, 9, 2, 3, 4, 1, 2, 3], 2) == [9, 9]  # "1 2 3" beats the later "2 3"
    assert lookup.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert lookup.propose([4, 1, 4], 5) == [1]  # a one-token match drafts one token
    # the text before the match agrees 7 tokens back ("9 8 7 6 5 4 3"): 7 drafts, to the end of the context
    assert lookup.propose([9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 9, 8, 7, 6, 5, 4, 3], 8) == [2, 1, 0, 9, 8, 7, 6]
    assert lookup.propose([1, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 2, 7, 6, 5], 8) == [4, 3, 2]  # "7 6 5" after "2", not "8"


def test_a_draft_model_drafts_and_a_foreign_vocabulary_is_refused(stories_weights, tmp_path):
    """The model as its own draft model: every draft is accepted (a pass yields k + 1 tokens)."""
    tokenizer = load_tokenizer(stories_weights)
    target = Transformer(stories_weights, max_seq_len=256)
    plain = generate(target, tokenizer, "", 40)
    drafter = DraftModel(Transformer(stories_weights, max_seq_len=256), stories_weights.config.vocab_size)
    drafted = generate(target, tokenizer, "", 40, speculation=SpeculationSettings(max_drafts=4), drafter=drafter)
    assert drafted.token_ids == plain.token_ids
    assert drafted.speculation.accepted == drafted.speculation.drafted > 0
    with pytest.raises(ConfigError, match="share the model's tokenizer"):
        DraftModel(target, stories_weights.config.vocab_size + 1)


def test_speculation_settings_are_checked():
    with pytest.raises(ConfigError, match="--speculate must be 0"):
        SpeculationSettings(max_drafts=9)
    with pytest.raises(ConfigError, match="--lookup-ngram"):
        SpeculationSettings(max_drafts=2, ngram=2, min_ngram=3)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_speculates_from_the_command_line_and_reports_it(known_answer):
    out = run_cli("--speculate", "4", "--json", "--local-agents", "2", "--max-new-tokens", "200")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert known_answer.startswith(result["text"].strip())
    spec = result["speculation"]
    assert spec["drafted"] > 0 and spec["accepted"] > 0 and spec["rounds_per_token"] > 0
    refused = run_cli("--speculate", "9")
    assert refused.returncode == 2 and "--speculate" in refused.stderr
    draft_off = run_cli("--speculate", "0", "--draft", "stories260K-does-not-exist")
    assert draft_off.returncode != 0 and "--draft" in draft_off.stderr


@pytest.mark.parametrize("mode", [[], ["--mode", "pipeline"]])
def test_a_4bit_cluster_speculates_with_one_devices_tokens_in_both_modes(tmp_path, mode):
    """A Q4_0 GGUF (the C decode steps taking a pass's positions together) over 2 tensor-parallel agents or 2
    pipeline stage workers, drafts from the model's own repetitions: the single process's tokens."""
    model = tiny_gguf(tmp_path / "q4.gguf", "Q4_0", seed=11, num_attention_heads=4, num_key_value_heads=2,
                      hidden_size=128)
    args = ["--model", str(model), "--max-new-tokens", "48", "--json"]
    alone = run_cli(*args)
    spoken = run_cli(*args, *mode, "--local-agents", "2", "--speculate", "6")
    assert alone.returncode == 0 and spoken.returncode == 0, spoken.stderr[-2000:]
    plain, drafted = json.loads(alone.stdout), json.loads(spoken.stdout)
    assert drafted["token_ids"] == plain["token_ids"] and drafted["speculation"]["drafted"] > 0


class PerfectOracle(NoisyOracle):
    def propose(self, context, k):
        done = len(context) - self.prompt_len
        return self.reference[done:done + k]


def test_tokens_drafted_past_the_end_are_not_counted_as_produced(stories_weights):
    """A pass whose accepted drafts ran past the EOS counted them all: tokens per pass, acceptance and ms per output
    token were overstated (2.9 ms a token against 5.6 without --speculate, where 2 of the pass's 5 were used)."""
    tokenizer = load_tokenizer(stories_weights)
    model = Transformer(stories_weights, max_seq_len=256)
    reference = generate(model, tokenizer, PROMPT, 24).token_ids
    tokenizer.eos_ids = (reference[6],)  # the seventh token ends the text
    prompt_len = len(tokenizer.encode(PROMPT))
    result = generate(model, tokenizer, PROMPT, 24, speculation=SpeculationSettings(max_drafts=8),
                      drafter=PerfectOracle(prompt_len, reference, stories_weights.config.vocab_size))
    assert result.token_ids == reference[:6] and result.stop_reason == "eos"
    stats = result.speculation
    assert stats.tokens == len(result.decode_ms) == 6  # the passes' tokens up to the EOS (the first came from prefill)
    # every pass's tokens are accepted drafts and one of its own, but the last: it ended at a drafted EOS
    assert stats.accepted == stats.tokens - stats.passes + 1 and stats.accepted <= stats.drafted
