"""The sum of partial outputs over any partition of neuron groups equals the whole block's output."""

import numpy as np
import pytest

from halo.compute.neuron_groups import AttentionShard, GroupLayout, LmHeadShard, MlpShard
from halo.model.loader import load_weights
from halo.model.ops import Rotary

MAX_SEQ = 32


def random_partition(rng, n_groups: int, n_sets: int) -> list[list[int]]:
    n_sets = min(n_sets, n_groups)
    owner = np.concatenate([np.arange(n_sets), rng.integers(0, n_sets, n_groups - n_sets)])
    rng.shuffle(owner)
    return [sorted(np.flatnonzero(owner == s).tolist()) for s in range(n_sets)]


def relative_error(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=["stories260K", "random-hf-gqa"])
def weights(request, tmp_path_factory):
    if request.param == "stories260K":
        return load_weights()
    pytest.importorskip("transformers")
    from hf_models import make_checkpoint

    directory = tmp_path_factory.mktemp("gqa")
    make_checkpoint(directory, seed=1, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                    intermediate_size=200, vocab_size=300)
    return load_weights(directory)


@pytest.mark.parametrize("n_sets", range(1, 9))
def test_attention_partial_outputs_sum_to_the_block(weights, n_sets):
    rng = np.random.default_rng(n_sets)
    c = weights.config
    layout = GroupLayout.for_model(c)
    layer = weights.layers[rng.integers(c.n_layers)]
    rotary = Rotary(c, MAX_SEQ)
    full = AttentionShard(layer, layout, range(layout.n_attention_groups), MAX_SEQ)
    shards = [AttentionShard(layer, layout, s, MAX_SEQ) for s in random_partition(rng, layout.n_attention_groups, n_sets)]
    prefill = rng.standard_normal((5, c.dim)).astype(np.float32)
    expected = full.forward(prefill, 0, rotary)
    assert relative_error(sum(s.forward(prefill, 0, rotary) for s in shards), expected) <= 1e-5
    for pos in range(5, 8):  # decode steps read each shard's own KV cache
        x = rng.standard_normal((1, c.dim)).astype(np.float32)
        expected = full.forward(x, pos, rotary)
        assert relative_error(sum(s.forward(x, pos, rotary) for s in shards), expected) <= 1e-5


@pytest.mark.parametrize("group_size", [16, 25, 256])
@pytest.mark.parametrize("n_sets", [1, 2, 3, 5, 8])
def test_mlp_partial_outputs_sum_to_the_block(weights, n_sets, group_size):
    rng = np.random.default_rng(n_sets + group_size)
    c = weights.config
    layout = GroupLayout.for_model(c, mlp_group_size=group_size)
    layer = weights.layers[rng.integers(c.n_layers)]
    x = rng.standard_normal((4, c.dim)).astype(np.float32)
    expected = MlpShard(layer, layout, range(layout.n_mlp_groups)).forward(x)
    parts = random_partition(rng, layout.n_mlp_groups, n_sets)
    total = sum(MlpShard(layer, layout, s).forward(x) for s in parts)
    assert relative_error(total, expected) <= 1e-5


def test_remainder_group_holds_the_leftover_neurons():
    layout = GroupLayout(n_heads=8, n_kv_heads=4, head_dim=8, hidden_dim=172, vocab_size=512, mlp_group_size=16)
    assert layout.n_mlp_groups == 11
    assert list(layout.mlp_neurons(10)) == list(range(160, 172))
    assert sum(len(layout.mlp_neurons(g)) for g in range(11)) == 172


@pytest.mark.parametrize("n_sets", [1, 3, 8])
def test_lm_head_groups_concatenate_to_the_logits(weights, n_sets):
    rng = np.random.default_rng(n_sets)
    c = weights.config
    layout = GroupLayout.for_model(c, vocab_group_size=37)
    x = rng.standard_normal((2, c.dim)).astype(np.float32)
    expected = LmHeadShard(weights.lm_head, layout, range(layout.n_vocab_groups)).forward(x)
    merged = np.zeros_like(expected)
    for s in random_partition(rng, layout.n_vocab_groups, n_sets):
        shard = LmHeadShard(weights.lm_head, layout, s)
        merged[:, shard.token_ids] = shard.forward(x)
    np.testing.assert_allclose(merged, expected, rtol=1e-6, atol=1e-6)


