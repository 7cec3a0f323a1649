"""Predictors end to end on a small slice: profile -> train -> export -> onnxruntime ranking."""

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from halo.errors import ConfigError
from halo.predictors.metrics import ndcg, spearman, top_k_recall
from halo.predictors.profiler import load_split, split_text

pytest.importorskip("torch")

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories_valid_dev.txt"
SAMPLE = "Once upon a time there was a cat.\n\nIt sat on a mat. " * 300


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from halo.predictors.cli import train_predictors

    text = tmp_path_factory.mktemp("data") / "text.txt"
    text.write_text(DATA.read_text()[:30000] if DATA.exists() else SAMPLE)
    out = tmp_path_factory.mktemp("predictors")
    manifest = train_predictors(None, str(text), out, hidden=16, epochs=4, seed=0, progress=False, keep_profile=True)
    return out, manifest


def test_pipeline_writes_a_manifest_and_one_graph_per_layer(trained):
    out, manifest = trained
    assert sorted(manifest["layers"]) == ["1", "2", "3", "4"]  # layer 0 always syncs reliably
    assert all((out / e["file"]).is_file() for e in manifest["layers"].values())
    assert manifest["n_heads"] == 8 and manifest["n_mlp_groups"] == 8
    assert manifest["onnx_torch_max_abs_diff"] <= 1e-5
    assert len(manifest["model_sha256"]) == 64
    saved = json.loads((out / "manifest.json").read_text())
    assert saved["versions"]["onnxruntime"] and saved["training"]["hidden"] == 16


def test_learned_ranking_beats_random_on_validation(trained):
    _, manifest = trained
    for entry in manifest["layers"].values():
        m = entry["metrics"]
        for block in ("attention", "mlp"):
            assert m["predictor"][block]["spearman"] > m["random"][block]["spearman"] + 0.1


def test_onnx_matches_the_numpy_and_torch_forward(trained):
    from halo.predictors.runtime import PredictorSet
    from halo.predictors.trainer import LayerPredictor, torch_scores

    out, _ = trained
    runtime = PredictorSet(out)
    x, _ = load_split(out / "profile", "val", 1)
    x = np.asarray(x[:64])
    scores = runtime.scores(2, x)
    assert scores.shape == (64, 16)
    # rebuild the layer-2 predictor from its ONNX initializers and compare three implementations
    import onnx
    from onnx import numpy_helper

    init = {t.name: numpy_helper.to_array(t) for t in onnx.load(out / "layer_2.onnx").graph.initializer}
    p = LayerPredictor(2, init["mean"], init["std"], init["w1"], init["b1"], init["w2"], init["b2"], 8, 8)
    np.testing.assert_allclose(scores, p.scores(x), atol=1e-5)
    np.testing.assert_allclose(scores, torch_scores(p, x), atol=1e-5)


def test_rankings_are_deterministic_and_thread_safe(trained):
    from halo.predictors.runtime import PredictorSet

    out, _ = trained
    runtime = PredictorSet(out)
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    expected = {layer: runtime.rank(layer, x) for layer in runtime.layers}
    failures = []

    def worker():
        for _ in range(20):
            for layer in runtime.layers:
                heads, groups = runtime.rank(layer, x)
                if not (np.array_equal(heads, expected[layer][0]) and np.array_equal(groups, expected[layer][1])):
                    failures.append(layer)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    heads, groups = runtime.rank(1, x[0])
    assert sorted(heads.tolist()) == list(range(8)) and sorted(groups.tolist()) == list(range(8))


def test_predictors_for_another_model_are_refused(trained, tmp_path):
    from halo.predictors.runtime import PredictorSet

    out, _ = trained
    with pytest.raises(ConfigError, match="trained for another model"):
        PredictorSet(out, model_sha256="0" * 64)
    with pytest.raises(ConfigError, match="no predictor manifest"):
        PredictorSet(tmp_path)


