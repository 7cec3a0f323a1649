"""Sticky re-plans (scheduler/sticky.py spread_lost / take_back, DeviceWorker reuse): after a loss the survivors keep
their groups and the kernels built for them and split the lost device's groups; a returning device takes its own
back. KV refills (survive.py InputLog, DeviceWorker.fill): a new assignment's caches from the recorded residual
stream. The survive tests (tests/test_survive.py) check both through a running cluster."""

from dataclasses import replace

import numpy as np
import pytest

from halo.compute.neuron_groups import GroupLayout
from halo.compute.shares import Block, shares_from_plan
from halo.compute.worker import STEPWISE_TOKENS, DeviceWorker, PiecedShard
from halo.distributed.survive import InputLog
from halo.model.ops import rmsnorm
from halo.scheduler.even import even_plan
from halo.scheduler.sticky import spread_lost, take_back

KINDS = ("attention", "mlp")


def layout_of(weights) -> GroupLayout:
    return replace(GroupLayout.for_model(weights.config), vocab_group_size=64)  # 8 vocabulary groups: the LM head splits


def even_shares(weights, layout, n):
    return shares_from_plan(even_plan(weights, layout, n), weights.config.n_layers)


def holders(shares, kind, layer):
    return sorted(g for s in shares for g in (s.lm_head if kind == "lm_head" else getattr(s, kind)[layer]))


def test_a_loss_spreads_only_the_lost_groups_and_a_return_takes_them_back(stories_weights):
    layout = layout_of(stories_weights)
    before = even_shares(stories_weights, layout, 4)
    survivors = [before[0], before[1], before[3]]
    after = spread_lost(survivors, [before[2]])
    n_layers = stories_weights.config.n_layers
    for kind in KINDS:
        for layer in range(n_layers):
            assert holders(after, kind, layer) == holders(before, kind, layer)  # every group exactly once
            for old, new in zip(survivors, after):
                assert set(getattr(old, kind)[layer]) <= set(getattr(new, kind)[layer])
    assert holders(after, "lm_head", 0) == holders(before, "lm_head", 0)
    # the lost share is split evenly: over all blocks no survivor takes more than one group above another
    gained = [sum(len(getattr(n, k)[l]) - len(getattr(o, k)[l]) for k in KINDS for l in range(n_layers))
              for o, n in zip(survivors, after)]
    assert max(gained) - min(gained) <= 1 and sum(gained) == sum(len(g) for k in KINDS for g in getattr(before[2], k))
    back = take_back(after, before[2])
    assert [s.to_json() for s in back] == [s.to_json() for s in survivors]


def test_a_device_without_groups_takes_none_unless_nobody_has_any(stories_weights):
    layout = layout_of(stories_weights)
    shares = even_shares(stories_weights, layout, 2)
    empty = replace(shares[1], attention=[[] for _ in shares[1].attention], mlp=[[] for _ in shares[1].mlp], lm_head=[])
    after = spread_lost([shares[0], empty], [shares[1]])
    assert after[1].to_json() == empty.to_json()
    with pytest.raises(Exception, match="no device is left"):
        spread_lost([], [shares[1]])


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_a_worker_keeps_the_shards_of_the_groups_it_keeps_and_computes_what_a_fresh_one_does(stories_weights, fmt):
    layout = layout_of(stories_weights)
    c = stories_weights.config
    before = even_shares(stories_weights, layout, 4)
    lost = next(j for j in (1, 2, 3) if before[j].lm_head)  # a device whose LM-head groups the others take
    survivors = [s for j, s in enumerate(before) if j != lost]
    after = spread_lost(survivors, [before[lost]])
    gains_head = next(j for j, (o, n) in enumerate(zip(survivors, after)) if n.lm_head != o.lm_head and o.lm_head)
    old = DeviceWorker(stories_weights, layout, survivors[gains_head], 32, fmt)
    x = np.random.default_rng(0).standard_normal((3, c.dim)).astype(np.float32)
    for l in old.attention:
        old.compute(Block("attention", l), x, 0)  # a used worker: its KV caches hold a history
    kept = DeviceWorker(stories_weights, layout, after[gains_head], 32, fmt, reuse=old)
    fresh = DeviceWorker(stories_weights, layout, after[gains_head], 32, fmt)
    assert kept.reused_groups == sum(map(len, old.share.attention + old.share.mlp)) + len(old.share.lm_head)
    assert fresh.reused_groups == 0
    for l, shard in old.attention.items():  # the very same kernels, in the new worker
        new = kept.attention[l]
        assert new is shard or (isinstance(new, PiecedShard) and new.pieces[0] is shard)
    assert isinstance(kept.lm_head, PiecedShard)
    assert np.array_equal(kept.lm_head.token_ids, fresh.lm_head.token_ids)
    # int8 quantizes W_o / W_down per block of a shard's own columns: other cuts, other roundings (~0.5 %)
    tolerance = 1e-4 if fmt == "fp32" else 2e-2
    blocks = [Block(k, l) for k in KINDS for l in range(c.n_layers)] + [Block("lm_head", c.n_layers)]
    for block in blocks:
        if fresh.holds(block):
            a, b = kept.compute(block, x, 0), fresh.compute(block, x, 0)
            assert np.abs(a - b).max() <= tolerance * np.abs(b).max(), block