def test_group_norms_are_the_norms_of_each_groups_contribution(weights):
    rng = np.random.default_rng(0)
    c = weights.config
    layout = GroupLayout.for_model(c, mlp_group_size=32)
    layer = weights.layers[0]
    x = rng.standard_normal((3, c.dim)).astype(np.float32)
    full = MlpShard(layer, layout, range(layout.n_mlp_groups))
    partial, norms = full.forward(x, with_norms=True)
    assert relative_error(partial, full.forward(x)) <= 1e-5
    for g in range(layout.n_mlp_groups):
        alone = MlpShard(layer, layout, [g]).forward(x)
        np.testing.assert_allclose(norms[:, g], np.linalg.norm(alone, axis=-1), rtol=1e-4)
    rotary = Rotary(c, MAX_SEQ)
    attention = AttentionShard(layer, layout, range(c.n_heads), MAX_SEQ)
    out, head_norms = attention.forward(x, 0, rotary, with_norms=True)
    for h in range(c.n_heads):
        alone = AttentionShard(layer, layout, [h], MAX_SEQ).forward(x, 0, rotary)
        np.testing.assert_allclose(head_norms[:, h], np.linalg.norm(alone, axis=-1), rtol=1e-4, atol=1e-6)


def test_kv_heads_follow_the_query_heads(stories_weights):
    layout = GroupLayout.for_model(stories_weights.config)
    shard = AttentionShard(stories_weights.layers[0], layout, [1, 4, 5], MAX_SEQ)
    assert shard.kv_heads == (0, 2)  # 8 query heads over 4 KV heads: head h reads KV head h // 2
    assert shard.cache_k.shape == (1, MAX_SEQ, 2, 8)  # [slots, positions, local KV heads, head_dim]


@pytest.mark.parametrize("heads", [range(8), [2, 3, 6, 7], [1, 4, 5]])
def test_attention_over_kv_heads_at_once_is_the_loop_over_them(weights, heads):
    """Shares whose KV heads are each read by the same run of query heads (a whole layer, whole KV groups) attend in
    one batched product per step; the result is the per-KV-head loop's (which irregular shares run), bit for bit,
    in a prefill (causal mask) and in decode steps."""
    c = weights.config
    layout = GroupLayout.for_model(c)
    if max(heads) >= layout.n_attention_groups:
        pytest.skip("fewer heads in this model")
    rotary, rng = Rotary(c, MAX_SEQ), np.random.default_rng(5)
    batched, looped = (AttentionShard(weights.layers[0], layout, heads, MAX_SEQ) for _ in range(2))
    regular = all(len(batched.heads_of_kv[0]) == len(h) for h in batched.heads_of_kv)
    assert batched.kv_batched == regular  # [1, 4, 5] on 2 query heads per KV head: KV 0 read by one, KV 2 by two
    looped.kv_batched = False
    for start, tokens in [(0, 5), (5, 1), (6, 1), (7, 3)]:
        x = rng.standard_normal((tokens, c.dim)).astype(np.float32)
        np.testing.assert_array_equal(batched.forward(x, start, rotary), looped.forward(x, start, rotary))


