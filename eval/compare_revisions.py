"""The same benchmark on two revisions of halo, interleaved in one run: did a change move the speed?

    python -m halo.eval.compare_revisions --base REV [--runs 3] [--name NAME] -- BENCH [BENCH ARGS ...]

BENCH is a benchmark module of halo.eval whose JSON has `rows` with `ms_median` and `ms_mean` (bench_scaling,
bench_halo_speed's `speed`); --metric picks which (the median by default; the mean where the tail is the point, as
on lossy radio links, where a token's recoveries make it). REV (a commit) is installed once from a git worktree into a folder of its own (pip --target, no
dependencies: this environment's serve both); every run then starts the benchmark on the base revision and on this
checkout's installed halo in turn, each in a fresh process (the base one with that folder first on PYTHONPATH, so
its agents import it too), from a scratch directory. A row's cell is the median over the runs of that setup's
metric (the benchmark's own runs pooled with them); the ratio is this revision's over the base's; the two
revisions take turns going first. Writes eval/results/NAME.{json,md} with the host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from halo.errors import ConfigError
from halo.eval.report import command_line, host_line, run_script, write_report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "eval" / "results"
SETUP_FIELDS = ("nodes", "agents", "plr", "profile", "setup", "sync", "mode", "plan")  # what names a row's setup


def commit_of(rev: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise ConfigError(f"{rev}: not a commit of {ROOT} ({done.stderr.strip()})")
    return done.stdout.strip()


def step(what: str, command: list[str], **kwargs) -> None:
    """A step of the base's installation, its failure a ConfigError that names it."""
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, **kwargs)
    except subprocess.CalledProcessError as e:
        raise ConfigError(f"{what} failed: {(e.stderr or e.stdout).strip()[-1500:]}") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{what} took longer than {kwargs.get('timeout')} s") from None


def install_revision(commit: str, into: Path) -> None:
    """The commit installed (no dependencies) into into/site, its compiled extensions included: a run of the base
    must never fall through to this checkout's halo (an extension the base build lacked would)."""
    tree = into / "tree"
    step("git worktree add", ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), commit])
    try:
        step(f"installing {commit[:8]}", [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                                           "--no-build-isolation", "--target", str(into / "site"), str(tree)],
             timeout=900)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    probe = ("import halo, halo._nbits, halo.transport._datagrams as d, sys; "
             "sys.exit(any(not m.__file__.startswith(sys.argv[1]) for m in (halo, halo._nbits, d)))")
    step(f"checking that {commit[:8]} imports from its own folder (its C extensions built)",
         [sys.executable, "-P", "-c", probe, str(into / "site")], cwd=into, timeout=60,
         env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(into / "site")})


def setup_key(row: dict) -> str:
    """A row's setup, from the fields that name one in the benchmarks' rows (what else a row holds is measured)."""
    return ", ".join(f"{k}={row[k]}" for k in SETUP_FIELDS if k in row)


def run_bench(bench: str, args: list[str], site: Path | None, out: Path, metric: str = "ms_median") -> dict[str, list[float]]:
    """One run of the benchmark: setup -> its rows' metric (one a run of the benchmark's own --runs)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    done = subprocess.run([sys.executable, "-P", "-m", f"halo.eval.{bench}", *args, "--out", str(out), "--name", "run"],
                          cwd=out.parent, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"{bench} failed on {'the base' if site else 'this'} revision: {done.stderr.strip()[-2000:]}")
    times: dict[str, list[float]] = {}
    for row in json.loads((out / "run.json").read_text())["rows"]:
        if row.get(metric) is not None:
            times.setdefault(setup_key(row), []).append(row[metric])
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the revision to compare against (a commit, tag or branch)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each revision, interleaved (default 3)")
    parser.add_argument("--metric", choices=("ms_median", "ms_mean"), default="ms_median",
                        help="each run's figure of a setup: its median ms/token (default) or its mean (the tail counts)")
    parser.add_argument("--name", default="compare_revisions")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("bench", help="the benchmark module of halo.eval (bench_scaling, bench_halo_speed ...)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    args = parser.parse_args(argv)
    bench_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    try:
        with tempfile.TemporaryDirectory(prefix="halo-revisions-") as tmp:
            scratch = Path(tmp)
            base, head = commit_of(args.base), commit_of("HEAD")
            install_revision(base, scratch / "base")
            times: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
            sides = [("base", scratch / "base" / "site"), ("head", None)]
            for i in range(args.runs):
                for which, site in sides if i % 2 == 0 else sides[::-1]:  # each goes first every other run
                    print(f"run {i + 1}/{args.runs}: {which}", file=sys.stderr, flush=True)
                    for key, ms in run_bench(args.bench, bench_args, site, scratch / f"{which}-{i}",
                                                   args.metric).items():
                        times[which].setdefault(key, []).extend(ms)
        if not set(times["base"]) & set(times["head"]):
            raise ConfigError(f"the two revisions' {args.bench} rows share no setup: base {sorted(times['base'])}, "
                              f"this revision {sorted(times['head'])}")
    except ConfigError as e:
        print(f"compare_revisions: {e}", file=sys.stderr)
        return 2
    rows = [{"setup": key, "base_ms": statistics.median(times["base"][key]), "head_ms": statistics.median(ms),
             "base_runs": times["base"][key], "head_runs": ms,
             "ratio": statistics.median(ms) / statistics.median(times["base"][key])}
            for key, ms in times["head"].items() if key in times["base"]]
    command = command_line("halo.eval.compare_revisions", argv)
    lines = [f"# {args.bench}: {base[:8]} (base) against {head[:8]} (this revision), interleaved", "",
             f"Command: `{command}`. {host_line()} {args.runs} run(s) of each revision, alternating; a cell is the "
             f"median over the runs of the setup's {'median' if args.metric == 'ms_median' else 'mean'} ms/token "
             "(every run's in parentheses).", "",
             "| setup | base ms/token | this revision ms/token | ratio |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['base_ms']:.2f} ({', '.join(f'{x:.1f}' for x in r['base_runs'])}) | "
                     f"{r['head_ms']:.2f} ({', '.join(f'{x:.1f}' for x in r['head_runs'])}) | {r['ratio']:.2f}x |")
    write_report(args.out, args.name, {"command": command, "host": host_line(), "bench": args.bench, "base": base,
                                       "head": head, "runs": args.runs, "rows": rows}, lines)  # (it prints the table)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
