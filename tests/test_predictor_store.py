"""Finding and loading a model's predictors: the right ones for the file, checked against the layout they rank, and
a damaged directory refused with what to do (no torch needed: the bundled stories260K's predictors)."""

import json
import shutil

import pytest

from halo.compute.neuron_groups import GroupLayout
from halo.errors import ConfigError
from halo import BUNDLED_MODEL
from halo.model.loader import load_weights
from halo.predictors.store import BUNDLED_PREDICTORS, load_predictors, predictors_path


@pytest.fixture
def stories_copy(tmp_path):
    """A copy of the bundled model in a folder of its own, as a user keeps models."""
    folder = tmp_path / "models"
    folder.mkdir()
    for path in (BUNDLED_MODEL, BUNDLED_MODEL.parent / "tok512.bin"):
        shutil.copy(path, folder)
    return folder / BUNDLED_MODEL.name


def predictors_copy(tmp_path, edit=None):
    out = tmp_path / "predictors-copy"
    shutil.copytree(BUNDLED_PREDICTORS, out)
    if edit:
        manifest = json.loads((out / "manifest.json").read_text())
        edit(manifest)
        (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_a_copy_of_the_bundled_model_finds_the_shipped_predictors_past_another_models(stories_copy):
    """A copy of stories260K got "no trained predictors" (only assets/predictors/* was searched), and a predictors/
    folder beside it trained for another model sharing the folder (the fetch cache holds every model) hid the right
    ones: `--sync halo` was refused for every other model there."""
    assert predictors_path(stories_copy) == BUNDLED_PREDICTORS
    beside = stories_copy.parent / "predictors"
    beside.mkdir()
    (beside / "manifest.json").write_text(json.dumps({"model_sha256": "0" * 64}))  # another model's
    assert predictors_path(stories_copy) == BUNDLED_PREDICTORS
    shutil.rmtree(beside)
    shutil.copytree(BUNDLED_PREDICTORS, beside)  # its own, trained beside it: those
    assert predictors_path(stories_copy) == beside


def test_predictors_for_another_group_layout_are_refused_when_loaded(tmp_path):
    """Trained with another --mlp-group-size they loaded, and the first forward pass failed in the framing
    ("the next layer's ranking (3, 16) is not shaped as this layer's (3, 8)")."""
    weights = load_weights(None)
    layout = GroupLayout.for_model(weights.config)
    assert load_predictors(weights, layout).n_mlp_groups == layout.n_mlp_groups
    other = predictors_copy(tmp_path, lambda m: m.update(n_mlp_groups=2 * layout.n_mlp_groups,
                                                          mlp_group_size=layout.mlp_group_size // 2))
    with pytest.raises(ConfigError, match=rf"trained for another layout: MLP groups {2 * layout.n_mlp_groups} \(this "
                                          rf"run: {layout.n_mlp_groups}\), MLP group size .* retrain"):
        load_predictors(weights, layout, other)


@pytest.mark.parametrize("damage, said", [
    (lambda d: (d / "manifest.json").write_text(json.dumps({k: v for k, v in json.loads(
        (d / "manifest.json").read_text()).items() if k != "n_heads"})), r"a malformed manifest \(KeyError"),
    (lambda d: (d / "layer_2.onnx").write_bytes((d / "layer_2.onnx").read_bytes()[:100]),
     "layer_2.onnx: not a predictor onnxruntime can load"),
])
def test_a_damaged_predictor_directory_is_one_clear_error(tmp_path, damage, said):
    """(A KeyError / onnxruntime InvalidProtobuf traceback before.)"""
    weights = load_weights(None)
    broken = predictors_copy(tmp_path)
    damage(broken)
    with pytest.raises(ConfigError, match=said):
        load_predictors(weights, GroupLayout.for_model(weights.config), broken)
