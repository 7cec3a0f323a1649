"""The round-parts benchmark runs the product's endpoints through one exact round and reports every step."""

import json

from halo.eval import bench_round_parts


def test_every_step_of_a_round_is_timed_and_reported(tmp_path):
    assert bench_round_parts.main(["--dim", "256", "--rounds", "20", "--out", str(tmp_path), "--name", "parts"]) == 0
    result = json.loads((tmp_path / "parts.json").read_text())
    assert list(result["steps_us"]) == list(bench_round_parts.STEPS)
    assert all(us > 0 for us in result["steps_us"].values()) and result["pack_and_tag_one_vector_us"] > 0
    assert result["datagrams_per_vector"] == 1  # 256 + 8 values fit one datagram
    table = (tmp_path / "parts.md").read_text()
    assert "| master: gather the partial |" in table and "**a round**" in table and result["host"]["cpu"] in table
