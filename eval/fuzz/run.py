"""Run fuzz targets for a set time or number of executions, one worker process per target.

Engines: `atheris` (coverage-guided libFuzzer over instrumented Python, where its wheel installs: Linux
x86_64) and `hypothesis` (random mutations of the seed corpus, shrunk on failure; no coverage), chosen
by `--engine auto`. Every worker runs under an address-space limit, so a parser that allocates without
bound fails with MemoryError (reported as a crash) instead of exhausting the machine, and libFuzzer's
per-input timeout reports hangs. Crashing inputs land in the artifacts folder; commit each one to
corpus/NAME/ together with the fix and a regression test.

    python -m halo.eval.fuzz --list
    python -m halo.eval.fuzz --target wire --seconds 60
    python -m halo.eval.fuzz --all --runs 1000000 --seconds 3600 --report      # the campaign
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from halo.eval.fuzz.targets import TARGETS, Target, run_one
from halo.runtime.local import module_command

RESULT_PREFIX = "HALO-FUZZ-RESULT "
SCRATCH = Path(__file__).resolve().parents[1] / "results" / "_scratch" / "fuzz"
#: keep workers single-threaded: the fuzzed code is single-threaded and the machine is shared
QUIET_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                 "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Outcome:
    target: str
    engine: str
    executions: int = 0
    seconds: float = 0.0
    coverage: int | None = None  # libFuzzer "cov": instrumented edges reached
    features: int | None = None  # libFuzzer "ft"
    corpus: int | None = None  # inputs in the working corpus at the end
    peak_rss_mb: int | None = None
    status: str = "ok"  # ok, crash, timeout, oom, error
    crashes: list[dict] = field(default_factory=list)  # {"file": ..., "error": ...}
    log_tail: str = ""

    @property
    def exec_per_s(self) -> float:
        return self.executions / self.seconds if self.seconds else 0.0


def available_engine() -> str:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return "hypothesis"
    return "atheris"


def seed_inputs(target: Target) -> list[Path]:
    return sorted(p for p in target.seeds.glob("*") if p.is_file()) if target.seeds.is_dir() else []


def replay(name: str, paths: list[Path] | None = None) -> list[tuple[Path, BaseException | None]]:
    """Run the seed corpus (or `paths`) through a target in this process; non-domain errors propagate."""
    target = TARGETS[name]
    one_input, allowed = target.build()
    return [(p, run_one(one_input, allowed, p.read_bytes())) for p in (paths or seed_inputs(target))]


# ---- the parent: one worker per target -----------------------------------------------------------------------
def fuzz(name: str, seconds: float, runs: int | None = None, engine: str = "auto", workdir: Path | None = None,
         memory_mb: int = 4096, timeout_s: int = 10, seed: int = 1) -> Outcome:
    """Fuzz one target in a worker process; returns what it did and found."""
    engine = available_engine() if engine == "auto" else engine
    target = TARGETS[name]
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"halo-fuzz-{name}-"))
    corpus, artifacts = workdir / "corpus", workdir / "artifacts"
    corpus.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    argv = [*module_command("halo.eval.fuzz"), "--worker", name, "--engine", engine, "--memory-mb", str(memory_mb),
            "--seconds", str(seconds), "--seed", str(seed), "--workdir", str(workdir)]
    if runs:
        argv += ["--runs", str(runs)]
    if engine == "atheris":
        argv += ["--", str(corpus), *([str(target.seeds)] if target.seeds.is_dir() else []),
                 f"-max_total_time={max(1, round(seconds))}", f"-timeout={timeout_s}", "-print_final_stats=1",
                 f"-artifact_prefix={artifacts}/", f"-max_len={target.max_len}", f"-seed={seed}",
                 f"-rss_limit_mb={memory_mb}", "-use_value_profile=1", *([f"-runs={runs}"] if runs else [])]
        if target.dictionary:
            dictionary = workdir / "dictionary"
            dictionary.write_text("".join(f'"{_libfuzzer_escape(token)}"\n' for token in target.dictionary))
            argv.append(f"-dict={dictionary}")
    earlier = set(artifacts.iterdir())  # crashes of earlier runs in a reused workdir are not this run's
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace",
                              env={**os.environ, **QUIET_THREADS}, timeout=seconds + 120 + 2 * timeout_s)
        log, returncode = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # a hang the worker could not report itself (the hypothesis engine)
        log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        log, returncode = log + "\nERROR: the worker hung past its time budget", None
    elapsed = time.monotonic() - started
    (workdir / "log.txt").write_text(log)
    outcome = parse_atheris(name, log, elapsed) if engine == "atheris" else parse_hypothesis(name, log, elapsed)
    if returncode is None:
        outcome.status = "timeout"
    elif returncode != 0 and outcome.status == "ok":
        outcome.status = "error"
    outcome.crashes += [{"file": str(p), "error": _last_error(log)} for p in sorted(set(artifacts.iterdir()) - earlier)
                        if str(p) not in {c["file"] for c in outcome.crashes}]
    if outcome.crashes and outcome.status == "ok":
        outcome.status = "crash"
    if outcome.status != "ok":
        outcome.log_tail = log[-4000:]
    return outcome


def _libfuzzer_escape(token: bytes) -> str:
    return "".join(chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\x{b:02x}" for b in token)


def _last_error(log: str) -> str:
    """The exception line of the last Python traceback in a worker's log (or libFuzzer's error line)."""
    lines = log.splitlines()
    for i in range(len(lines) - 2, -1, -1):
        if "Uncaught Python exception" in lines[i]:  # atheris: the exception line comes next
            return lines[i + 1][:300]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback"):
            tail = [ln for ln in lines[i + 1:] if ln and not ln.startswith((" ", "\t"))]
            return tail[0][:300] if tail else ""
    errors = [ln for ln in lines if "ERROR: libFuzzer" in ln]
    return errors[-1].split("ERROR: ", 1)[1] if errors else ""


def _stat(log: str, name: str) -> int | None:
    match = re.search(rf"stat::{name}:\s*(\d+)", log)
    return int(match.group(1)) if match else None


def parse_atheris(name: str, log: str, elapsed: float) -> Outcome:
    outcome = Outcome(name, "atheris", seconds=elapsed)
    outcome.executions = _stat(log, "number_of_executed_units") or 0
    outcome.peak_rss_mb = _stat(log, "peak_rss_mb")
    progress = re.findall(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/", log, re.M)
    if progress:
        runs, cov, ft, corp = map(int, progress[-1])
        outcome.executions = outcome.executions or runs
        outcome.coverage, outcome.features, outcome.corpus = cov, ft, corp
    if "ERROR: libFuzzer: timeout" in log:
        outcome.status = "timeout"
    elif "ERROR: libFuzzer: out-of-memory" in log or "MemoryError" in log:
        outcome.status = "oom"
    elif "Uncaught Python exception" in log or "ERROR: libFuzzer" in log:
        outcome.status = "crash"
    return outcome


def parse_hypothesis(name: str, log: str, elapsed: float) -> Outcome:
    lines = [ln for ln in log.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        return Outcome(name, "hypothesis", seconds=elapsed, status="error")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    outcome = Outcome(name, "hypothesis", executions=result["executions"], seconds=result["seconds"],
                      crashes=result["crashes"])
    if outcome.crashes:
        outcome.status = "oom" if any("MemoryError" in c["error"] for c in outcome.crashes) else "crash"
    return outcome


def fuzz_many(names: list[str], seconds: float, runs: int | None = None, engine: str = "auto",
              workdir: Path | None = None, memory_mb: int = 4096, timeout_s: int = 10, seed: int = 1,
              jobs: int = 1, lock: Path | None = None) -> list[Outcome]:
    """Fuzz several targets, `jobs` workers at a time; each gets workdir/NAME (default: a temporary folder).
    With `lock`, every target runs holding that file's flock (a long campaign on a shared machine lets other
    heavy jobs in between its targets)."""
    import fcntl
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> Outcome:
        with open(lock, "a") if lock else contextlib.nullcontext() as held:
            if held:
                fcntl.flock(held, fcntl.LOCK_EX)
            o = fuzz(name, seconds, runs, engine, workdir / name if workdir else None, memory_mb, timeout_s, seed)
        print(f"{name:18s} {o.status:7s} {o.executions:>10,} runs {o.seconds:7.0f} s  coverage {o.coverage}  "
              f"crashes {len(o.crashes)}" + "".join(f"\n    {c['file']}: {c['error']}" for c in o.crashes), flush=True)
        return o

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(one, names))


# ---- the worker -----------------------------------------------------------------------------------------------
def limit_memory(memory_mb: int) -> None:
    """Turn a runaway allocation into MemoryError (a reported crash) instead of a machine out of memory."""
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def atheris_worker(name: str, libfuzzer_args: list[str]) -> None:
    import atheris

    target = TARGETS[name]
    with atheris.instrument_imports(include=["halo", "tomllib", "json"]):
        one_input, allowed = target.build()

    def test_one_input(data: bytes) -> None:
        run_one(one_input, allowed, data)

    atheris.Setup([sys.argv[0], *libfuzzer_args], test_one_input)
    atheris.Fuzz()  # exits the process


def hypothesis_worker(name: str, seconds: float, runs: int | None, seed: int, artifacts: Path) -> None:
    """Mutations of the seeds (overwrite, insert, delete, dictionary tokens) and raw random bytes, in
    batches until the time or the execution budget is spent; a failure is shrunk by hypothesis."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    target = TARGETS[name]
    one_input, allowed = target.build()
    seeds = [p.read_bytes()[:target.max_len] for p in seed_inputs(target)] or [b""]
    tokens = list(target.dictionary) or [b"\x00"]

    def mutate(base: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
        data = bytearray(base)
        for op, position, blob in edits:
            at = position % (len(data) + 1)
            if op == 0:
                data[at:at + len(blob)] = blob
            elif op == 1:
                data[at:at] = blob
            elif op == 2:
                del data[at:at + len(blob) + 1]
            else:
                data[at:at] = tokens[blob[0] % len(tokens)] if blob else tokens[0]
        return bytes(data[:target.max_len])

    edit = st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=8))
    inputs = st.one_of(st.builds(mutate, st.sampled_from(seeds), st.lists(edit, max_size=8)),
                       st.binary(max_size=min(target.max_len, 512)))
    count, last, crashes = [0], [b""], []
    started = time.monotonic()

    @settings(max_examples=200, database=None, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=False)
    @given(inputs)
    def check(data: bytes) -> None:
        count[0] += 1
        last[0] = data
        run_one(one_input, allowed, data)

    batch = 0
    while time.monotonic() - started < seconds and (runs is None or count[0] < runs) and not crashes:
        try:
            hypothesis_seed(seed * 1_000_003 + batch)(check)()
        except Exception as e:  # noqa: BLE001 - a non-domain exception: the finding
            import traceback

            traceback.print_exc()
            path = artifacts / f"crash-{hashlib.sha1(last[0]).hexdigest()}"
            path.write_bytes(last[0])
            crashes.append({"file": str(path), "error": f"{type(e).__name__}: {e}"[:300]})
        batch += 1
    print(RESULT_PREFIX + json.dumps({"executions": count[0], "seconds": time.monotonic() - started,
                                      "crashes": crashes}), flush=True)


