"""A decode step (one token through a block's share in one C call: halo/_nbits.c attention_step and mlp_step) computes
what the block's numpy path computes, for any share of its groups; the kernel's packed layout round-trips; the steps'
boundary refuses what does not fit."""

import numpy as np
import pytest

from gguf_models import tiny_gguf
from halo.compute import linear
from halo.compute.neuron_groups import AttentionShard, GroupLayout, MlpShard
from halo.compute.transformer import Transformer
from halo.model.loader import load_weights
from halo.model.ops import Rotary, rmsnorm

needs_c = pytest.mark.skipif(linear.projection_kernel() != "halo._nbits",
                             reason="halo._nbits not built or no vector path on this CPU: compact projections run on "
                                    "onnxruntime, and blocks on its graphs, not the C decode steps")
CONTEXT = 16


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1", "Q8_0"])
def weights(request, tmp_path_factory):
    """4 query heads of 32 over 2 KV heads (one head's W_o columns are a whole block), MLP groups of 32."""
    path = tmp_path_factory.mktemp("step") / "model.gguf"
    return load_weights(tiny_gguf(path, request.param, seed=3, num_attention_heads=4, num_key_value_heads=2,
                                  hidden_size=128))


def relative_error(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@needs_c
@pytest.mark.parametrize("heads", [[0, 1, 2, 3], [0, 1], [2, 3], [1, 2], [3], [0, 2, 3], [1, 3]])
def test_an_attention_step_is_the_blocks_numpy_path(weights, heads):
    c = weights.config
    layout, rotary, layer = GroupLayout.for_model(c), Rotary(c, CONTEXT), weights.layers[1]
    stepped, reference = (AttentionShard(layer, layout, heads, CONTEXT, "native") for _ in range(2))
    assert stepped.fused
    rng = np.random.default_rng(len(heads))
    x = rng.standard_normal((9, c.dim)).astype(np.float32)
    norm = np.array(layer.attn_norm)
    prompt = rmsnorm(x[:5], norm, c.norm_eps)
    stepped.forward(prompt, 0, rotary)  # a prefill: the numpy path, writing the cache
    reference.forward(prompt, 0, rotary)
    for pos in range(5, 9):
        got = stepped.step(x[pos:pos + 1], norm, c.norm_eps, pos, rotary)
        want = reference.forward(rmsnorm(x[pos:pos + 1], norm, c.norm_eps), pos, rotary)
        assert got.shape == want.shape == (1, c.dim) and relative_error(got, want) < 1e-4, (pos, relative_error(got, want))
    for cache in ("cache_k", "cache_v"):  # the step wrote the new positions' rotated keys and values
        got, want = getattr(stepped, cache)[0, :9], getattr(reference, cache)[0, :9]
        assert np.array_equal(got[:5], want[:5]) and relative_error(got, want) < 1e-5
        assert not getattr(stepped, cache)[0, 9:].any()


@needs_c
@pytest.mark.parametrize("groups", [None, [0, 1], [2, 5, 7], [7]])
def test_an_mlp_step_is_the_blocks_numpy_path(weights, groups):
    c = weights.config
    layout, layer = GroupLayout.for_model(c), weights.layers[0]
    shard = MlpShard(layer, layout, groups or range(layout.n_mlp_groups), "native")
    assert shard.fused
    norm = np.array(layer.mlp_norm)
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, c.dim)).astype(np.float32)
        got, want = shard.step(x, norm, c.norm_eps), shard.forward(rmsnorm(x, norm, c.norm_eps))
        assert relative_error(got, want) < 1e-4, relative_error(got, want)


@needs_c
def test_halos_groups_of_a_token_run_in_one_step(weights):
    """HALO mode's re-mapped groups of a decode step (MlpGroupBank.forward, one token, sessions-free C kernels): one
    mlp_step over the list of groups, what the groups' numpy path sums."""
    from halo.compute.neuron_groups import MlpGroupBank

    c = weights.config
    layout = GroupLayout.for_model(c)
    bank = MlpGroupBank(weights.layers[1], layout, "native")
    x = np.random.default_rng(3).standard_normal((1, c.dim)).astype(np.float32)
    for groups in ([0], [5, 2, 7], list(range(layout.n_mlp_groups))):
        want = sum(bank.shard(g).forward(x) for g in groups)  # each group's numpy path, added in order
        got = bank.forward(x, groups)
        assert relative_error(got, want) < 1e-4, (groups, relative_error(got, want))
    two = np.concatenate([x, x])  # two tokens, or a token some groups skip: the per-group path
    assert relative_error(bank.forward(two, [1, 3])[1:], bank.forward(x, [1, 3])) < 1e-4
    assert not bank.forward(x, [1, 3], keep=np.array([[False, False]])).any()
    # the layer's norm applied where the groups are computed (in the step's C call; numpy for two tokens), as the
    # worker does, against the input normed first
    norm = np.array(weights.layers[1].mlp_norm)
    normed = rmsnorm(x, norm, c.norm_eps)
    assert relative_error(bank.forward(x, [5, 2, 7], norm=norm, eps=c.norm_eps), bank.forward(normed, [5, 2, 7])) < 1e-5
    assert relative_error(bank.forward(two, [1, 3], norm=norm, eps=c.norm_eps)[1:], bank.forward(normed, [1, 3])) < 1e-5


