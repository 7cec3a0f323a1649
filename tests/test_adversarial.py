"""Replayed, forged, random and truncated datagrams from another address during an exact-mode generation."""

import pytest

from halo.eval.adversarial import attacked_generation


@pytest.mark.slow
def test_a_flood_of_replays_and_garbage_changes_nothing_and_is_counted(known_answer):
    result = attacked_generation("exact", n_agents=2, datagrams=20_000, rate=5_000)
    flood = result["flood"]
    assert flood["sent"] == 20_000 and flood["rate_per_s"] >= 1_000
    assert result["text_equals_single_process"] and result["tokens"] == 256
    assert flood["received_by_flooder"] == 0  # no agent and not the master ever answered the flooder
    refused = dict(result["rejected_by_master"])
    for agent in result["rejected_by_agents"]:
        for reason, count in agent.items():
            refused[reason] = refused.get(reason, 0) + count
    assert refused.get("replayed", 0) > 0 and refused.get("bad_tag", 0) > 0 and refused.get("truncated", 0) > 0
    assert sum(refused.values()) >= 0.9 * flood["sent"]  # (a few random ones may fail on other checks first)
