"""Every backend of halo/compute/backends.py held to the one reference: numpy over float32 weights.

A block's backends compute a share from the same weights; the reference computes it from those weights as float32
(a GGUF's blocks dequantized). "native" keeps the file's blocks, so a backend may differ from the reference only by
its rounding (activations in int8 codes of two terms: ~4e-5 of the output's scale here); "int8" quantizes the
weights again (~1.4e-2 here), and there the backends must agree with each other.
"""

import numpy as np
import pytest

from gguf_models import tiny_gguf
from halo.compute import linear
from halo.compute.backends import BLOCK_BACKENDS, stage_backend
from halo.compute.neuron_groups import AttentionShard, GroupLayout, MlpShard
from halo.compute.transformer import Transformer
from halo.errors import ConfigError
from halo.model.loader import load_weights
from halo.model.ops import Rotary, rmsnorm
from halo.pipeline.stage import HeadRequest, StageEngine

CONTEXT = 16
TOLERANCE = {"native": 1e-3, "int8": 3e-2}  # of the reference output's largest magnitude


@pytest.fixture(scope="module")
def q4_weights(tmp_path_factory):
    return load_weights(tiny_gguf(tmp_path_factory.mktemp("backends") / "tiny.gguf", "Q4_0"))


def block_output(weights, kind: str, fmt: str, x: np.ndarray) -> tuple[str, np.ndarray]:
    """Layer 0's `kind` block over every group, as the worker runs it: (its backend, output for x at 0..)."""
    c, layer = weights.config, weights.layers[0]
    layout, rotary = GroupLayout.for_model(c), Rotary(c, CONTEXT)
    if kind == "attention":
        shard = AttentionShard(layer, layout, range(layout.n_heads), CONTEXT, fmt)
        if shard.fused:
            return shard.backend, shard.step(x, layer.attn_norm, c.norm_eps, 0, rotary)
        return shard.backend, shard.forward(rmsnorm(x, layer.attn_norm, c.norm_eps), 0, rotary)
    shard = MlpShard(layer, layout, range(layout.n_mlp_groups), fmt)
    if shard.fused:
        return shard.backend, shard.step(x, layer.mlp_norm, c.norm_eps)
    return shard.backend, shard.forward(rmsnorm(x, layer.mlp_norm, c.norm_eps))


def test_the_block_backend_is_chosen_in_one_place(q4_weights, monkeypatch):
    x = np.zeros((1, q4_weights.config.dim), np.float32)
    assert block_output(q4_weights, "mlp", "fp32", x)[0] == "projections"
    if linear.C_KERNEL_VECTORIZED:
        assert block_output(q4_weights, "mlp", "native", x)[0] == "c-step"
    monkeypatch.setattr(linear, "PREFER_C_KERNEL", False)
    assert block_output(q4_weights, "attention", "native", x)[0] == "onnx-graph"
    assert block_output(q4_weights, "attention", "int8", x)[0] == "onnx-graph"


@pytest.mark.parametrize("kind", ["attention", "mlp"])
@pytest.mark.parametrize("fmt", ["native", "int8"])
def test_every_block_backend_computes_the_reference(q4_weights, monkeypatch, kind, fmt):
    x = np.random.default_rng(0).standard_normal((5, q4_weights.config.dim)).astype(np.float32)
    backend, reference = block_output(q4_weights, kind, "fp32", x)
    assert backend == "projections"
    outputs = {}
    for prefer_c in (True, False):
        monkeypatch.setattr(linear, "PREFER_C_KERNEL", prefer_c)
        backend, out = block_output(q4_weights, kind, fmt, x)
        outputs[backend] = out
        error = np.abs(out - reference).max() / np.abs(reference).max()
        assert error < TOLERANCE[fmt], f"{backend} ({fmt}): {error:.2e} of the reference's scale"
    assert set(outputs) <= set(BLOCK_BACKENDS) and "onnx-graph" in outputs
    if linear.C_KERNEL_VECTORIZED:  # where the C kernel is built, both compact backends ran
        assert set(outputs) == {"c-step", "onnx-graph"}
    first, *rest = outputs.values()
    for out in rest:  # the same quantized weights: the backends agree with each other within rounding
        assert np.abs(out - first).max() <= 1e-3 * np.abs(first).max()


def test_every_stage_backend_computes_the_reference(stories_weights):
    """A pipeline stage's backends (torch on the CPU here; halo's shards) and the browser's ONNX export, all
    layers and the head, against the single-process reference's logits at every position."""
    pytest.importorskip("torch", reason="the torch stage engine needs torch (the dev extra)")
    from test_pipeline_onnx import OnnxStage

    from halo.pipeline.torch_stage import TorchStageEngine

    c = stories_weights.config
    tokens = np.array([1, 403, 407, 261, 378, 42], np.int64)
    reference = Transformer(stories_weights, max_seq_len=64).forward(tokens, all_logits=True)
    units = c.n_layers + 2  # embedding, layers, head
    engines = {"halo": StageEngine(stories_weights, 0, units, 64),
               "torch": TorchStageEngine(stories_weights, 0, units, 64, "cpu")}
    for name, engine in engines.items():
        logits = engine.forward(tokens, 0, HeadRequest(0, all_positions=True))[0]
        assert np.allclose(logits, reference, atol=2e-4, rtol=1e-4), name
    exported = OnnxStage(stories_weights, 0, units, 64).forward(tokens, 0, rows=list(range(len(tokens))))
    assert np.allclose(exported["logits"], reference, atol=2e-4, rtol=1e-4)


def test_the_stage_backend_is_chosen_in_one_place(monkeypatch):
    from halo.compute import backends

    assert stage_backend("torch-cpu") == ("torch", "cpu")
    assert stage_backend("cpu") == ("halo", "cpu")
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    assert stage_backend("auto") == stage_backend("cuda") == ("torch", "cuda")
    assert stage_backend("cpu") == ("halo", "cpu")
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    assert stage_backend("auto") == ("halo", "cpu")
    with pytest.raises(ConfigError, match="--device cuda: torch with CUDA is not available here"):
        stage_backend("cuda")
    with pytest.raises(ConfigError, match="unknown stage device 'tpu'"):
        stage_backend("tpu")