@needs_c
def test_shares_of_steps_add_up_and_a_model_decodes_through_them(weights):
    """The heads' steps of a partition add up to the whole block's step (a head's output does not depend on the shard
    holding it); a model decoding a token at a time (steps) gives the logits its prefill gives (numpy path)."""
    c = weights.config
    layout, rotary, layer = GroupLayout.for_model(c), Rotary(c, CONTEXT), weights.layers[0]
    x = np.random.default_rng(7).standard_normal((1, c.dim)).astype(np.float32)
    norm = np.array(layer.attn_norm)
    whole = AttentionShard(layer, layout, range(4), CONTEXT, "native").step(x, norm, c.norm_eps, 0, rotary)
    parts = [AttentionShard(layer, layout, heads, CONTEXT, "native").step(x, norm, c.norm_eps, 0, rotary)
             for heads in ([0, 3], [1], [2])]
    assert relative_error(sum(parts), whole) < 1e-5

    model = Transformer(weights, "native", max_seq_len=CONTEXT)
    assert all(s.fused for s in [*model.worker.attention.values(), *model.worker.mlp.values()])
    assert not any(s.fused for s in Transformer(weights, "fp32", max_seq_len=CONTEXT).worker.attention.values())
    tokens = [1, 17, 99, 4, 250, 31]
    prefill = model.forward(tokens, 0, all_logits=True)
    model.reset()
    stepped = np.stack([model.forward([t]) for t in tokens])
    assert relative_error(stepped, prefill) < 1e-3 and np.array_equal(stepped.argmax(-1), prefill.argmax(-1))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("offsets", [False, True])
def test_the_packed_layout_round_trips(dtype, offsets):
    """pack: 16-row tiles, each block's codes then scales then offsets; rows past n are zeros; unpack gives the
    MatMulNBits arrays back."""
    rng = np.random.default_rng(1)
    n, blocks, block_bytes = 37, 3, 16
    codes = rng.integers(0, 256, (n, blocks, block_bytes), dtype=np.uint8)
    scales = rng.standard_normal((n, blocks)).astype(dtype)
    minimums = rng.standard_normal((n, blocks)).astype(dtype) if offsets else None
    packed = linear.pack(codes, scales, minimums)
    assert packed.shape == linear.packed_shape(n, blocks, block_bytes, np.dtype(dtype).itemsize, offsets)
    assert packed.shape == (3, blocks, 16 * block_bytes + 16 * np.dtype(dtype).itemsize * (2 if offsets else 1))
    # row 17 (tile 1, row 1), block 2: word w of its codes at 64 w + 4, its scale after the 16 rows' codes
    unit = packed[1, 2]
    assert np.array_equal(unit[[64 * w + 4 + j for w in range(4) for j in range(4)]], codes[17, 2])
    assert unit[256:256 + 16 * np.dtype(dtype).itemsize].view(dtype)[1] == scales[17, 2]
    back = linear.unpack(packed, n, block_bytes, dtype, offsets)
    assert np.array_equal(back[0], codes) and np.array_equal(back[1], scales)
    assert back[2] is None if not offsets else np.array_equal(back[2], minimums)
    padded = linear.unpack(packed, 48, block_bytes, dtype, offsets)
    assert not padded[0][n:].any() and not padded[1][n:].any()


