"""Where a model's trained predictors are (beside the checkpoint, a directory given, or shipped with the package for a
named model), and loading them checked against the model's sha256."""

from __future__ import annotations

import os
from pathlib import Path

import halo
from halo.model.loader import model_fingerprint
from halo.model.weights import ModelWeights

SHIPPED_PREDICTORS = Path(halo.__file__).resolve().parent / "assets" / "predictors"


def shipped_predictors(fingerprint: str) -> Path | None:
    """The predictors the package ships for a named model (halo/assets/predictors/NAME: trained by the project on
    committed text), found by the model file's sha256 in their manifest; None for any other model."""
    import json

    for manifest in sorted(SHIPPED_PREDICTORS.glob("*/manifest.json")):
        if json.loads(manifest.read_text()).get("model_sha256") == fingerprint:
            return manifest.parent
    return None


def predictors_path(source: Path, directory: str | os.PathLike | None = None) -> Path:
    """Where a model's predictors are: `directory`, else predictors/ beside the checkpoint (inside a HF directory),
    else those the package ships for that very file (a named model: `halo-master fetch` brings nothing more)."""
    if directory:
        return Path(directory)
    beside = (source if source.is_dir() else source.parent) / "predictors"
    if beside.is_dir() or source.is_dir():
        return beside
    return shipped_predictors(model_fingerprint(source)) or beside


def load_predictors(weights: ModelWeights, directory: str | os.PathLike | None = None, threads: int = 1):
    """The model's trained predictors (predictors_path). Checked against the model's sha256 so stale predictors are
    refused."""
    from halo.predictors.runtime import PredictorSet

    source = Path(weights.source)
    return PredictorSet(trained_predictors_dir(source, directory), model_fingerprint(source), threads)


def trained_predictors_dir(source: Path, directory: str | os.PathLike | None = None) -> Path:
    """predictors_path, or a ConfigError naming the command that trains them (generate checks it before loading)."""
    from halo.errors import ConfigError

    path = predictors_path(source, directory)
    if not path.is_dir():
        shipped = ", ".join(p.name for p in sorted(SHIPPED_PREDICTORS.iterdir()) if p.is_dir()) or "none"
        raise ConfigError(f"{path}: no trained predictors for {source.name} (HALO mode ranks groups with them; the "
                          f"package ships them for: {shipped}); train them: halo-train-predictors --model {source} "
                          f"--data TEXT --out {path}")
    return path
