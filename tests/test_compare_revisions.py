"""eval/compare_revisions.py: what names a setup, and a base that is no commit refused by name."""

from halo.eval import compare_revisions


def test_a_rows_setup_is_named_by_its_setup_fields_only():
    row = {"run": 3, "agents": 3, "plr": 0.05, "sync": "exact", "tokens": 32, "ms_median": 22.1, "partials": 506,
           "load_s": 2.7, "per_token_ms": {"rounds": 21.8}}
    assert compare_revisions.setup_key(row) == "agents=3, plr=0.05, sync=exact"
    assert compare_revisions.setup_key(dict(row, run=0, partials=1, load_s=9.9)) == compare_revisions.setup_key(row)


def test_a_base_that_is_no_commit_is_refused_by_name(capsys):
    code = compare_revisions.main(["--base", "no-such-revision-here", "--runs", "1", "--", "bench_scaling"])
    assert code == 2 and "no-such-revision-here: not a commit" in capsys.readouterr().err


def test_a_run_reads_the_metric_asked_for(tmp_path, monkeypatch):
    """--metric ms_mean: on a lossy link a token's recoveries are its tail, which the median hides."""
    import json
    import subprocess

    def fake_bench(argv, cwd, env, capture_output, text):
        out = __import__("pathlib").Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.json").write_text(json.dumps({"rows": [{"sync": "halo", "ms_median": 170.0, "ms_mean": 180.0}]}))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(compare_revisions.subprocess, "run", fake_bench)
    assert compare_revisions.run_bench("bench_halo_speed", [], None, tmp_path / "a") == {"sync=halo": [170.0]}
    assert compare_revisions.run_bench("bench_halo_speed", [], None, tmp_path / "b", "ms_mean") == {"sync=halo": [180.0]}
