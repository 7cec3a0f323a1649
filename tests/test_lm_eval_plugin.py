"""The lm-eval backend `halo`: request handling, caching by settings, and the offline tasks end to end
(2 local agents equal the single-process reference)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the `eval` extra: pip install -e '.[eval]'")

from lm_eval.api.instance import Instance  # noqa: E402

from halo.errors import ConfigError  # noqa: E402
from halo.eval.lm_eval_plugin import HaloLM, register  # noqa: E402
from halo.compute.transformer import Transformer  # noqa: E402


def request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.fixture(scope="module")
def lm():
    backend = HaloLM()
    yield backend
    backend.close()


def direct_logprob(weights, tokens, n_continuation):
    model = Transformer(weights, max_seq_len=512)
    logits = model.forward(tokens[:-1], all_logits=True).astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    rows = np.arange(len(tokens) - 1 - n_continuation, len(tokens) - 1)
    return float(logp[rows, tokens[-n_continuation:]].sum())


def test_empty_context_scores_from_bos(lm, stories_weights):
    (value, _), = lm.loglikelihood([request("loglikelihood", "", "Once upon a time")])
    tokens = lm.tok.encode("Once upon a time", bos=True)
    assert tokens[0] == lm.bos
    assert value == pytest.approx(direct_logprob(stories_weights, tokens, len(tokens) - 1), abs=1e-5)


def test_continuation_tokens_come_from_the_whole_text(lm):
    ctx, cont = lm.encode_pair("Once upon a", " time")
    whole = lm.tok.encode("Once upon a time", bos=True)
    assert ctx + cont == whole and cont == whole[len(ctx):]
    assert lm.encode_pair("Once upon a ", "time") == (ctx, cont)  # a trailing space moves to the continuation
    (a, _), (b, _) = lm.loglikelihood([request("loglikelihood", "Once upon a", " time"),
                                       request("loglikelihood", "Once upon a ", "time")])
    assert a == b
    assert lm.loglikelihood([request("loglikelihood", "Once", "")]) == [(0.0, True)]


def test_is_greedy_follows_the_known_answer(lm, known_answer):
    cut = known_answer.index(" She")  # at a word boundary, so the tokens are the generated ones
    prefix, greedy_next = known_answer[:cut], " She loved to play outside"
    assert known_answer[cut:].startswith(greedy_next)
    (_, greedy), (_, other) = lm.loglikelihood([request("loglikelihood", prefix, greedy_next),
                                                request("loglikelihood", prefix, " elephant banana")])
    assert greedy and not other


def test_generate_until_cuts_at_the_stop_string(lm, known_answer):
    out, = lm.generate_until([request("generate_until", "Once upon a time", {"until": ["."], "max_gen_toks": 64})])
    expected = known_answer[len("Once upon a time"):]
    assert out == expected[:expected.index(".")]
    out, = lm.generate_until([request("generate_until", "Once upon a time", {"until": [], "max_gen_toks": 5})])
    assert len(lm.tok.encode(out, bos=False)) <= 6 and expected.startswith(out)


def test_long_rolling_texts_score_every_token_once(known_answer, stories_weights):
    short = HaloLM(context=32)
    try:
        scored = []
        original = short.score

        def spy(ctx, cont):
            scored.append((len(ctx), len(cont)))
            assert len(ctx) + len(cont) - 1 <= 32  # every window fits the context
            return original(ctx, cont)

        short.score = spy
        value, = short.loglikelihood_rolling([request("loglikelihood_rolling", known_answer)])
        tokens = short.tok.encode(known_answer, bos=False)
        assert len(scored) > 5 and sum(n for _, n in scored) == len(tokens)
        full = direct_logprob(stories_weights, [short.bos] + tokens, len(tokens))
        assert value < 0 and value != pytest.approx(full, abs=1e-3)  # truncated contexts lose information
    finally:
        short.close()
    wide = HaloLM()
    try:
        value, = wide.loglikelihood_rolling([request("loglikelihood_rolling", known_answer)])
        assert value == pytest.approx(full, abs=1e-3)  # one window: the whole text after BOS
    finally:
        wide.close()


def test_cache_is_keyed_by_runtime_settings(tmp_path):
    asks = [request("loglikelihood", "Once upon a time", " there was")]
    first = HaloLM(cache_dir=str(tmp_path))
    answer = first.loglikelihood(asks)
    again = first.loglikelihood(asks)
    assert again == answer and first.cache_hits == 1
    first.close()
    lossy = HaloLM(cache_dir=str(tmp_path), local_agents=2, sync="lossy", inject_plr=0.05)
    try:
        lossy.loglikelihood(asks)
        assert lossy.cache_hits == 0  # a lossy run never reads the lossless answers
    finally:
        lossy.close()


def test_bad_model_args_say_what_is_wrong():
    with pytest.raises(ConfigError, match="unknown halo model_args"):
        HaloLM(temperature=0.5)
    with pytest.raises(ConfigError, match="local_agents"):
        HaloLM(sync="halo")
    # loss and predictor settings without agents were ignored: "accuracy under 50 % loss" was the lossless figure
    with pytest.raises(ConfigError, match=r"inject_plr, critical_fraction: set how a cluster's agents sync"):
        HaloLM(inject_plr=0.5, critical_fraction=0.0)
    with pytest.raises(ConfigError, match=r"predictors: set how"):
        HaloLM(predictors="/nonexistent")
    # ... and with agents whose sync mode reads none of them (inject_plr=0.5 under tcp scored the lossless run)
    for args, said in [(dict(sync="tcp", inject_plr=0.5), "inject_plr does nothing under sync=tcp: it applies to exact"),
                       (dict(critical_fraction=0.9), "critical_fraction does nothing under sync=exact: it applies to halo"),
                       (dict(sync="exact", predictors="/nonexistent"), "predictors does nothing under sync=exact"),
                       (dict(sync="tcp", deadline_floor_ms=1.0), "deadline_floor_ms does nothing under sync=tcp")]:
        with pytest.raises(ConfigError, match=said):
            HaloLM(local_agents=1, **args)


def test_a_continuation_longer_than_the_context_is_refused_with_the_limit():
    """(An IndexError in the scoring.)"""
    lm = HaloLM(context=16)
    try:
        with pytest.raises(ConfigError, match=r"does not fit the context of 16: give a larger context=N"):
            lm.loglikelihood([request("loglikelihood", "Once", " upon a time there was a little girl named Lily who "
                                      "loved to play outside in the park every day")])
    finally:
        lm.close()


def test_the_command_line_says_a_configuration_error_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "halo.eval.lm_eval_plugin", "--model", "halo", "--model_args",
                           "sync=halo", "--tasks", "tinystories_ppl", "--limit", "2"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "halo-lm-eval: error: sync=halo synchronizes agents" in done.stderr


def test_registration_keeps_the_built_in_models():
    from importlib.metadata import entry_points

    from lm_eval.api.registry import model_registry

    register()
    assert "halo" in model_registry and "hf" in model_registry and "dummy" in model_registry
    assert any(e.name == "halo" for e in entry_points(group="lm_eval.models"))


def run_cli(tmp_path, name, model_args):
    out = tmp_path / name
    argv = [sys.executable, "-m", "halo.eval.lm_eval_plugin", "--model", "halo", "--tasks",
            "tinystories_ppl,tinystories_cloze", "--limit", "24", "--output_path", str(out)]
    if model_args:
        argv += ["--model_args", model_args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)  # cwd: no repo paths
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(Path(out).rglob("results_*.json")).read_text())["results"]


def test_offline_tasks_over_two_agents_equal_the_single_process_reference(tmp_path):
    reference = run_cli(tmp_path, "reference", None)
    cluster = run_cli(tmp_path, "cluster", "local_agents=2,sync=tcp")
    for task in ("tinystories_ppl", "tinystories_cloze"):
        for metric, value in reference[task].items():
            if isinstance(value, float):
                assert cluster[task][metric] == pytest.approx(value, rel=1e-6, abs=1e-9), (task, metric)
    assert 1.0 < reference["tinystories_ppl"]["word_perplexity,none"] < 100
    assert reference["tinystories_cloze"]["acc,none"] > 0.5  # 4 choices: well above chance