def test_a_worker_with_other_settings_builds_everything(stories_weights):
    layout = layout_of(stories_weights)
    share = even_shares(stories_weights, layout, 2)[0]
    old = DeviceWorker(stories_weights, layout, share, 32, "fp32")
    assert DeviceWorker(stories_weights, layout, share, 64, "fp32", reuse=old).reused_groups == 0  # another context
    assert DeviceWorker(stories_weights, layout, share, 32, "int8", reuse=old).reused_groups == 0  # another format


@pytest.mark.parametrize("fmt", ["fp32", "int8"])  # int8: the one-graph blocks fill through their graph
def test_a_fill_writes_the_kv_cache_a_forward_pass_writes(stories_weights, fmt):
    c = stories_weights.config
    layout = layout_of(stories_weights)
    share = even_shares(stories_weights, layout, 2)[1]
    ran, filled = (DeviceWorker(stories_weights, layout, share, 32, fmt) for _ in range(2))
    # a prompt's pass, longer than a verification pass (worker.STEPWISE_TOKENS): fp32 takes the whole-pass kernels, int8
    # halo's C step (every position a decode step's bits), which a fill writes through too
    n = STEPWISE_TOKENS + 3
    x = np.random.default_rng(1).standard_normal((n, c.dim)).astype(np.float32)
    for layer in ran.attention:
        ran.compute(Block("attention", layer), x, 0)
        filled.fill(layer, x)
        a, b = ran.attention[layer], filled.attention[layer]
        assert np.array_equal(a.cache_k, b.cache_k) and np.array_equal(a.cache_v, b.cache_v)
        assert np.abs(b.cache_k[0, :n]).max() > 0 and not b.cache_k[0, n:].any()
    y = rmsnorm(x, stories_weights.layers[0].attn_norm, c.norm_eps)[:1]  # the next position reads the filled cache
    np.testing.assert_array_equal(ran.attention[0].forward(y, n, ran.rotary), filled.attention[0].forward(y, n, filled.rotary))


def test_the_input_log_keeps_what_fits_and_says_when_it_cannot_serve():
    log = InputLog(n_layers=2, dim=4, context=100, max_bytes=2 * 4 * 4 * 10)  # room for 10 positions
    assert log.max_positions == 10 and log.window(1) is None
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for layer in range(2):
        log.record(layer, 0, x + layer)
    log.record(0, 3, x[:1])
    log.record(1, 3, x[:1])
    assert np.array_equal(log.window(3)[1], x + 1) and log.window(4).shape == (2, 4, 4)
    log.record(0, 9, np.ones((2, 4), np.float32))  # beyond the budget: not kept
    assert log.window(11) is None and log.inputs.shape[1] <= 10