# ---- the command line -----------------------------------------------------------------------------------------
def report(outcomes: list[Outcome], command: str, out: Path) -> None:
    """Write fuzzing.{json,md}; rows of targets not fuzzed now are kept from the previous report, so a target
    re-run after a fix replaces only its own row."""
    from halo.eval.report import write_report

    rows = {}
    previous = out / "fuzzing.json"
    if previous.is_file():
        rows = {row["target"]: row for row in json.loads(previous.read_text())["targets"]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or None
    for o in outcomes:
        rows[o.target] = {**asdict(o), "exec_per_s": round(o.exec_per_s), "command": command, "commit": commit}
    rows = [rows[name] for name in sorted(rows)]
    lines = ["# Fuzzing campaign", "",
             "Every target may raise only its parser's domain error (see `eval/fuzz/targets.py`); anything else, "
             "a hang (libFuzzer -timeout) or a runaway allocation (address-space limit) counts as a crash. "
             "Crashes found on the way are fixed and kept as regressions (eval/fuzz/corpus/*/crash-*, "
             "tests/test_fuzz_regressions.py). The goal is 10^6 executions per target; a target that reached its "
             "time cap first shows fewer executions (what libFuzzer counted) and status ok. A target re-run after a "
             "fix replaces its row; the row's command and commit say how it ran.", "", "Commands:", "",
             *sorted({f"- `{row['command']}` (commit {row['commit']})" for row in rows}), "",
             "| target | engine | executions | time (s) | exec/s | coverage (edges) | features | corpus | crashes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        dash = lambda v: "-" if v is None else v  # noqa: E731
        status = "" if r["status"] == "ok" else f" ({r['status']})"
        lines.append(f"| {r['target']} | {r['engine']} | {r['executions']:,} | {r['seconds']:.0f} | {r['exec_per_s']:,} | "
                     f"{dash(r['coverage'])} | {dash(r['features'])} | {dash(r['corpus'])} | {len(r['crashes'])}{status} |")
    findings = sorted((t.name, p.name) for t in TARGETS.values() if t.seeds.is_dir() for p in t.seeds.glob("crash-*"))
    lines += ["", "Crashes found so far (this campaign's and earlier runs'), each fixed, kept in the corpus (replayed by "
              "tests/test_fuzz.py) and written out readably in tests/test_fuzz_regressions.py:", "",
              *[f"- {name}: `eval/fuzz/corpus/{name}/{file}`" for name, file in findings]]
    write_report(out, "fuzzing", {"targets": rows, "crash_files": [f"{n}/{f}" for n, f in findings]}, lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m halo.eval.fuzz", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--target", action="append", choices=sorted(TARGETS), help="a target (repeatable)")
    which.add_argument("--all", action="store_true", help="every target, one after another")
    which.add_argument("--list", action="store_true", help="list the targets")
    which.add_argument("--replay", metavar="TARGET", help="run the seed corpus (or FILES) through TARGET, in process")
    which.add_argument("--write-seeds", action="store_true", help="rewrite the seed files corpus/*/seed-* (see seeds.py)")
    which.add_argument("--worker", metavar="TARGET", help=argparse.SUPPRESS)
    parser.add_argument("files", nargs="*", help="--replay: input files; --worker: libFuzzer arguments after --")
    parser.add_argument("--seconds", type=float, default=60.0, help="time per target (default 60)")
    parser.add_argument("--runs", type=int, default=None, help="stop a target after this many executions")
    parser.add_argument("--engine", choices=("auto", "atheris", "hypothesis"), default="auto")
    parser.add_argument("--memory-mb", type=int, default=4096, help="address-space limit of a worker (default 4096)")
    parser.add_argument("--timeout", type=int, default=10, help="seconds one input may take (atheris; default 10)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1, help="targets fuzzed at the same time (default 1)")
    parser.add_argument("--lock", type=Path, default=None,
                        help="hold this file's flock while a target runs, e.g. /tmp/halo-heavy.lock on a shared machine")
    parser.add_argument("--workdir", type=Path, default=None,
                        help=f"working corpus and crashes (default {SCRATCH}/TARGET; --worker: this run's folder)")
    parser.add_argument("--report", action="store_true", help="write eval/results/fuzzing.{json,md} (or to --out)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        limit_memory(args.memory_mb)
        if args.engine == "atheris":
            atheris_worker(args.worker, args.files)
        else:
            hypothesis_worker(args.worker, args.seconds, args.runs, args.seed, args.workdir / "artifacts")
        return 0
    if args.write_seeds:
        from halo.eval.fuzz.seeds import write_seeds

        write_seeds()
        return 0
    if args.list:
        for t in TARGETS.values():
            print(f"{t.name:18s} {t.what}")
        return 0
    if args.replay:
        for path, error in replay(args.replay, [Path(f) for f in args.files] or None):
            print(f"{path}: {'ok' if error is None else type(error).__name__ + ': ' + str(error)[:200]}")
        return 0
    names = sorted(TARGETS) if args.all else args.target
    if not names:
        build_parser().error("give --target NAME, --all, --list or --replay TARGET")
    outcomes = fuzz_many(names, args.seconds, args.runs, args.engine, args.workdir or SCRATCH, args.memory_mb,
                         args.timeout, args.seed, args.jobs, args.lock)
    if args.report:
        from halo.eval.report import command_line

        report(outcomes, command_line("halo.eval.fuzz", argv), args.out)
    return 0 if all(o.status == "ok" for o in outcomes) else 1
