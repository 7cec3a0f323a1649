"""Running predictors on an agent: onnxruntime only (no torch), thread-safe, batched.

`PredictorSet.rank(layer, hidden)` takes the hidden state entering layer-1 (what every agent has
when layer-1 starts) and returns layer's attention heads and MLP groups, most important first.
Every agent runs the same graph on the same broadcast hidden state with one intra-op thread, so all
agents compute identical scores and, with a stable sort, identical rankings.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from halo.compute.linear import session_options
from halo.errors import ConfigError

MANIFEST = "manifest.json"  # the format of a predictor directory, which export.py writes
FORMAT, VERSION = "halo-predictors", 1


class PredictorSet:
    def __init__(self, directory: str | Path, model_sha256: str | None = None, threads: int = 1):
        import onnxruntime as ort

        directory = Path(directory)
        path = directory / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"{path}: no predictor manifest; train predictors with halo-train-predictors") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise ConfigError(f"{path}: not a version-{VERSION} {FORMAT} manifest; retrain with this halo")
        if model_sha256 and manifest.get("model_sha256") != model_sha256:
            raise ConfigError(f"{path}: these predictors were trained for another model "
                              f"(sha256 {manifest.get('model_sha256', '?')[:12]}..., this model {model_sha256[:12]}...)")
        self.manifest = manifest
        self.n_heads = int(manifest["n_heads"])
        self.n_mlp_groups = int(manifest["n_mlp_groups"])
        self.dim = int(manifest["dim"])
        options = session_options(threads)
        self.sessions = {}
        for layer, entry in manifest["layers"].items():
            file = directory / entry["file"]
            if not file.is_file():
                raise ConfigError(f"{file}: listed in the manifest but missing")
            self.sessions[int(layer)] = ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
        self.nbytes = sum((directory / e["file"]).stat().st_size for e in manifest["layers"].values())

    @property
    def layers(self) -> list[int]:
        return sorted(self.sessions)

    def scores(self, layer: int, hidden: np.ndarray) -> np.ndarray:
        """[N, D] or [D] hidden states entering layer-1 -> [N, H + G] importance scores of `layer`."""
        if layer not in self.sessions:
            raise ConfigError(f"no predictor for layer {layer}; available: {self.layers}")
        x = np.ascontiguousarray(np.atleast_2d(hidden), dtype=np.float32)
        if x.shape[-1] != self.dim:
            raise ValueError(f"hidden state has {x.shape[-1]} features; the predictors expect {self.dim}")
        return self.sessions[layer].run(None, {"hidden": x})[0]

    def rank(self, layer: int, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(heads, MLP groups) of `layer`, most important first; [N, H] and [N, G] for a batch."""
        s = self.scores(layer, hidden)
        heads = np.argsort(-s[:, :self.n_heads], axis=1, kind="stable")
        groups = np.argsort(-s[:, self.n_heads:], axis=1, kind="stable")
        if np.ndim(hidden) == 1:
            return heads[0], groups[0]
        return heads, groups
