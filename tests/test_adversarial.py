"""Replayed, forged, random and truncated datagrams from another address during an exact-mode generation."""

import json

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


def test_hostile_http_clients_do_not_tear_the_cluster_down_or_change_a_stream(tmp_path):
    """python -m halo.eval.adversarial --http, small: every bad kind of request is answered with its 4xx, the
    streamed text is the unattacked run's, /health stays ok."""
    from halo.eval import adversarial

    assert adversarial.main(["--http", "--requests", "130", "--concurrency", "8", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "adversarial_http.json").read_text())
    assert result["rebuilds"] == 0 and set(result["health"]["states"]) == {"ok"}
    assert result["streams"] >= 1 and result["streams_equal_unattacked"] == result["streams"] - sum(
        result["streams_refused"].values())
    expected = {"malformed json": "400", "seed -1": "400", "2 MB body, declared": "413",
                "text/plain from a foreign Origin": "415", "foreign Host (rebinding)": "403"}
    for kind, code in expected.items():
        assert set(result["statuses"][kind]) == {code}, (kind, result["statuses"][kind])
    assert result["chunked_oversize"] == [413] * 5
