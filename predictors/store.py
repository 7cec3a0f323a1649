"""Where a model's trained predictors are (beside the checkpoint, a directory given, or shipped with the package for a
named model), and loading them checked against the model's sha256."""

from __future__ import annotations

import os
from pathlib import Path

import halo
from halo.model.loader import model_fingerprint
from halo.model.weights import ModelWeights

SHIPPED_PREDICTORS = Path(halo.__file__).resolve().parent / "assets" / "predictors"
BUNDLED_PREDICTORS = Path(halo.__file__).resolve().parent / "assets" / "stories260K" / "predictors"


def _shipped() -> dict[str, Path]:
    """What the package ships, by name: the named models' (assets/predictors/NAME) and the bundled stories260K's."""
    found = {p.name: p for p in sorted(SHIPPED_PREDICTORS.iterdir()) if p.is_dir()} if SHIPPED_PREDICTORS.is_dir() else {}
    if BUNDLED_PREDICTORS.is_dir():
        found["stories260K"] = BUNDLED_PREDICTORS
    return found


def _trained_for(directory: Path) -> str | None:
    """The sha256 of the model a predictor directory's manifest names (None: no readable manifest)."""
    import json

    try:
        return json.loads((directory / "manifest.json").read_text()).get("model_sha256")
    except (OSError, ValueError, AttributeError):
        return None


def shipped_predictors(fingerprint: str) -> Path | None:
    """The predictors the package ships for this very model file (a named model, or a copy of the bundled
    stories260K: trained by the project on committed text), found by its sha256 in their manifest; None for any
    other model."""
    return next((p for p in _shipped().values() if _trained_for(p) == fingerprint), None)


def predictors_path(source: Path, directory: str | os.PathLike | None = None) -> Path:
    """Where a model's predictors are: `directory`; else predictors/ inside a HF directory; else predictors/ beside a
    model file when they were trained for it (models sharing a folder, e.g. the fetch cache, share that name: one's
    must not hide another's), else those the package ships for that very file, else that predictors/ (the error
    names it)."""
    if directory:
        return Path(directory)
    beside = (source if source.is_dir() else source.parent) / "predictors"
    if source.is_dir():
        return beside
    fingerprint = model_fingerprint(source)
    if beside.is_dir() and _trained_for(beside) == fingerprint:
        return beside
    return shipped_predictors(fingerprint) or beside


def load_predictors(weights: ModelWeights, layout, directory: str | os.PathLike | None = None, threads: int = 1):
    """The model's trained predictors (predictors_path). Checked against the model's sha256 so stale predictors are
    refused, and against the group layout they must rank (PredictorSet.check_fits)."""
    from halo.predictors.runtime import PredictorSet

    source = Path(weights.source)
    predictors = PredictorSet(trained_predictors_dir(source, directory), model_fingerprint(source), threads)
    predictors.check_fits(layout, weights.config)
    return predictors


def trained_predictors_dir(source: Path, directory: str | os.PathLike | None = None) -> Path:
    """predictors_path, or a ConfigError naming the command that trains them (generate checks it before loading)."""
    from halo.errors import ConfigError

    path = predictors_path(source, directory)
    if not path.is_dir():
        shipped = ", ".join(_shipped()) or "none"
        raise ConfigError(f"{path}: no trained predictors for {source.name} (HALO mode ranks groups with them; the "
                          f"package ships them for: {shipped}); train them: halo-train-predictors --model {source} "
                          f"--data TEXT --out {path}")
    return path
