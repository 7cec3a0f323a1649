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
        try:
            self.n_heads, self.n_mlp_groups, self.dim = (int(manifest[k]) for k in ("n_heads", "n_mlp_groups", "dim"))
            self.mlp_group_size = int(manifest.get("mlp_group_size", 0))  # (0: a manifest older than the field)
            files = {int(layer): directory / entry["file"] for layer, entry in manifest["layers"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{path}: a malformed manifest ({type(e).__name__}: {e}); retrain the predictors with "
                              "halo-train-predictors") from None
        options = session_options(threads)
        self.sessions = {}
        for layer, file in files.items():
            if not file.is_file():
                raise ConfigError(f"{file}: listed in the manifest but missing")
            try:
                self.sessions[layer] = ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
            except Exception as e:  # onnxruntime's own kinds (InvalidProtobuf, Fail, ...): a damaged or foreign file
                raise ConfigError(f"{file}: not a predictor onnxruntime can load ({str(e)[:200]}); retrain the "
                                  "predictors with halo-train-predictors") from None
        self.nbytes = sum(file.stat().st_size for file in files.values())

    def check_fits(self, layout, config) -> None:
        """The predictors rank the groups of this layout (heads, MLP groups of the runtime's size) of a model this
        wide and deep: a ConfigError naming what differs (predictors trained with another --mlp-group-size ranked
        16 groups where the runtime had 8, and the first forward pass failed deep in the framing)."""
        theirs = {"attention heads": self.n_heads, "MLP groups": self.n_mlp_groups, "width": self.dim}
        ours = {"attention heads": layout.n_attention_groups, "MLP groups": layout.n_mlp_groups, "width": config.dim}
        if self.mlp_group_size:
            theirs["MLP group size"], ours["MLP group size"] = self.mlp_group_size, layout.mlp_group_size
        differ = [f"{what} {theirs[what]} (this run: {ours[what]})" for what in ours if theirs[what] != ours[what]]
        outside = [layer for layer in self.sessions if not 0 < layer < config.n_layers]
        if outside:
            differ.append(f"layers {outside} (this model: 1..{config.n_layers - 1})")
        if differ:
            raise ConfigError(f"{self.manifest.get('model', 'these predictors')}: trained for another layout: "
                              f"{', '.join(differ)}; retrain them with halo-train-predictors (its default "
                              "--mlp-group-size is the runtime's), or run with the group size they were trained for")

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
