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


def test_the_big_model_report_compares_each_cluster_row_with_the_single_process():
    """bench_big_model's table: load, first token, ms/token against the same run's single process, the cgroup peaks
    against their limits, OOM kills of any node, and whether the tokens are the single process's."""
    from argparse import Namespace

    from halo.eval.bench_big_model import render

    mb = 1 << 20
    args = Namespace(model="/m/llama.gguf", agents=3, limit_mb=1600, master_limit_mb=1600, tokens=16, weights="native",
                     modes="exact", argv=["--model", "/m/llama.gguf"])
    single = {"setup": "single process, unlimited", "plr": 0.0, "ms_median": 120.0, "load_s": 20.0,
              "prefill_ms": 90e3, "prompt_tokens": 512, "generated": [5, 6]}
    cluster = {"setup": "master + 3 agents, exact", "plr": 0.05, "ms_median": 132.0, "load_s": 30.0, "prefill_ms": 60e3,
               "generated": [5, 6], "partials_dropped": 0, "partials": 99,
               "agents": [{"max_usage_bytes": 1200 * mb, "oom_kills": 0}] * 2 + [{"max_usage_bytes": 1300 * mb,
                                                                                  "oom_kills": 1}],
               "master": {"max_usage_bytes": 1100 * mb, "limit_bytes": 1600 * mb, "oom_kills": 0}}
    failed = {"setup": "master + 3 agents, exact", "plr": 0.0, "error": "agent-2 refused hello"}
    text = "\n".join(render([single, {**cluster, "generated": [5, 7]}, failed], args))
    assert "| master + 3 agents, exact | 5% | 30.0 | 60.0 | 132.0 | 1.10x | 1300 / 1600 | 1100 / 1600 | 1 | 0 of 99 | no |" in text
    assert "| single process, unlimited | 0% | 20.0 | 90.0 | 120.0 | 1.00x | - | - | 0 | - | yes |" in text
    assert "| failed: agent-2 refused hello | | | | | | 0 | | |" in text and "512-token prompt" in text
    assert "sync exact;" in text and "untrained predictors" not in text
    args.modes = "exact,halo+prepared"
    assert "untrained predictors" in "\n".join(render([single, cluster], args))