def test_an_agent_keeps_the_kernels_of_a_session_a_replan_ends_and_frees_a_finished_one(stories_weights):
    import time

    from halo.distributed import LocalCluster, cluster_model
    from halo.distributed.remote import ask_status

    def retained(cluster, want_positive: bool) -> int:
        deadline = time.monotonic() + 5.0
        while True:  # the bye and the status request travel on different sockets: wait for the bye
            status = ask_status(cluster.endpoints, cluster.key)[cluster.endpoints[0]]
            retained = status["memory"]["retained_bytes"]
            if status["session"] is None and (retained > 0) == want_positive or time.monotonic() > deadline:
                return retained
            time.sleep(0.05)

    with LocalCluster(1) as cluster:
        model = cluster_model(stories_weights, cluster.endpoints, cluster.key, plan="even", context=64)
        model.forward([1, 2, 3])
        model.close(retain=True)  # what a re-plan does
        assert retained(cluster, True) > 0
        again = cluster_model(stories_weights, cluster.endpoints, cluster.key, plan="even", context=64)
        assert again.agents[1].kept_groups > 0
        again.close()  # the end of a generation
        assert retained(cluster, False) == 0


def test_an_agent_refuses_a_share_over_its_memory_budget_with_the_numbers(stories_weights):
    """halo-agent --memory-budget MB: a share whose weights and KV cache need more is refused at hello; status says
    the budget and what the agent holds."""
    from halo.distributed import LocalCluster, cluster_model
    from halo.distributed.remote import ask_status
    from halo.errors import HaloError

    with LocalCluster(1, extra_args=("--memory-budget", "0.05")) as cluster:  # 50 kB: half of stories260K is ~0.5 MB
        with pytest.raises(HaloError, match=r"the share needs [\d.]+ MB \(weights [\d.]+ MB in fp32, KV cache [\d.]+ MB "
                                            r"for 64 positions x 1 slot\(s\)\) but this agent's memory budget is 0\.1 MB"):
            cluster_model(stories_weights, cluster.endpoints, cluster.key, plan="even", context=64)
        memory = ask_status(cluster.endpoints, cluster.key)[cluster.endpoints[0]]["memory"]
        assert memory["budget_bytes"] == 50_000 and memory["weights_bytes"] == 0 and memory["rss_bytes"] > 0


def test_a_halo_share_needs_only_two_layers_of_its_mlp_groups_within_the_budget(stories_weights):
    """HALO mode with compact weights streams a device's MLP groups through a bounded cache (read again from storage
    when evicted), so the hello's budget check counts two layers of its ranks, not all of them: a budget that holds
    the rest and two layers' groups accepts the share, exact mode (every group held) refuses it."""
    from types import SimpleNamespace

    from halo.compute.group_cache import minimum_capacity
    from halo.compute.neuron_groups import GroupLayout
    from halo.compute.shares import Shares, share_memory
    from halo.edge_agent.agent import Agent
    from halo.errors import HaloError

    c = stories_weights.config
    layout = GroupLayout.for_model(c)
    share = Shares([[0, 1]] * c.n_layers, [[2, 3, 4]] * c.n_layers, [0])
    weights, cache = share_memory(share, layout, stories_weights, "int8", 64)
    mlp = share_memory(Shares([[]] * c.n_layers, share.mlp, []), layout, stories_weights, "int8", 64, 0)[0]
    streamed = weights - mlp + minimum_capacity(mlp // c.n_layers) + cache
    agent = SimpleNamespace(weights=stories_weights, memory_budget=streamed + 100)
    Agent._check_budget(agent, share, layout, 64, "int8", 1, streams=True)
    with pytest.raises(HaloError, match="the share needs"):
        Agent._check_budget(agent, share, layout, 64, "int8", 1, streams=False)
    agent.memory_budget = streamed - 100
    with pytest.raises(HaloError, match="the share needs"):
        Agent._check_budget(agent, share, layout, 64, "int8", 1, streams=True)