@needs_c
def test_a_step_refuses_what_does_not_fit(weights):
    c = weights.config
    layout, rotary, layer = GroupLayout.for_model(c), Rotary(c, CONTEXT), weights.layers[0]
    shard = AttentionShard(layer, layout, range(4), CONTEXT, "native")
    (qkv, out), nbits = shard.step_weights, linear._nbits
    x, norm, y = np.ones((1, c.dim), np.float32), np.ones(c.dim, np.float32), np.empty((1, c.dim), np.float32)

    def step(**changed):
        args = dict(x=x, norm=norm, eps=1e-5, qkv=qkv, out=out, cos=rotary.cos, sin=rotary.sin, cache_k=shard.cache_k[0],
                    cache_v=shard.cache_v[0], pos=3, kv_of_head=shard.kv_of_head, y=y)
        nbits.attention_step(**{**args, **changed})

    step()
    with pytest.raises(ValueError, match=f"position {CONTEXT} is beyond the context length {CONTEXT}"):
        step(pos=CONTEXT)
    with pytest.raises(ValueError, match=r"kv_of_head a KV head \(0 .. kv heads - 1\) for each query head"):
        step(kv_of_head=np.array([0, 0, 1, 2], np.int32))
    with pytest.raises(ValueError, match=r"qkv has 256 rows and out 128 inputs; 2 heads and 2 KV heads of 32 need 192 and 64"):
        step(kv_of_head=np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match=r"kv_of_head holds values of type 'l'; it must be int32"):
        step(kv_of_head=np.array([0, 0, 1, 1], np.int64))
    with pytest.raises(ValueError, match="caches must be"):
        step(cache_v=shard.cache_v[0, :, :1].copy())
    with pytest.raises(ValueError, match=r"x must be \[T, 128\] and y \[T, 128\] float32"):
        step(y=y[:, :64].copy())
    three = np.ones((3, c.dim), np.float32)  # T positions at once: all of them within the context
    step(x=three, y=np.empty((3, c.dim), np.float32), pos=CONTEXT - 3)
    with pytest.raises(ValueError, match=f"positions {CONTEXT - 2}..{CONTEXT} are beyond the context length {CONTEXT}"):
        step(x=three, y=np.empty((3, c.dim), np.float32), pos=CONTEXT - 2)
    with pytest.raises(ValueError, match=r"x must be \[T, 128\] and y \[T, 128\] float32"):
        step(x=three)  # y for one position
    with pytest.raises(ValueError, match="cache_k holds values of type 'd'"):
        step(cache_k=shard.cache_k[0].astype(np.float64))
    with pytest.raises(TypeError, match=r"qkv must be a \(packed, n, bits, block, half, offsets, terms\) tuple"):
        step(qkv=qkv[:3])
    mlp = MlpShard(layer, layout, range(layout.n_mlp_groups), "native")
    gate_up, down = mlp.step_weights
    nbits.mlp_step(x, norm, 1e-5, [(gate_up, down)], y)
    with pytest.raises(ValueError, match=r"mlp_step: group 1's gate_up has 128 rows \(gate's, then up's\) of 128 "
                                         r"inputs and down 128 rows of 256 inputs"):
        nbits.mlp_step(x, norm, 1e-5, [(gate_up, down), (out, down)], y)  # W_o (128 x 128) is no gate/up for W_down
    with pytest.raises(TypeError, match="mlp_step: group 0 is not a"):
        nbits.mlp_step(x, norm, 1e-5, [gate_up], y)
    with pytest.raises(ValueError, match="mlp_step: 0 groups"):
        nbits.mlp_step(x, None, 0.0, [], y)
    with pytest.raises(ValueError, match="norm holds 64 values; the shapes given need 128"):
        nbits.mlp_step(x, norm[:64].copy(), 1e-5, [(gate_up, down)], y)


@needs_c
@pytest.mark.parametrize("shape, heads", [((10, 1, 640), list(range(10))), ((10, 1, 640), list(range(9))),
                                          ((10, 1, 640), [1, 3, 4, 9]), ((4, 2, 384), [0, 1, 2, 3]),
                                          ((2, 1, 576), [0, 1]), ((10, 2, 640), [0, 5, 1, 6, 2, 7, 3, 8, 4, 9]),
                                          ((12, 1, 768), [11, 0, 10, 1, 9, 2, 8, 3, 7, 4, 6, 5])])
def test_an_attention_step_over_a_long_cache_is_the_numpy_path(tmp_path, shape, heads):
    """Past several of the kernel's cache tiles (32 positions), with more query heads on one KV head than it takes
    in one call (8), in 64-wide heads (its register span), 96-wide ones (a span and a part) and 288-wide ones (wider
    than a tile transposes: a dot a score), and with a shard's heads in any order (their KV heads interleaved): the
    same output as numpy's."""
    n_heads, n_kv, dim = shape
    weights = load_weights(tiny_gguf(tmp_path / "long.gguf", "Q8_0", seed=5, num_attention_heads=n_heads,
                                     num_key_value_heads=n_kv, hidden_size=dim))
    c, context = weights.config, 80
    layout, rotary, layer = GroupLayout.for_model(c), Rotary(c, context), weights.layers[0]
    stepped, reference = (AttentionShard(layer, layout, heads, context, "native") for _ in range(2))
    assert stepped.fused and layout.head_dim == dim // n_heads
    rng = np.random.default_rng(7)
    x = rng.standard_normal((context, c.dim)).astype(np.float32)
    norm = np.array(layer.attn_norm)
    prompt = rmsnorm(x[:69], norm, c.norm_eps)
    stepped.forward(prompt, 0, rotary)
    reference.forward(prompt, 0, rotary)
    for pos in (69, 70, 71):
        got = stepped.step(x[pos:pos + 1], norm, c.norm_eps, pos, rotary)
        want = reference.forward(rmsnorm(x[pos:pos + 1], norm, c.norm_eps), pos, rotary)
        assert relative_error(got, want) < 1e-4, (pos, relative_error(got, want))
