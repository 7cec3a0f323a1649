"""Where benchmark results go: eval/results/NAME.json (data + the command) and NAME.md (a table)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path


def run_script(main) -> int:
    """An eval script's exit: a HaloError (a model name the loader does not know, a bad cluster file) is one line and
    exit code 2, as halo-master says it, not a traceback."""
    from halo.errors import HaloError

    try:
        return main() or 0
    except HaloError as e:
        print(f"{Path(sys.argv[0]).stem}: error: {e}", file=sys.stderr)
        return 2


def cpu_model() -> str:
    """The CPU's model name as results record it (/proc/cpuinfo; elsewhere what platform knows): benchmarks of memory
    and kernels differ by host, so every file says which it ran on."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def host() -> dict:
    """The host as a results file's JSON records it: its CPU model and core count."""
    return {"cpu": cpu_model(), "cores": os.cpu_count()}


def host_line() -> str:
    """'Host: CPU model, N cores.' for a results file: figures differ ~3x between hosts of the same kind."""
    return f"Host: {cpu_model()}, {os.cpu_count()} cores."


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that reproduces a run, as it goes into the results."""
    return " ".join([f"python -m {module}", *map(shlex.quote, argv if argv is not None else sys.argv[1:])])


def write_report(out: str | Path, stem: str, data: dict, lines: list[str]) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


HOSTS = ("AMD EPYC", "Intel Xeon", "H200")  # the hosts results name in their text


def host_named(text: str) -> str:
    """The host a result names: its `Host:` line's, else the one its text mentions first (the first of HOSTS found
    anywhere labelled an Intel Xeon run "AMD EPYC" because its prose compared it with one)."""
    import re

    line = re.search(r"^.*\bHost: ?(.*)$", text, re.MULTILINE)
    for where in ([line.group(1)] if line else []) + [text]:
        found = [(where.find(h), h) for h in HOSTS if h in where]
        if found:
            return min(found)[1]
    return "-"


def index(results: Path) -> list[str]:
    """eval/results/README.md: every result with the date it was committed (git; 'uncommitted' before), the host
    its text names and its command, newest first."""
    import re
    import subprocess

    rows = []
    for md in sorted(results.glob("*.md")):
        if md.name == "README.md":
            continue
        text = md.read_text()
        title = text.split("\n", 1)[0].lstrip("# ").strip()
        command = re.search(r"`(python -m [^`]+)`", text)
        host = host_named(text)
        dated = subprocess.run(["git", "log", "--format=%cs", "--diff-filter=A", "-1", "--", md.name], cwd=results,
                               capture_output=True, text=True).stdout.strip() or "uncommitted"
        rows.append((dated, md.name, title, host, command.group(1) if command else "-"))
    rows.sort(key=lambda r: (r[0], r[1]), reverse=True)
    lines = ["# Results", "", "Every result under eval/results/, newest first: the date its file was added (git), the host "
             "its text names (figures differ ~3x between hosts of one kind) and the command that wrote it. Written by "
             "`python -m halo.eval.report index`.", "", "| added | file | what | host | command |",
             "|---|---|---|---|---|"]
    for dated, name, title, host, command in rows:
        lines.append(f"| {dated} | [{name}]({name}) | {title.replace('|', '/')} | {host} | "
                     f"`{command.replace('|', '/')}` |" if command != "-" else
                     f"| {dated} | [{name}]({name}) | {title.replace('|', '/')} | {host} | - |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m halo.eval.report index [RESULTS_DIR]  (writes RESULTS_DIR/README.md)"
    if args[:1] != ["index"] or len(args) > 2 or any(a.startswith("-") for a in args[1:]):
        print(usage, file=sys.stderr)
        return 0 if {"-h", "--help"} & set(args) else 2
    results = Path(args[1]) if len(args) > 1 else Path(__file__).resolve().parent / "results"
    if not results.is_dir():
        print(f"{results}: no such results directory\n{usage}", file=sys.stderr)
        return 2
    (results / "README.md").write_text("\n".join(index(results)) + "\n")
    print(f"wrote {results / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
