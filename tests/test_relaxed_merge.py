"""The relaxed-merge simulation behind the HALO accuracy study (eval/accuracy_halo.py)."""

import numpy as np

from halo.compute.tracing import TracingTransformer
from halo.compute.transformer import Transformer
from halo.eval.accuracy_halo import RelaxedMerge


def test_no_loss_policy_is_the_reference(stories_weights):
    model = Transformer(stories_weights)
    ids = [1, 403, 407, 261, 378, 300, 301]
    expected = model.forward(ids, all_logits=True)
    traced = TracingTransformer(stories_weights, merge=RelaxedMerge("none", 0.5, 4, 0))
    got = traced.forward(ids, all_logits=True)
    assert len(traced.trace) == stories_weights.config.n_layers
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_drops_follow_plr_and_the_oracle_policies_order_what_is_lost():
    rng = np.random.default_rng(0)
    groups = rng.standard_normal((4000, 8, 16)).astype(np.float32) * np.arange(1, 9)[None, :, None]
    full = groups.sum(1)
    errors = {}
    for policy in ("oracle-low", "random", "oracle-high"):
        merge = RelaxedMerge(policy, 0.1, 4, seed=1)
        out = merge(3, "mlp", groups, np.zeros((4000, 64), np.float32))
        assert abs(merge.dropped / merge.offered - 0.1 * 3 / 4) < 0.01  # 3 of 4 devices lossy, 10 % each
        errors[policy] = float(np.linalg.norm(out - full))
    assert errors["oracle-low"] < errors["random"] < errors["oracle-high"]


def test_layer_zero_is_always_reliable():
    groups = np.ones((10, 8, 4), np.float32)
    merge = RelaxedMerge("random", 0.9, 8, seed=0)
    np.testing.assert_array_equal(merge(0, "attention", groups, np.zeros((10, 64), np.float32)), groups.sum(1))
