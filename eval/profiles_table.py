"""The headline table: halo (exact and HALO sync) and distributed-llama on every emulated link profile, from one
bench_peer run per profile (eval/results/peer_profile_PROFILE.json).

    for p in ethernet wifi-good wifi-busy wifi-bad; do
        python -m halo.eval.bench_peer --dllama PATH --profile $p --plr 0 --layers 8 --tokens 16 \\
            --name peer_profile_$p; done
    python -m halo.eval.profiles_table

Within a row every figure comes from one run (the systems interleaved on the same bed), so the row's ratios hold;
across rows the runs differ (minutes apart, the same 2-core machine), so compare rows loosely.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from halo.rpi.links import PROFILES

from halo.eval.report import write_report

ORDER = ("ethernet", "wifi-good", "wifi-busy", "wifi-bad")


def row(profile: str, results: dict) -> dict:
    """One profile's figures; the peer's time is None where every socket mode of it stalled (no timed token)."""
    by = {r["sync"]: r["ms_mean"] for r in results["rows"]}
    timed = [v for k, v in by.items() if k in ("dllama", "dllama turbo")]
    peer, best_halo = (min(timed) if timed else None), min(by["exact"], by["halo"])
    stalled = "; ".join(f"{s['sync']}: {s['why']}" for s in results.get("stalled", []))
    return {"profile": profile, "link": PROFILES[profile].describe(), "exact_ms": by["exact"], "halo_ms": by["halo"],
            "halo_vs_exact": by["halo"] / by["exact"], "dllama_ms": peer,
            "dllama_vs_halo": None if peer is None else peer / best_halo, "dllama_stalled": stalled,
            "single_ms": by["halo single process"], "command": results["command"],
            "host": results.get("host", "host not recorded")}


def peer_cells(r: dict) -> str:
    if r["dllama_ms"] is None:
        return f"stalled ({r['dllama_stalled']}) | - "
    return f"{r['dllama_ms']:.1f}" + (f" ({r['dllama_stalled']})" if r["dllama_stalled"] else "") + \
        f" | {r['dllama_vs_halo']:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="eval/results")
    args = parser.parse_args(argv)
    rows = []
    for profile in ORDER:
        path = Path(args.results) / f"peer_profile_{profile}.json"
        if path.exists():
            rows.append(row(profile, json.loads(path.read_text())))
    if not rows:
        print(f"no peer_profile_*.json in {args.results}: run bench_peer per profile first (see --help)", file=sys.stderr)
        return 2
    hosts = sorted({r["host"] for r in rows})
    lines = ["# halo and distributed-llama on emulated links (TinyLlama-1.1B shape, 8 layers, Q4_0, master + 3)", "",
             f"{' / '.join(hosts)} One `bench_peer` run per profile (commands in the JSON); the 2 cores are shared by all "
             "four nodes. ms per output token, mean of 16 greedy tokens; dllama: the faster of its two socket modes.", "",
             "| profile | every agent's link | halo exact | halo (HALO sync) | HALO / exact | distributed-llama | "
             "dllama / best halo | one process |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['profile']} | {r['link']} | {r['exact_ms']:.1f} | {r['halo_ms']:.1f} | {r['halo_vs_exact']:.2f}x | "
              f"{peer_cells(r)} | {r['single_ms']:.1f} |" for r in rows]
    write_report(args.results, "profiles_headline", {"hosts": hosts, "rows": rows}, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
