"""The compact int8 format: quantization error bounded, generation close to fp32."""

import numpy as np

from halo.compute.linear import INT8_BLOCK, dequantize_int8, make_projection, quantize_int8
from halo.compute.transformer import Transformer
from halo.model.loader import load_tokenizer


def test_quantization_error_is_within_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((50, 70)).astype(np.float32)  # 70 is not a multiple of the block
    codes, scales = quantize_int8(w, rows_per_chunk=16)
    restored = dequantize_int8(codes, scales, 70)
    step = np.repeat(scales, INT8_BLOCK, axis=1)[:, :70]
    assert np.all(np.abs(restored - w) <= step / 2 + 1e-6)


def test_int8_projection_matches_the_dequantized_matrix():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((40, 96)).astype(np.float32), rng.standard_normal((24, 96)).astype(np.float32)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    ya, yb = make_projection([a, b], "int8")(x)
    assert ya.shape == (3, 40) and yb.shape == (3, 24)
    exact = x @ a.T
    # int8 weights and int8 activations: about 1 % relative error
    assert np.abs(ya - exact).max() / np.abs(exact).max() < 0.03


def test_int8_model_agrees_with_fp32_on_next_tokens(stories_weights, known_answer):
    tokenizer = load_tokenizer(stories_weights)
    ids = tokenizer.encode(known_answer)
    fp32 = Transformer(stories_weights, "fp32").forward(ids, all_logits=True)
    int8_model = Transformer(stories_weights, "int8")
    int8 = int8_model.forward(ids, all_logits=True)
    agreement = np.mean(fp32.argmax(-1) == int8.argmax(-1))
    assert agreement > 0.95, agreement
    assert int8_model.weight_nbytes() < 0.45 * Transformer(stories_weights, "fp32").weight_nbytes()
