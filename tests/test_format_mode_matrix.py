"""Every combination of weight format, cluster mode, sync mode and predictors that `generate` takes on a 4-bit GGUF
either runs, giving one device's tokens where the mode promises them, or is refused while the arguments are checked
(before a model is loaded) with a message naming the option at fault. Pipeline stage workers refused "native", the
default, at their hello ("unknown weight format 'native'"), and --mode pipeline quietly ignored --sync and ran a
single process when no workers were given."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from halo.cli.master import build_parser, check_model_and_cluster
from halo.compute.linear import FORMATS
from halo.errors import ConfigError
from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf, write_random_predictors
from halo.sync import SYNC_MODES

SMALL = {**TINYLLAMA_1_1B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": 512}
MODES = {"single": [], "tp": ["--local-agents", "2", "--plan", "even"], "pipeline": ["--mode", "pipeline", "--local-agents", "2"]}
EXACT = (None, "exact", "tcp")  # sync modes that promise one device's tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A small Q4_0 GGUF with no predictors beside it, and untrained predictors elsewhere (--predictors)."""
    root = tmp_path_factory.mktemp("matrix")
    path = root / "model" / "small-Q4_0.gguf"
    path.parent.mkdir()
    write_random_gguf(path, SMALL, "Q4_0")
    write_random_predictors(path, out=root / "predictors")
    return path, root / "predictors"


def argv(model, weights: str, mode: str, sync: str | None, predictors: bool) -> list[str]:
    path, predictors_dir = model
    return ["--model", str(path), "--weights", weights, *MODES[mode], *(["--sync", sync] if sync else []),
            *(["--predictors", str(predictors_dir)] if predictors else [])]


def refusal(args: list[str]) -> str | None:
    """check_model_and_cluster's refusal of a generate command line (None: accepted); what `generate` checks
    before it loads the model."""
    try:
        check_model_and_cluster(build_parser().parse_args(["generate", *args]))
    except ConfigError as e:
        return str(e)
    return None


def matrix(model):
    for weights, mode, sync, predictors in itertools.product(FORMATS, MODES, (None, *SYNC_MODES), (False, True)):
        yield (weights, mode, sync, predictors), argv(model, weights, mode, sync, predictors)


def expected_refusal(mode: str, sync: str | None, predictors: bool) -> str | None:
    """The option each refused combination must name."""
    if sync and mode != "tp":
        return "--sync"
    if predictors and sync not in ("lossy", "halo", "halo-tcp"):  # lossy places heads by their importance
        return "--predictors"
    if sync in ("halo", "halo-tcp") and not predictors:
        return "no trained predictors"
    return None


def test_the_matrix_is_refused_exactly_where_a_combination_cannot_run(model):
    accepted = 0
    for (weights, mode, sync, predictors), args in matrix(model):
        reason, want = refusal(args), expected_refusal(mode, sync, predictors)
        if want is None:
            assert reason is None, (args, reason)
            accepted += 1
        else:
            assert reason is not None and want in reason, (args, reason)
    # per format: single; tp x (default, exact, tcp, lossy); tp lossy with predictors; tp halo x 2; pipeline
    assert accepted == 3 * (1 + 4 + 1 + 2 + 1)


def run(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", *args, "--max-new-tokens", "6", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("weights", FORMATS)
def test_every_accepted_combination_runs_with_one_devices_tokens(model, weights):
    alone = run(argv(model, weights, "single", None, False))["token_ids"]
    assert len(alone) == 6
    for (fmt, mode, sync, predictors), args in matrix(model):
        if fmt != weights or mode == "single" or expected_refusal(mode, sync, predictors) is not None:
            continue
        got = run(args)
        dropped = got.get("sync", {}).get("loss", {}).get("partials_dropped", 0)
        if sync in EXACT or dropped == 0:  # relaxed modes drop partials only past a deadline
            assert got["token_ids"] == alone, (args, got["token_ids"], alone)
        else:
            assert len(got["token_ids"]) == 6, args


def test_a_refused_combination_stops_before_loading_the_model_and_says_why(tmp_path):
    missing = tmp_path / "nowhere.gguf"  # the combination is refused before the model file is even looked for
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--mode", "pipeline", "--max-new-tokens", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--mode pipeline runs layer ranges on stage workers" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--mode", "pipeline", "--local-agents", "2",
                          "--sync", "halo", "--model", str(missing)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--sync halo synchronizes tensor-parallel" in out.stderr, out.stderr


def test_the_worker_page_options_are_refused_where_no_browser_tab_joins(model):
    """--serve-worker and --worker-tls-* were ignored without a word in tensor-parallel mode: a user who set up TLS
    for the page believed it in use."""
    base = argv(model, "native", "tp", None, False)
    for extra in (["--serve-worker", "0.0.0.0:8765"], ["--worker-tls-cert", "c.pem", "--worker-tls-key", "k.pem"]):
        reason = refusal(base + extra)
        assert reason is not None and extra[0] in reason and "--browser-workers N" in reason, (extra, reason)
    pipeline = argv(model, "native", "pipeline", None, False)
    assert "--serve-worker" in refusal(pipeline + ["--serve-worker", "127.0.0.1:9000"])
    assert refusal(pipeline + ["--browser-workers", "1", "--serve-worker", "127.0.0.1:9000"]) is None
