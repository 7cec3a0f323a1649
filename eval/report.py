"""Where benchmark results go: eval/results/NAME.json (data + the command) and NAME.md (a table)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path


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
