"""The memory-bounded benchmark sizes every mode's limits from the share plus that mode's own runtime memory: HALO's
rows under "share + 10 %" were sized from exact mode's share alone, so on a fresh machine its agents refused the
hello ("the memory left for re-mapped MLP groups holds 0.0 MB of them")."""

from halo.eval.bench_memory_bounded import Sizing


def test_each_mode_gets_its_own_runtime_memory_on_top_of_the_share():
    mb = 1 << 20
    free = {"exact": {"agents": [{"idle_usage_bytes": 60 * mb, "max_usage_bytes": 100 * mb, "peak_rss_bytes": 150 * mb}] * 2,
                      "agents_memory": [{"predictors_bytes": 0}] * 2},
            "halo": {"agents": [{"idle_usage_bytes": 61 * mb, "max_usage_bytes": 180 * mb}] * 2,
                     "agents_memory": [{"predictors_bytes": 30 * mb}, {"predictors_bytes": 28 * mb}]}}
    sizing = Sizing.of(free)
    # exact mode's growth as its cgroup counts it (the weights of the share, its KV cache, buffers), not its resident
    # set's, which holds library pages other cgroups were charged for
    assert sizing.shares == [40 * mb] * 2
    assert sizing.limit("exact", 1.10) == [int(60 * mb + 44 * mb)] * 2
    assert sizing.limit("halo+prepared", 1.10) == [int(60 * mb + 30 * mb + 44 * mb), int(60 * mb + 28 * mb + 44 * mb)]
    lost = {"exact": free["exact"], "halo": {**free["halo"], "agents_memory": None}}  # the status went unanswered
    assert Sizing.of(lost).limit("halo", 1.25) == [int(60 * mb + 50 * mb)] * 2
