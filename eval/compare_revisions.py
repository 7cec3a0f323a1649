"""The same benchmark on two revisions of halo, interleaved in one run: did a change move the speed?

    python -m halo.eval.compare_revisions --base REV [--runs 3] [--name NAME] -- BENCH [BENCH ARGS ...]

BENCH is a benchmark module of halo.eval whose JSON has `rows` with `ms_median` (bench_scaling, bench_halo_speed's
`speed`). REV (a commit) is installed once from a git worktree into a folder of its own (pip --target, no
dependencies: this environment's serve both); every run then starts the benchmark on the base revision and on this
checkout's installed halo in turn, each in a fresh process (the base one with that folder first on PYTHONPATH, so
its agents import it too), from a scratch directory. A row's cell is the median over the runs of that setup's
ms_median; the ratio is this revision's over the base's. Writes eval/results/NAME.{json,md} with the host.
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
from halo.eval.report import command_line, host_line, write_report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "eval" / "results"
SETUP_FIELDS = ("nodes", "agents", "plr", "profile", "setup", "sync", "mode", "plan")  # what names a row's setup


def install_revision(rev: str, into: Path) -> str:
    """REV installed (no dependencies) into `into`; returns its full commit id."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True,
                            text=True)
    if commit.returncode != 0:
        raise ConfigError(f"--base {rev}: not a commit of {ROOT} ({commit.stderr.strip()})")
    tree = into / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), commit.stdout.strip()],
                   check=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                        str(into / "site"), str(tree)], check=True, timeout=900)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return commit.stdout.strip()


def setup_key(row: dict) -> str:
    """A row's setup, from the fields that name one in the benchmarks' rows (what else a row holds is measured)."""
    return ", ".join(f"{k}={row[k]}" for k in SETUP_FIELDS if k in row)


def run_bench(bench: str, args: list[str], site: Path | None, out: Path) -> dict[str, float]:
    """One run of the benchmark: setup -> ms_median."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    done = subprocess.run([sys.executable, "-P", "-m", f"halo.eval.{bench}", *args, "--out", str(out), "--name", "run"],
                          cwd=out.parent, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"{bench} failed on {'the base' if site else 'this'} revision: {done.stderr.strip()[-2000:]}")
    rows = json.loads((out / "run.json").read_text())["rows"]
    return {setup_key(r): r["ms_median"] for r in rows if r.get("ms_median") is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the revision to compare against (a commit, tag or branch)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each revision, interleaved (default 3)")
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
            base = install_revision(args.base, scratch / "base")
            head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
            times: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
            for i in range(args.runs):
                for which, site in (("base", scratch / "base" / "site"), ("head", None)):
                    print(f"run {i + 1}/{args.runs}: {which}", file=sys.stderr, flush=True)
                    for key, ms in run_bench(args.bench, bench_args, site, scratch / f"{which}-{i}").items():
                        times[which].setdefault(key, []).append(ms)
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
             "median over the runs of the setup's median ms/token (every run's in parentheses).", "",
             "| setup | base ms/token | this revision ms/token | ratio |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['base_ms']:.2f} ({', '.join(f'{x:.1f}' for x in r['base_runs'])}) | "
                     f"{r['head_ms']:.2f} ({', '.join(f'{x:.1f}' for x in r['head_runs'])}) | {r['ratio']:.2f}x |")
    write_report(args.out, args.name, {"command": command, "host": host_line(), "bench": args.bench, "base": base,
                                       "head": head, "runs": args.runs, "rows": rows}, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