@pytest.mark.parametrize("groups", [[], [0, 0], [99]])
def test_invalid_group_sets_are_refused(stories_weights, groups):
    layout = GroupLayout.for_model(stories_weights.config)
    with pytest.raises(ValueError, match="group"):
        AttentionShard(stories_weights.layers[0], layout, groups, MAX_SEQ)


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_group_bank_computes_any_subset_like_a_shard_of_it(weights, fmt):
    """HALO mode's bank: any re-mapped subset of groups (with per-token keep masks) gives what a static
    shard of those groups gives; compact banks run per-group kernels, so int8 rounds within its own error."""
    from halo.compute.neuron_groups import MlpGroupBank

    layout = GroupLayout.for_model(weights.config)
    layer = weights.layers[1]
    bank = MlpGroupBank(layer, layout, fmt)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, weights.config.dim)).astype(np.float32)
    groups = sorted(rng.choice(layout.n_mlp_groups, 3, replace=False).tolist())
    exact = MlpShard(layer, layout, groups).forward(x)
    tolerance = 1e-5 if fmt == "fp32" else 3e-2
    assert relative_error(bank.forward(x, groups), exact) < tolerance
    keep = np.ones((3, len(groups)), dtype=bool)
    keep[1, 0] = False  # token 1 is not served by the first group
    expected = exact[1] - MlpShard(layer, layout, groups[:1]).forward(x[1:2])[0]
    assert relative_error(bank.forward(x, groups, keep)[1], expected) < tolerance
    assert (bank.nbytes if fmt == "fp32" else bank.cache.held_bytes) > 0


def test_one_graph_blocks_match_their_kernels_called_one_by_one(weights, monkeypatch):
    """Compact formats on MatMulNBits (where halo's C kernel is not built) run a block's share as one onnxruntime
    graph (halo/compute/block_graph.py); it computes what the same kernels give called one at a time around numpy attention
    and SwiGLU, KV cache included."""
    import halo.compute.linear

    monkeypatch.setattr(halo.compute.linear, "PREFER_C_KERNEL", False)
    c = weights.config
    layout = GroupLayout.for_model(c)
    layer, rotary = weights.layers[1], Rotary(c, MAX_SEQ)
    heads = [1, 4, 5]  # query heads of two KV heads, one of them shared by two local heads
    graph, steps = (AttentionShard(layer, layout, heads, MAX_SEQ, "int8") for _ in range(2))
    steps.graph = None
    steps.qkv.open(), steps.out.open()
    assert graph.graph is not None
    rng = np.random.default_rng(3)
    for pos, t in [(0, 5), (5, 1), (6, 1), (7, 2)]:
        x = rng.standard_normal((t, c.dim)).astype(np.float32)
        assert relative_error(graph.forward(x, pos, rotary), steps.forward(x, pos, rotary)) <= 1e-4
    assert relative_error(graph.cache_k[0, :9], steps.cache_k[0, :9]) <= 1e-5 and not graph.cache_k[0, 9:].any()
    assert relative_error(graph.cache_v[0, :9], steps.cache_v[0, :9]) <= 1e-5

    groups = [0, 2, 3]
    graph, steps = (MlpShard(layer, layout, groups, "int8") for _ in range(2))
    steps.graph = None
    steps.gate_up.open(), steps.down.open()
    x = rng.standard_normal((4, c.dim)).astype(np.float32)
    assert graph.graph is not None
    assert relative_error(graph.forward(x), steps.forward(x)) <= 1e-4


@pytest.mark.parametrize("start_pos, tokens", [(0, 150), (10, 64), (37, 1)])
def test_causal_attention_in_query_chunks_is_the_whole_masked_softmax(start_pos, tokens):
    """A prompt attends 64 queries at a time (QUERY_CHUNK) over only the keys up to each chunk's end: the same as scoring
    every query against every key and masking the later ones (several chunks, a cached prefix, one token)."""
    from halo.compute.neuron_groups import causal_attention

    rng = np.random.default_rng(start_pos + tokens)
    G, r, hd, S = 2, 3, 16, start_pos + tokens + 5  # the cache holds 5 positions past the last query's
    q = rng.standard_normal((G, tokens, r, hd)).astype(np.float32)
    keys = rng.standard_normal((G, hd, S)).astype(np.float32)
    values = rng.standard_normal((G, S, hd)).astype(np.float32)
    got = causal_attention(q, keys, values, start_pos)
    scores = np.einsum("gtrd,gds->gtrs", q.astype(np.float64), keys) / np.sqrt(hd)
    later = np.arange(S)[None, :] > (start_pos + np.arange(tokens))[:, None]
    scores[:, later[:, None, :].repeat(r, axis=1)] = -np.inf
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    want = np.einsum("gtrs,gsd->gtrd", probs / probs.sum(axis=-1, keepdims=True), values)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