def test_metrics_known_values():
    true = np.array([[4.0, 3.0, 2.0, 1.0]])
    assert spearman(true, true) == pytest.approx(1.0)
    assert spearman(-true, true) == pytest.approx(-1.0)
    assert top_k_recall(np.array([[4.0, 1.0, 2.0, 3.0]]), true, 0.5) == pytest.approx(0.5)
    assert ndcg(true, true) == pytest.approx(1.0)
    # swapping the top two costs more than swapping the bottom two (NDCG weighs the head of the ranking)
    top_swapped, bottom_swapped = np.array([[3.0, 4.0, 2.0, 1.0]]), np.array([[4.0, 3.0, 1.0, 2.0]])
    assert ndcg(top_swapped, true) < ndcg(bottom_swapped, true) < 1.0


def test_the_mlp_predictor_is_compared_with_a_linear_baseline(trained):
    _, manifest = trained
    for entry in manifest["layers"].values():
        m = entry["metrics"]
        for block in ("attention", "mlp"):
            assert -1.0 <= m["ridge"][block]["spearman"] <= 1.0 and 0.0 < m["ridge"][block]["ndcg"] <= 1.0
            assert m["ridge"][block]["spearman"] > m["random"][block]["spearman"]  # the hidden state says something


def test_split_is_at_a_paragraph_boundary():
    train, val = split_text("aaaa\n\nbbbb\n\ncccc\n\ndddd", 0.5)
    assert train + val == "aaaa\n\nbbbb\n\ncccc\n\ndddd" and train.endswith("cccc")
    with pytest.raises(ConfigError):
        split_text("x", 1.5)


def test_training_keeps_the_users_files_and_leaves_no_profile_behind(tmp_path, capsys):
    """OUT/profile was the scratch directory and was removed whole afterwards (a user's OUT/profile/notes.txt with
    it); a run that failed or was interrupted left its activations there (209 MB for SmolLM2 after 12 s)."""
    from halo.predictors.cli import main

    text = tmp_path / "text.txt"
    text.write_text(DATA.read_text()[:20000] if DATA.exists() else SAMPLE)
    out = tmp_path / "out"
    (out / "profile").mkdir(parents=True)
    (out / "profile" / "notes.txt").write_text("mine")
    assert main(["--data", str(text), "--out", str(out), "--hidden", "8", "--epochs", "1"]) == 0
    assert (out / "profile" / "notes.txt").read_text() == "mine" and (out / "manifest.json").exists()
    assert not list(out.glob(".profile-*"))
    failed = tmp_path / "failed"
    assert main(["--data", str(text), "--out", str(failed), "--max-chars", "40"]) == 2  # too short to profile
    assert "too short to profile" in capsys.readouterr().err and list(failed.iterdir()) == []


def test_predictors_that_fail_their_export_check_are_left_unloadable(tmp_path, monkeypatch, capsys):
    """The manifest was written before the ONNX-vs-torch check: when the check failed ("do not use these
    predictors") or was interrupted, the folder still loaded, and halo-master used it."""
    from halo.predictors.cli import main
    from halo.predictors.runtime import PredictorSet

    text = tmp_path / "text.txt"
    text.write_text(DATA.read_text()[:20000] if DATA.exists() else SAMPLE)
    monkeypatch.setattr("halo.predictors.trainer.torch_scores", lambda p, sample: np.full((len(sample), 1), 1e3))
    assert main(["--data", str(text), "--out", str(tmp_path / "out"), "--hidden", "8", "--epochs", "1"]) == 2
    assert "do not use these predictors" in capsys.readouterr().err
    assert not (tmp_path / "out" / "manifest.json").exists()
    with pytest.raises(Exception):
        PredictorSet(tmp_path / "out")


@pytest.mark.parametrize("option, value", [("--epochs", "0"), ("--hidden", "0"), ("--window", "5"),
                                           ("--max-chars", "0"), ("--mlp-group-size", "0")])
def test_training_options_out_of_range_are_refused_before_anything_runs(tmp_path, option, value, capsys):
    """(--epochs 0 was a TypeError traceback, --hidden 0 wrote predictors of a constant with exit 0, --max-chars 0
    used the whole text.)"""
    from halo.predictors.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--data", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o"), option, value])
    assert e.value.code == 2 and f"argument {option}" in capsys.readouterr().err
