"""Tensor-parallel plans: complete, disjoint, within memory; Min-Max vs baselines; device selection vs MILP."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from halo.errors import ConfigError
from halo.scheduler.cost import estimate
from halo.scheduler.objective import eq1_objective
from halo.scheduler.milp import solve_exact
from halo.scheduler.profiles import Cluster, DeviceProfile, model_profile, named_config
from halo.scheduler.ratios import InsufficientMemory
from halo.scheduler.plan import TP_KINDS
from halo.scheduler.tp_plan import build_plan, on_master, plan_everyone, plan_tp

TINY = model_profile(named_config("tinyllama-1.1b"), "int4", "tinyllama", mlp_group_size=512)


def check_plan(plan):
    for kind in TP_KINDS + ("lm_head",):
        block = getattr(plan.model, kind)
        counts = plan.counts[kind]
        assert (counts >= 0).all()
        assert (counts.sum(axis=0) == block.count).all()  # complete
        ranks = plan.priority_ranks(kind)
        for layer in range(ranks.shape[1]):  # disjoint rank ranges covering 0..count
            spans = sorted((a, b) for a, b in ranks[:, layer] if b > a)
            assert spans[0][0] == 0 and spans[-1][1] == block.count
            assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:]))
    if not plan.oom:
        assert (plan.memory_used() <= np.array([d.memory_bytes for d in plan.profiles()]) + 1e-6).all()


@st.composite
def clusters(draw, model=TINY):
    n = draw(st.integers(1, 8))
    memory = [draw(st.integers(3, 63)) * 100e6 for _ in range(n)]
    need = model.total_bytes(512)
    if sum(memory) < need * 1.05:  # "total memory above the model"
        memory[0] += need * 1.05 - sum(memory)
    devices = tuple(DeviceProfile(f"d{i}", memory[i], draw(st.integers(6, 18)) * 0.1 * 2e9,
                                  plr=draw(st.sampled_from([0.0, 0.01, 0.02, 0.05, 0.1])),
                                  bandwidth_bps=draw(st.sampled_from([100e6, 1e9])))
                    for i in range(n))
    return Cluster(devices, context=512, weights="int4")


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_every_plan_is_complete_disjoint_and_within_memory(cluster):
    for algorithm in ("minmax", "greedy", "galaxy", "memory", "vanilla"):
        try:
            plan = build_plan(cluster, TINY, algorithm)
        except InsufficientMemory:
            continue  # integer rounding left no room: a clear error, never a bad plan
        check_plan(plan)
    check_plan(plan_tp(cluster, TINY))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_min_max_is_never_slower_than_galaxy_or_vanilla(cluster):
    try:
        minmax = eq1_objective(build_plan(cluster, TINY, "minmax"))
        galaxy = eq1_objective(build_plan(cluster, TINY, "galaxy"))
    except InsufficientMemory:
        return
    vanilla_plan = build_plan(cluster, TINY, "vanilla")
    assert minmax <= galaxy * (1 + 1e-9)
    if not vanilla_plan.oom:
        assert minmax <= eq1_objective(vanilla_plan) * (1 + 1e-9)
    assert eq1_objective(plan_tp(cluster, TINY)) <= minmax * (1 + 1e-9)  # selection only ever helps


def test_device_selection_leaves_slow_devices_out_on_slow_links():
    devices = (DeviceProfile("fast", 4e9, 20e9, bandwidth_bps=100e6, is_master=True),
               DeviceProfile("slow1", 4e9, 0.5e9, bandwidth_bps=100e6), DeviceProfile("slow2", 4e9, 0.5e9, bandwidth_bps=100e6))
    cluster = Cluster(devices, context=512, weights="int4")
    plan = plan_tp(cluster, TINY)
    assert [d.name for d in plan.profiles()] == ["fast"]
    assert eq1_objective(plan) < eq1_objective(build_plan(cluster, TINY, "minmax"))


def test_exact_milp_is_ground_truth_and_selection_is_close():
    rng = np.random.default_rng(3)
    model = model_profile(named_config("stories260k"), "fp32", "stories", mlp_group_size=32, vocab_group_size=64)
    need = model.total_bytes(64)
    solved = 0
    while solved < 5:
        memory = rng.integers(2, 10, 3) * need / 8
        if memory.sum() < need * 1.1:
            continue
        devices = tuple(DeviceProfile(f"d{i}", float(memory[i]), float(rng.uniform(0.6, 1.8)) * 1e8, bandwidth_bps=1e9)
                        for i in range(3))
        cluster = Cluster(devices, context=64, weights="fp32")
        solved += 1
        exact = solve_exact(cluster, model, time_limit_s=20)
        assert exact.optimal
        heuristics = [eq1_objective(build_plan(cluster, model, a)) for a in ("minmax", "galaxy", "memory")]
        assert exact.objective_s <= min(heuristics) * (1 + 1e-9)
        assert abs(eq1_objective(exact.plan) - exact.objective_s) < 1e-9
        assert eq1_objective(plan_tp(cluster, model)) <= exact.objective_s * 1.02


def test_unfit_cluster_names_the_shortfall():
    cluster = Cluster((DeviceProfile("small", 100e6, 1e9),), context=512, weights="int4")
    with pytest.raises(InsufficientMemory, match="short by"):
        plan_tp(cluster, TINY)


def test_loss_costs_more_over_tcp_than_over_the_fast_path():
    devices = tuple(DeviceProfile(f"d{i}", 2e9, 2e9, plr=0.05, bandwidth_bps=1e9) for i in range(4))
    plan = build_plan(Cluster(devices, context=512, weights="int4"), TINY, "minmax")
    modes = ("tcp", "halo-tcp", "lossy", "halo", "exact", "ideal")
    tcp, halo_tcp, lossy, halo, exact, ideal = (estimate(plan, m).total_s for m in modes)
    assert tcp > halo_tcp > lossy > halo == exact > ideal
    clean = build_plan(Cluster(tuple(DeviceProfile(f"d{i}", 2e9, 2e9, bandwidth_bps=1e9) for i in range(4)),
                               context=512, weights="int4"), TINY, "minmax")
    assert estimate(clean, "tcp").total_s == estimate(clean, "ideal").total_s  # no loss: the mode costs nothing
    assert estimate(clean, "tcp").loss_s == 0


def test_unknown_algorithm_and_sync_mode():
    cluster = Cluster((DeviceProfile("a", 4e9, 1e9),), context=512, weights="int4")
    with pytest.raises(ConfigError, match="unknown algorithm"):
        build_plan(cluster, TINY, "fastest")
    with pytest.raises(ConfigError, match="unknown sync mode"):
        estimate(build_plan(cluster, TINY), "udp")


def test_master_too_small_for_the_embeddings_is_named():
    model = model_profile(named_config("llama-3.1-8b"), "int4")
    devices = (DeviceProfile("tiny-master", 200e6, 1e9, is_master=True), DeviceProfile("big", 8e9, 1e9))
    with pytest.raises(InsufficientMemory, match="make a device with more memory the master"):
        plan_tp(Cluster(devices, context=256, weights="int4"), model)


def test_attention_on_the_master_syncs_once_a_layer_and_fits_its_memory():
    devices = tuple(DeviceProfile(f"d{i}", 2e9, 2e9, bandwidth_bps=1e9, is_master=i == 0) for i in range(4))
    split = build_plan(Cluster(devices, context=512, weights="int4"), TINY, "minmax")
    moved = on_master(split, ("attention",))
    check_plan(moved)
    heads = TINY.attention.count
    assert (moved.counts["attention"][0] == heads).all() and not moved.counts["attention"][1:].any()
    for kind in ("mlp", "lm_head"):  # only the heads move
        assert (moved.counts[kind] == split.counts[kind]).all()
    layers = TINY.n_layers
    assert (split.sync_rounds(), moved.sync_rounds()) == (2 * layers + 1, layers + 1)
    ideal_split, ideal_moved = estimate(split, "ideal"), estimate(moved, "ideal")
    assert ideal_moved.comm_s < ideal_split.comm_s and ideal_moved.compute_s > ideal_split.compute_s
    small = (DeviceProfile("m", split.memory_used()[0] * 1.01, 2e9, bandwidth_bps=1e9, is_master=True), *devices[1:])
    with pytest.raises(InsufficientMemory, match="every attention head"):
        on_master(build_plan(Cluster(small, context=512, weights="int4"), TINY, "minmax"), ("attention",))


def test_the_lm_head_on_the_master_saves_its_round_and_fits_its_memory():
    devices = tuple(DeviceProfile(f"d{i}", 2e9, 2e9, bandwidth_bps=1e9, is_master=i == 0) for i in range(4))
    split = build_plan(Cluster(devices, context=512, weights="int4"), TINY, "minmax")
    moved = on_master(split, ("lm_head",))
    check_plan(moved)
    assert moved.counts["lm_head"][0] == TINY.lm_head.count and not moved.counts["lm_head"][1:].any()
    assert moved.lm_head_on_master and not moved.heads_on_master and not split.lm_head_on_master
    for kind in ("attention", "mlp"):  # only the LM head moves
        assert (moved.counts[kind] == split.counts[kind]).all()
    both = on_master(split, ("attention", "lm_head"))
    layers = TINY.n_layers
    assert (split.sync_rounds(), moved.sync_rounds(), both.sync_rounds()) == (2 * layers + 1, 2 * layers, layers)
    ideal_split, ideal_moved = estimate(split, "ideal"), estimate(moved, "ideal")
    assert ideal_moved.comm_s < ideal_split.comm_s and ideal_moved.compute_s > ideal_split.compute_s
    small = (DeviceProfile("m", split.memory_used()[0] * 1.01, 2e9, bandwidth_bps=1e9, is_master=True), *devices[1:])
    with pytest.raises(InsufficientMemory, match="the whole LM head"):
        on_master(build_plan(Cluster(small, context=512, weights="int4"), TINY, "minmax"), ("lm_head",))
    with pytest.raises(ConfigError, match="only the attention heads and the LM head"):
        on_master(split, ("mlp",))


def test_the_scheduler_keeps_attention_on_the_master_where_rounds_cost_more_than_the_heads():
    """plan_tp prices both placements with the cost model: Wi-Fi latency and a per-message CPU cost make the
    rounds dear (heads go to the master), a slow master beside fast links keeps them split."""
    wifi = tuple(DeviceProfile(f"d{i}", 4e9, 20e9, latency_s=3e-3, bandwidth_bps=300e6, message_s=0.5e-3,
                               is_master=i == 0) for i in range(3))
    plan = plan_tp(Cluster(wifi, context=512, weights="int4"), model_profile(named_config("llama-2-7b"), "int4"),
                   mode="exact")
    assert plan.n == 3 and not plan.counts["attention"][1:].any()
    # its round is dear beside the head's compute on a 20 GFLOP/s master: the master keeps most of the head (balance()
    # leaves the agents what their rounds' latency leaves time for), and no placement the planner weighs is cheaper
    assert plan.counts["lm_head"][0] > 2 * plan.counts["lm_head"][1:].sum()
    assert estimate(plan, "exact").total_s <= estimate(on_master(plan, ("lm_head",)), "exact").total_s
    fast = (DeviceProfile("slow master", 8e9, 1e9, latency_s=1e-5, bandwidth_bps=10e9, is_master=True),
            *(DeviceProfile(f"d{i}", 4e9, 50e9, latency_s=1e-5, bandwidth_bps=10e9) for i in (1, 2)))
    plan = plan_tp(Cluster(fast, context=512, weights="int4"), TINY, mode="exact")
    assert plan.counts["attention"][1:].sum() > 0 and plan.counts["lm_head"][1:].sum() > 0
    # every device kept (--local-agents N): the same choice, nobody left out
    slow_links = tuple(DeviceProfile(f"d{i}", 4e9, 2e9, latency_s=3e-3, message_s=0.5e-3, is_master=i == 0)
                       for i in range(4))
    kept = plan_everyone(Cluster(slow_links, context=512, weights="int4"), TINY, "exact")
    assert kept.n == 4 and kept.heads_on_master and kept.counts["mlp"][1:].all()
    assert plan_everyone(Cluster(fast, context=512, weights="int4"), TINY, "exact").counts["attention"][1:].any()
    assert plan_everyone(Cluster(slow_links, context=512, weights="int4"), TINY).counts["attention"][1:].any()


def test_a_paired_plan_halves_each_layers_mlp_between_the_master_and_one_agent_in_turn():
    """paired (--plan paired-mlp): every layer's MLP groups go half to the master (the larger half) and half to one
    agent, the agents taking the layers round-robin, so an MLP round engages two processes; nothing else moves, the
    plan stays complete and disjoint, and a device that cannot hold its halves is named."""
    from halo.scheduler.tp_plan import paired

    devices = tuple(DeviceProfile(f"d{i}", 2e9, 2e9, bandwidth_bps=1e9, is_master=i == 0) for i in range(4))
    split = on_master(build_plan(Cluster(devices, context=512, weights="int4"), TINY, "minmax"),
                      ("attention", "lm_head"))
    pairs = paired(split)
    check_plan(pairs)
    mlp, total = pairs.counts["mlp"], TINY.mlp.count
    assert (mlp[0] == total - total // 2).all()
    for layer in range(TINY.n_layers):
        holders = np.flatnonzero(mlp[1:, layer]) + 1
        assert holders.tolist() == [1 + layer % 3] and mlp[holders[0], layer] == total // 2
    for kind in ("attention", "lm_head"):
        assert (pairs.counts[kind] == split.counts[kind]).all()
    assert pairs.sync_rounds() == split.sync_rounds() == TINY.n_layers
    quarter = paired(split, agent_share=0.25)  # the agent's part of each layer, the master the rest
    check_plan(quarter)
    assert (quarter.counts["mlp"][1:].sum(axis=0) == total // 4).all() and (quarter.counts["mlp"][0] == total - total // 4).all()
    for share in (0.0, 0.75):
        with pytest.raises(ConfigError, match=r"agent share must be in \(0, 0.5\]"):
            paired(split, agent_share=share)
    alone = build_plan(Cluster(devices[:1], context=512, weights="int4"), TINY, "minmax")
    assert paired(alone) is alone  # no agent to pair with
    with pytest.raises(ConfigError, match="only the per-layer blocks"):
        paired(split, "lm_head")
    small = (DeviceProfile("m", split.memory_used()[0] * 1.01, 2e9, bandwidth_bps=1e9, is_master=True), *devices[1:])
    with pytest.raises(InsufficientMemory, match="'m' would need .* for its part of the mlp of a paired plan"):
        paired(on_master(build_plan(Cluster(small, context=512, weights="int4"), TINY, "minmax"),
                         ("attention", "lm_head")))


def two_pinned_nodes(message_s: float, latency_s: float, bandwidth_bps: float = 3.2e9):
    """Master + one agent of equal compute, as the scaling benchmark's two pinned nodes on loopback (their measured
    profiles there: ~130 GFLOP/s, message 70 us, latency 17 us, 3.2 Gbit/s)."""
    devices = (DeviceProfile("master", 8e9, 130e9, latency_s=0.0, message_s=message_s, bandwidth_bps=bandwidth_bps,
                             is_master=True),
               DeviceProfile("agent", 8e9, 130e9, latency_s=latency_s, message_s=message_s, bandwidth_bps=bandwidth_bps))
    return Cluster(devices, context=256, weights="int4")


def test_balance_gives_the_master_more_of_a_round_by_what_an_agents_partial_waits_for():
    from halo.scheduler.tp_plan import balance

    objective = lambda plan: estimate(plan, "exact").total_s  # noqa: E731
    even = on_master(build_plan(two_pinned_nodes(70e-6, 17e-6), TINY, "minmax", prune=False), ("attention",))
    mlp = even.counts["mlp"]
    assert abs(int(mlp[0].sum()) - int(mlp[1].sum())) <= 1  # the ratio algorithm balances compute alone
    balanced = balance(even, objective)
    check_plan(balanced)
    assert (balanced.counts["mlp"][0] > balanced.counts["mlp"][1]).all()  # the master's share is larger ...
    assert objective(balanced) < objective(even)  # ... and the cost model prices the token lower
    assert balanced.whole_on_master("attention")  # what was kept whole on the master stays there
    free = on_master(build_plan(two_pinned_nodes(0.0, 0.0, 1e18), TINY, "minmax", prune=False), ("attention",))
    assert np.array_equal(balance(free, objective).counts["mlp"], free.counts["mlp"])  # rounds cost nothing: no move


def test_the_planner_balances_the_plan_it_picks_where_devices_have_cores_of_their_own():
    cluster = two_pinned_nodes(70e-6, 17e-6)
    plan = plan_tp(cluster, TINY, mode="exact")
    split = [kind for kind in TP_KINDS if not plan.whole_on_master(kind)]
    assert split and all(plan.counts[kind][0].sum() > plan.counts[kind][1].sum() for kind in split)
    everyone = plan_everyone(cluster, TINY, "exact")  # --local-agents: cores shared, left as the ratios say
    assert all(abs(int(everyone.counts[k][0].sum()) - int(everyone.counts[k][1].sum())) <= 1
               for k in TP_KINDS if not everyone.whole_on_master(k))
