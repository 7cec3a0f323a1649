import numpy as np
import pytest

from halo.errors import ConfigError
from halo.generation.sampling import Sampler, SamplingSettings

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))


def draws(settings, n=2000):
    sample = Sampler(settings)
    return np.bincount([sample(LOGITS) for _ in range(n)], minlength=len(LOGITS))


def test_greedy_takes_the_argmax():
    assert Sampler(SamplingSettings(temperature=0))(LOGITS) == 0


def test_top_k_keeps_only_the_k_likeliest():
    counts = draws(SamplingSettings(temperature=1.0, top_k=2, seed=1))
    assert counts[2:].sum() == 0 and counts[0] > counts[1] > 0


def test_top_p_keeps_the_smallest_set_reaching_p():
    counts = draws(SamplingSettings(temperature=1.0, top_p=0.75, seed=2))  # 0.5 + 0.2 < 0.75 <= 0.85
    assert counts[3:].sum() == 0 and counts[2] > 0


def test_temperature_one_follows_the_distribution():
    counts = draws(SamplingSettings(temperature=1.0, seed=3), n=20000)
    np.testing.assert_allclose(counts / counts.sum(), np.exp(LOGITS), atol=0.015)


def test_same_seed_same_tokens_other_seed_other_tokens():
    a = [Sampler(SamplingSettings(1.0, seed=7))(LOGITS) for _ in range(1)]
    s1, s2, s3 = (Sampler(SamplingSettings(1.0, seed=s)) for s in (7, 7, 8))
    seq1, seq2, seq3 = ([s(LOGITS) for _ in range(50)] for s in (s1, s2, s3))
    assert seq1 == seq2 != seq3 and a[0] == seq1[0]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0), dict(top_p=1.5),
                                    dict(temperature=float("nan")), dict(temperature=float("inf")),
                                    dict(top_p=float("nan")), dict(seed=-1), dict(seed=2 ** 64), dict(top_k=1.5)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        SamplingSettings(**kwargs)


def test_a_temperature_too_small_for_the_logits_samples_its_limit_greedy():
    """5e-324 overflows every logit (the sampler's ValueError once took `serve`'s cluster down): greedy instead."""
    logits = np.array([3.0, 9.5, -2.0, 9.4], dtype=np.float32)
    for temperature in (5e-324, 1e-310):
        assert Sampler(SamplingSettings(temperature, seed=3))(logits) == 1
    masked = np.array([-np.inf, 2.0, 1.0], dtype=np.float32)  # -inf logits are no overflow: sampled as usual
    assert Sampler(SamplingSettings(1.0, seed=3))(masked) in (1, 2)


def test_a_draw_picks_the_token_numpys_choice_picks_for_the_same_seed():
    """Sampler.draw sums in blocks (numpy's rng.choice cost 0.26 ms a token at a 49k vocabulary); it draws what choice
    drew: vocabularies across block edges, masked tokens (top-k, -inf logits), one-token distributions."""
    rng = np.random.default_rng(0)
    for seed in range(120):
        n = int(rng.integers(1, 3000))
        logits = rng.standard_normal(n) * rng.uniform(0.1, 6)
        if seed % 3 == 0 and n > 1:
            logits[rng.random(n) < 0.7] = -np.inf
            logits[int(rng.integers(n))] = 0.0
        sampler = Sampler(SamplingSettings(1.0, seed=seed))
        probs, reference = sampler.probabilities(logits), np.random.default_rng(seed)
        drawn = [sampler.draw(probs) for _ in range(25)]
        assert drawn == [int(reference.choice(n, p=probs)) for _ in range(25)]
        assert all(probs[i] > 0 for i in drawn)


class _Uniform:
    """A generator whose uniform draw is fixed: the draw's edges, where u x total rounds to the total."""

    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


@pytest.mark.parametrize("n, mass_at", [(1024, slice(0, 3)), (512, slice(510, 512)), (1, slice(0, 1)),
                                        (1500, slice(600, 601))])
def test_a_draw_at_the_top_of_the_cdf_takes_the_last_token_with_mass(n, mass_at):
    probs = np.zeros(n)
    probs[mass_at] = 1.0 / len(range(n)[mass_at])
    sampler = Sampler(SamplingSettings(1.0))
    sampler.rng = _Uniform(np.nextafter(1.0, 0.0))
    assert sampler.draw(probs) == range(n)[mass_at][-1]
    sampler.rng = _Uniform(0.0)
    assert sampler.draw(probs) == range(n)[mass_at][0]


def test_probabilities_without_a_finite_total_are_refused():
    sampler = Sampler(SamplingSettings(1.0))
    for probs in (np.array([0.5, np.nan, 0.5]), np.zeros(700), np.array([np.inf, 0.0])):
        with pytest.raises(ValueError, match="finite with a positive total"):
            sampler.draw(probs)


def test_probabilities_worked_in_place_have_the_bits_of_the_plain_formula():
    """probabilities() works in one copy of the logits (fresh 400 KB arrays cost page faults); the values are those
    of exp((z - max) / T) normalized, top-k and top-p cuts included, to the bit."""
    rng = np.random.default_rng(3)
    for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.9), (50, 0.8)):
        for temperature in (0.3, 0.8, 1.7):
            logits = (rng.standard_normal(3000) * 3).astype(np.float32)
            z = logits.astype(np.float64) / temperature
            if top_k:
                z = np.where(z < np.partition(z, -top_k)[-top_k], -np.inf, z)
            expected = np.exp(z - z.max())
            expected /= expected.sum()
            if top_p < 1.0:
                order = np.argsort(-expected, kind="stable")
                keep = order[: int(np.searchsorted(np.cumsum(expected[order]), top_p) + 1)]
                expected = np.where(np.isin(np.arange(len(z)), keep), expected, 0.0)
                expected /= expected.sum()
            got = Sampler(SamplingSettings(temperature, top_k=top_k, top_p=top_p)).probabilities(logits)
            assert np.array_equal(got, expected)


def test_logits_with_a_nan_or_a_positive_infinity_are_a_damaged_model_not_token_0():
    """argmax of a NaN is 0: a model with one NaN weight (or a NaN norm epsilon) decoded token 0 forever, exit 0."""
    from halo.errors import HaloError

    for bad in (np.array([1.0, np.nan, 2.0], np.float32), np.array([1.0, np.inf, 2.0], np.float32),
                np.full(3, -np.inf, np.float32)):
        for temperature in (0.0, 0.8):
            with pytest.raises(HaloError, match="logits are not finite .* weights are damaged"):
                Sampler(SamplingSettings(temperature, seed=1))(bad)


@pytest.mark.parametrize("field, value", [("norm_eps", float("nan")), ("norm_eps", 0.0), ("rope_theta", 0.0),
                                          ("rope_theta", -1.0), ("rope_theta", float("inf")), ("bos_id", 512),
                                          ("eos_ids", (2, 99999))])
def test_a_model_config_refuses_what_no_model_can_run(field, value):
    """Checked where every format's reader builds it: a NaN epsilon or a zero rope base decoded token 0 forever; a
    Hugging Face bos_token_id past the vocabulary was a ValueError at the first token, an eos one never matched."""
    from halo.errors import ConfigError
    from halo.model.config import ModelConfig

    shape = dict(dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=512, max_seq_len=64)
    ModelConfig(**shape)
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**shape, **{field: value})
