"""The bounded cache of built MLP groups (HALO mode under a memory budget): what it keeps, what it counts, and
that a device computing from it gives what one holding every group gives."""

import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from halo.errors import ConfigError
from halo.group_cache import GroupCache
from halo.neuron_groups import GroupLayout
from halo.remap import Remapper


@dataclass
class Built:
    key: tuple
    nbytes: int = 10


def test_the_cache_keeps_the_most_recently_used_groups_within_its_capacity():
    cache = GroupCache(capacity_bytes=30)
    built = []

    def build(key):
        built.append(key)
        return Built(key)

    cache.filling = False
    for key in [(0, 0), (0, 1), (0, 2), (0, 0), (0, 3)]:  # (0, 0) used again: (0, 1) is the least recent
        assert cache.get(key, lambda key=key: build(key)).key == key
    assert (0, 1) not in cache and all(k in cache for k in [(0, 0), (0, 2), (0, 3)])
    assert cache.held_bytes == 30 and len(cache) == 3
    assert built == [(0, 0), (0, 1), (0, 2), (0, 3)]
    s = cache.stats
    assert (s.hits, s.stalls, s.prefetched, s.evicted, s.built_bytes) == (1, 4, 0, 1, 40)
    cache.get((0, 1), lambda: build((0, 1)), ahead=True)
    assert cache.stats.prefetched == 1 and cache.stats.evicted == 2


def test_a_group_being_built_is_waited_for_not_built_twice():
    cache = GroupCache(capacity_bytes=None)
    started, builds = threading.Event(), []

    def slow():
        builds.append(1)
        started.set()
        time.sleep(0.2)
        return Built((1, 1))

    loader = threading.Thread(target=lambda: cache.get((1, 1), slow, ahead=True))
    loader.start()
    started.wait(5)
    assert cache.get((1, 1), slow).key == (1, 1)  # the computation waits for the load thread's build
    loader.join(5)
    assert builds == [1] and cache.stats.stall_ms >= 100


def ranked_tokens(layout, layers, tokens, seed):
    rng = np.random.default_rng(seed)
    return [{l: rng.permutation(layout.n_mlp_groups)[None, :] for l in layers} for _ in range(tokens)]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_bounded_device_computes_what_an_unbounded_one_does(stories_weights, overlap):
    """A device whose built groups are capped (two layers' worth of its ranks, a fraction of every candidate) gives
    the same partial sums token after token as one holding every candidate group; what it had to build again is
    counted, and it never holds more than its capacity."""
    c = stories_weights.config
    layout = GroupLayout.for_model(c)
    ranges = {l: (2, 5) for l in range(c.n_layers)}
    full = Remapper(stories_weights, layout, ranges, fmt="int8")
    group_bytes = full.cache.held_bytes // len(full.cache)
    capacity = 7 * group_bytes  # two layers of 3 ranks and one group more: less than the 15 groups of its ranks
    bounded = Remapper(stories_weights, layout, ranges, fmt="int8", cache_bytes=capacity, load_overlap=overlap)
    assert len(full.cache) == c.n_layers * layout.n_mlp_groups and 6 <= len(bounded.cache) <= 7
    rng = np.random.default_rng(0)
    for rankings in ranked_tokens(layout, ranges, 6, seed=1):
        for remapper in (full, bounded):
            remapper.begin()
            remapper.rankings.update(rankings)
        x = rng.standard_normal((1, c.dim)).astype(np.float32)
        for l in ranges:
            if overlap:  # as the worker does: the next layer's groups load while this one computes
                bounded.loading[l] = bounded.pool.submit(bounded._load, l)
            np.testing.assert_array_equal(bounded.mlp_partial(l, x), full.mlp_partial(l, x))
            assert bounded.cache.held_bytes <= capacity
    stats = bounded.report()["group_cache"]
    assert stats["prefetched" if overlap else "stalls"] > 0 and stats["evicted"] > 0 and stats["built_bytes"] > 0
    assert stats["capacity_bytes"] == capacity and full.report()["group_cache"]["capacity_bytes"] is None
    assert full.cache.stats.stalls == 0 and full.cache.stats.evicted == 0
    for r in (full, bounded):
        r.close()


def test_a_cache_smaller_than_two_layers_of_ranks_is_refused(stories_weights):
    layout = GroupLayout.for_model(stories_weights.config)
    with pytest.raises(ConfigError, match=r"less than two layers of this share's groups .* fewer MLP ranks or more memory"):
        Remapper(stories_weights, layout, {0: (0, 4), 1: (0, 4)}, fmt="int8", cache_bytes=1000)


def test_an_agent_under_a_memory_budget_keeps_a_bounded_cache_and_the_same_tokens(stories_weights):
    """halo-agent --memory-budget: in HALO mode (halo-tcp: reliable, so the tokens are deterministic) with int8
    weights, an agent whose budget cannot hold every candidate MLP group keeps what it allows, builds the rest
    when rankings need them (its status says how many and how long) and gives the tokens of unbounded agents."""
    from halo.distributed import LocalCluster, cluster_model
    from halo.distributed.remote import ask_status
    from halo.sync import SyncSettings

    def run(extra):
        with LocalCluster(2, extra_args=extra) as cluster:
            model = cluster_model(stories_weights, cluster.endpoints, cluster.key, context=64, fmt="int8",
                                  sync=SyncSettings(mode="halo-tcp"))
            logits, tokens = model.forward([1]), []
            for _ in range(12):
                tokens.append(int(np.argmax(logits)))
                logits = model.forward([tokens[-1]])
            memory = [s["memory"] for s in ask_status(cluster.endpoints, cluster.key).values()]
            model.close()
            return tokens, memory

    free_tokens, free = run(())
    bounded_tokens, bounded = run(("--memory-budget", "0.2"))
    assert bounded_tokens == free_tokens
    for unbounded, memory in zip(free, bounded):
        cache = memory["group_cache"]
        assert unbounded["group_cache"]["capacity_bytes"] is None and unbounded["group_cache"]["stalls"] == 0
        assert 0 < cache["held_bytes"] <= cache["capacity_bytes"] < unbounded["group_cache"]["held_bytes"]
        assert cache["prefetched"] + cache["stalls"] > 0 and cache["built_bytes"] > 0
        assert memory["weights_bytes"] < unbounded["weights_bytes"]
