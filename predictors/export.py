"""Export trained predictors to ONNX (one small graph per layer) with a manifest.

The graph is written directly with onnx.helper (standardize -> Gemm -> Relu -> Gemm): it is four
nodes, and building it from the trained arrays avoids depending on torch's exporter version.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np

from halo import __version__

from halo.predictors.runtime import FORMAT, MANIFEST, VERSION
from halo.predictors.trainer import LayerPredictor


def predictor_graph(p: LayerPredictor):
    from onnx import TensorProto, helper, numpy_helper

    d = p.w1.shape[1]
    init = [numpy_helper.from_array(a.astype(np.float32), name) for name, a in
            (("mean", p.mean), ("std", p.std), ("w1", p.w1), ("b1", p.b1), ("w2", p.w2), ("b2", p.b2))]
    nodes = [helper.make_node("Sub", ["hidden", "mean"], ["centred"]),
             helper.make_node("Div", ["centred", "std"], ["standard"]),
             helper.make_node("Gemm", ["standard", "w1", "b1"], ["h1"], transB=1),
             helper.make_node("Relu", ["h1"], ["a1"]),
             helper.make_node("Gemm", ["a1", "w2", "b2"], ["scores"], transB=1)]
    graph = helper.make_graph(nodes, f"halo_predictor_layer_{p.layer}",
                              [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["N", d])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", p.w2.shape[0]])],
                              initializer=init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def export(predictors: list[LayerPredictor], out: str | Path, meta: dict, settings: dict) -> Path:
    import onnx
    import onnxruntime

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layers = {}
    for p in predictors:
        name = f"layer_{p.layer}.onnx"
        onnx.save(predictor_graph(p), out / name)
        layers[str(p.layer)] = {"file": name, "input_layer": p.layer - 1, "heads": p.n_heads,
                                "mlp_groups": p.n_mlp_groups, "bytes": p.nbytes, "epochs": p.epochs_run,
                                "metrics": p.metrics}
    versions = {"halo": __version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                "python": platform.python_version()}
    try:
        import torch

        versions["torch"] = torch.__version__
    except ImportError:  # pragma: no cover - export runs where training ran
        pass
    manifest = {"format": FORMAT, "version": VERSION, "model": meta["model"], "model_sha256": meta["model_sha256"],
                "n_layers": meta["n_layers"], "dim": meta["dim"], "n_heads": meta["n_heads"],
                "n_mlp_groups": meta["n_mlp_groups"], "mlp_group_size": meta["mlp_group_size"],
                "input": "hidden state entering layer input_layer; standardized inside the graph (mean/std)",
                "output": "scores: heads first, then MLP groups; higher = more important",
                "data": {k: meta[k] for k in ("text", "train_fraction", "window", "max_chars", "tokens")},
                "training": settings, "versions": versions, "layers": layers}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out
