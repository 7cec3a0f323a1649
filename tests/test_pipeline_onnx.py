"""A stage's ONNX export (what browser workers run) against the numpy stage engine, with onnxruntime."""

import numpy as np
import pytest

from halo.model.loader import load_weights
from halo.pipeline.onnx_export import content_name, export_stage
from halo.pipeline.stage import HeadRequest, StageEngine


class OnnxStage:
    """Runs an exported stage the way the browser worker does: present KV becomes the next past."""

    def __init__(self, weights, start, stop, context):
        import onnxruntime as ort

        self.data = export_stage(weights, start, stop, context)
        self.session = ort.InferenceSession(self.data, providers=["CPUExecutionProvider"])
        c = weights.config
        self.layers = list(range(max(0, start - 1), min(c.n_layers, stop - 1)))
        self.past = {f"past_{kind}_{l}": np.zeros((c.n_kv_heads, 0, c.head_dim), np.float32)
                     for l in self.layers for kind in "kv"}
        self.start, self.head = start, stop == c.n_layers + 2

    def forward(self, x, pos, rows=None, k=1):
        feeds = {"start_pos": np.array([pos], np.int64), ("tokens" if self.start == 0 else "hidden"): x}
        feeds.update({name: value[:, :pos] for name, value in self.past.items()})
        if self.head:
            feeds["head_rows"] = np.array(rows if rows is not None else [len(x) - 1], np.int64)
            feeds["k"] = np.array([k], np.int64)
        names = [o.name for o in self.session.get_outputs()]
        out = dict(zip(names, self.session.run(None, feeds)))
        for name in self.past:
            self.past[name] = out[name.replace("past", "present")]
        return out


@pytest.mark.parametrize("stages", [[(0, 7)], [(0, 2), (2, 5), (5, 7)]])
def test_exported_stages_match_the_numpy_engine(stories_weights, stages):
    tokens = np.array([1, 403, 407, 261, 378, 1000 % 512], np.int64)
    onnx_stages = [OnnxStage(stories_weights, a, b, 64) for a, b in stages]
    engines = [StageEngine(stories_weights, a, b, 64) for a, b in stages]
    worst = 0.0
    for pos, chunk in [(0, tokens), (6, np.array([42], np.int64)), (7, np.array([7], np.int64))]:
        x_onnx, x_np = chunk, chunk
        for onnx_stage, engine in zip(onnx_stages, engines):
            out = onnx_stage.forward(x_onnx, pos, rows=list(range(len(chunk))), k=5)
            expected = engine.forward(x_np, pos, HeadRequest(0, all_positions=True))[0]
            got = out.get("hidden_out", out.get("logits"))
            worst = max(worst, float(np.abs(got - expected).max()))
            assert np.allclose(got, expected, atol=2e-4, rtol=1e-4)
            x_onnx, x_np = got, expected
        assert out["top_ids"][0] == int(np.argmax(expected[-1]))
        assert np.allclose(out["top_values"], np.sort(expected[-1])[::-1][:5], atol=2e-4)
    assert worst < 2e-4


def test_random_hf_gqa_model_exports_too(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import make_checkpoint

    make_checkpoint(tmp_path, seed=7, num_attention_heads=8, num_key_value_heads=2, intermediate_size=200)
    weights = load_weights(tmp_path)
    tokens = np.array([0, 5, 77, 140, 9], np.int64)
    onnx_stage, engine = OnnxStage(weights, 0, 4, 32), StageEngine(weights, 0, 4, 32)
    for pos, chunk in [(0, tokens), (5, np.array([3], np.int64))]:
        got = onnx_stage.forward(chunk, pos)
        expected = engine.forward(chunk, pos, HeadRequest(0))[0]
        assert np.allclose(got["logits"], expected, atol=2e-4, rtol=1e-4)


def test_the_file_name_is_its_content_hash(stories_weights):
    a = export_stage(stories_weights, 2, 4, 64)
    assert content_name(a) == content_name(export_stage(stories_weights, 2, 4, 64))
    assert content_name(a) != content_name(export_stage(stories_weights, 2, 5, 64))
