"""The batched-pass benchmark runs end to end on the bundled model and reports every plan, row count and phase."""

import json

from halo.eval import bench_batch_pass
from halo import BUNDLED_MODEL


def test_each_plan_and_row_count_is_timed_with_where_the_pass_went(tmp_path):
    assert bench_batch_pass.main(["--model", str(BUNDLED_MODEL), "--agents", "1", "--plans", "paired-mlp",
                                  "--paired-shares", "0.5,0.25", "--rows", "1,3", "--seconds", "0.05",
                                  "--out", str(tmp_path), "--name", "bp"]) == 0
    result = json.loads((tmp_path / "bp.json").read_text())
    seen = {(r["plan"], r["rows"]) for r in result["passes"]}
    assert seen == {(plan, rows) for plan in ("one process", "paired-mlp", "paired-mlp, agent 25 %") for rows in (1, 3)}
    cluster = [r for r in result["passes"] if r["plan"].startswith("paired-mlp")]
    assert all(r["ms_per_pass"] > 0 and r["own_compute"] > 0 and r["slowest_agent_compute"] > 0 for r in cluster)
    # the phases are of the timed passes alone (not the warm-up's): they fit inside the pass they are a part of
    assert all(r["own_compute"] + r["send"] + r["sync_wait"] <= r["ms_per_pass"] + 0.02 for r in cluster)
    assert all(us > 0 for us in result["sampling_us"].values()) and len(result["sampling_us"]) == 2
    table = (tmp_path / "bp.md").read_text()
    assert "| paired-mlp | 3 |" in table and "| paired-mlp, agent 25 % | 3 |" in table and result["host"]["cpu"] in table


def test_arguments_it_cannot_use_are_refused_before_anything_runs(tmp_path):
    """--rows 1,x was a traceback, --rows 2,4 put nan in every batch gain, --plans bogus failed after the one-process
    pass, --paired-shares without paired-mlp was ignored."""
    import pytest

    for extra, said in ((["--rows", "1,x"], "comma-separated numbers"), (["--rows", "2,4"], "1 among them"),
                        (["--plans", "bogus"], "bogus is no keyword plan"),
                        (["--plans", "even-mlp-only", "--paired-shares", "0.25"], "is for --plans paired-mlp")):
        with pytest.raises(SystemExit, match=said):
            bench_batch_pass.main(["--model", str(BUNDLED_MODEL), "--out", str(tmp_path), *extra])
