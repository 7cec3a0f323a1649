"""The fuzzing harness: the committed corpus (seeds and every crash found so far) replays cleanly, every target
survives a short run of the fuzzer, and the harness really reports a crash when there is one."""

import json
import subprocess
import sys
import textwrap

import pytest

from halo.eval.fuzz import run as fuzz_run
from halo.eval.fuzz.targets import TARGETS, Target, run_one


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_corpus_replays_with_domain_errors_only(name):
    """Seeds parse (or fail with the domain error); crash-* files are regressions that must stay fixed."""
    results = fuzz_run.replay(name)
    assert results, f"corpus/{name} has no seed files"
    seeds = [path for path, error in results if path.name.startswith("seed-")]
    assert seeds, f"corpus/{name} needs at least one seed-* file"


def test_every_target_survives_a_short_fuzzing_run(tmp_path):
    """The CI smoke run: about a second per target, two at a time (the full campaign: eval/results/fuzzing.md)."""
    outcomes = fuzz_run.fuzz_many(sorted(TARGETS), seconds=1, workdir=tmp_path, jobs=2)
    failed = {o.target: (o.status, o.crashes, o.log_tail[-1500:]) for o in outcomes if o.status != "ok"}
    assert not failed, failed
    assert all(o.executions > 0 for o in outcomes), [(o.target, o.executions) for o in outcomes]


def test_run_one_returns_domain_errors_and_lets_others_escape():
    def parser(data: bytes):
        if data == b"domain":
            raise ValueError("refused")
        if data == b"bug":
            raise KeyError("bug")

    assert run_one(parser, (ValueError,), b"ok") is None
    assert isinstance(run_one(parser, (ValueError,), b"domain"), ValueError)
    with pytest.raises(KeyError):
        run_one(parser, (ValueError,), b"bug")


PLANTED = """
def planted():
    def parser(data: bytes):
        if len(data) >= 3:
            raise KeyError("planted bug")
        if data:
            raise ValueError("domain error")
    return parser, (ValueError,)
"""


def test_hypothesis_engine_reports_and_shrinks_a_planted_crash(tmp_path, monkeypatch, capsys):
    namespace = {}
    exec(PLANTED, namespace)
    monkeypatch.setitem(TARGETS, "planted", Target("planted", "", namespace["planted"]))
    fuzz_run.hypothesis_worker("planted", seconds=30, runs=None, seed=1, artifacts=tmp_path)
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(fuzz_run.RESULT_PREFIX)][-1]
    result = json.loads(line[len(fuzz_run.RESULT_PREFIX):])
    assert [c["error"] for c in result["crashes"]] == ["KeyError: 'planted bug'"]
    crash = (tmp_path / result["crashes"][0]["file"].rsplit("/", 1)[1]).read_bytes()
    assert crash == b"\x00\x00\x00"  # shrunk to the smallest input that fails


def test_atheris_engine_reports_a_planted_crash(tmp_path):
    pytest.importorskip("atheris", reason="atheris has wheels for Linux x86_64 only; elsewhere hypothesis fuzzes")
    corpus, artifacts = tmp_path / "corpus", tmp_path / "artifacts"
    corpus.mkdir()
    artifacts.mkdir()
    (corpus / "seed").write_bytes(b"AB")
    code = PLANTED + textwrap.dedent("""
        import sys
        from halo.eval.fuzz import run, targets
        targets.target("planted", "")(planted)
        run.atheris_worker("planted", sys.argv[1:])
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(corpus), "-max_total_time=20", "-print_final_stats=1",
                           f"-artifact_prefix={artifacts}/"], capture_output=True, text=True, timeout=120)
    outcome = fuzz_run.parse_atheris("planted", proc.stdout + proc.stderr, 1.0)
    assert outcome.status == "crash", proc.stderr[-2000:]
    crashes = list(artifacts.iterdir())
    assert len(crashes) == 1 and len(crashes[0].read_bytes()) >= 3
    assert fuzz_run._last_error(proc.stdout + proc.stderr) == "KeyError: 'planted bug'"
