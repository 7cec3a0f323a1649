"""The headline table: halo (exact and HALO sync), distributed-llama and llama.cpp's RPC backend on every emulated
link profile, from one bench_peer run per profile (eval/results/peer_profile_PROFILE.json).

    for p in ethernet wifi-good wifi-busy wifi-bad; do
        python -m halo.eval.bench_peer --dllama PATH --llamacpp LLAMA_CPP_BIN --profile $p --plr 0 --layers 8 \\
            --tokens 16 --modes exact,halo,exact@twice,halo@twice --variants '{"twice": {"copies": 2}}' \\
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

from halo.eval.bench_peer import LLAMACPP
from halo.eval.report import run_script, write_report

ORDER = ("ethernet", "wifi-good", "wifi-busy", "wifi-bad")


PEERS = {"dllama": ("dllama", "dllama turbo"), "llamacpp": (LLAMACPP,)}  # a peer's settings: its fastest counts
TWICE_EXACT, TWICE_HALO = "exact@twice", "halo@twice"  # bench_peer --variants '{"twice": {"copies": 2}}'


def twice_cells(r: dict) -> str:
    if "exact_twice_ms" not in r:
        return "not run | not run | -"
    return f"{r['exact_twice_ms']:.1f} | {r['halo_twice_ms']:.1f} | {r['halo_vs_exact_twice']:.2f}x"


def row(profile: str, results: dict) -> dict:
    """One profile's figures; a peer's time is None where every setting of it stalled (no timed token), and its
    entries are absent where the run did not include it (llama.cpp before --llamacpp existed)."""
    by = {r["sync"]: r["ms_mean"] for r in results["rows"]}
    ours = [v for k, v in by.items() if k.partition("@")[0] in ("exact", "halo")]
    best_halo = min(ours)  # halo's best setting: the one a user would pick (--sync auto's aim)
    out = {"profile": profile, "link": PROFILES[profile].describe(), "exact_ms": by["exact"], "halo_ms": by["halo"],
           "halo_vs_exact": by["halo"] / by["exact"], "single_ms": by["halo single process"], "best_ms": best_halo,
           "command": results["command"], "host": results.get("host", "host not recorded")}
    if TWICE_EXACT in by and TWICE_HALO in by:  # each vector sent twice (--copies 2)
        out.update(exact_twice_ms=by[TWICE_EXACT], halo_twice_ms=by[TWICE_HALO],
                   halo_vs_exact_twice=by[TWICE_HALO] / by[TWICE_EXACT])
    for peer, settings in PEERS.items():
        stalled = [s for s in results.get("stalled", []) if s["sync"] in settings]
        timed = [v for k, v in by.items() if k in settings]
        if not (timed or stalled):
            continue
        fastest = min(timed) if timed else None
        out.update({f"{peer}_ms": fastest, f"{peer}_vs_halo": None if fastest is None else fastest / best_halo,
                    f"{peer}_stalled": "; ".join(f"{s['sync']}: {s['why']}" for s in stalled)})
    return out


def peer_cells(r: dict, peer: str) -> str:
    if f"{peer}_ms" not in r:
        return "not run | -"
    if r[f"{peer}_ms"] is None:
        return f"stalled ({r[f'{peer}_stalled']}) | - "
    return f"{r[f'{peer}_ms']:.1f}" + (f" ({r[f'{peer}_stalled']})" if r[f"{peer}_stalled"] else "") + \
        f" | {r[f'{peer}_vs_halo']:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="eval/results")
    args = parser.parse_args(argv)
    rows = []
    for profile in ORDER:
        path = Path(args.results) / f"peer_profile_{profile}.json"
        if path.exists():
            results = json.loads(path.read_text())
            missing = {"exact", "halo", "halo single process"} - {r["sync"] for r in results["rows"]}
            if missing:  # (a KeyError before: a run of other modes)
                print(f"{path}: no {', '.join(sorted(missing))} row (bench_peer --modes left them out): skipped",
                      file=sys.stderr)
                continue
            rows.append(row(profile, results))
    if not rows:
        print(f"no peer_profile_*.json in {args.results}: run bench_peer per profile first (see --help)", file=sys.stderr)
        return 2
    hosts = sorted({r["host"] for r in rows})
    lines = ["# halo, distributed-llama and llama.cpp's RPC backend on emulated links (TinyLlama-1.1B shape, 8 layers, "
             "Q4_0, master + 3)", "",
             f"{' / '.join(hosts)} One `bench_peer` run per profile (commands in the JSON); the 2 cores are shared by all "
             "four nodes. ms per output token, mean of 16 greedy tokens; 2 copies: every vector sent twice once a link has "
             "shown loss (--copies 2); best halo: the fastest of halo's columns; dllama: the faster of its two socket "
             "modes; llama.cpp rpc: its layers split over an rpc-server on each node (a pipeline).", "",
             "| profile | every agent's link | halo exact | halo (HALO sync) | HALO / exact | exact, 2 copies | "
             "HALO, 2 copies | HALO / exact, 2 copies | distributed-llama | dllama / best halo | llama.cpp rpc | "
             "llama.cpp / best halo | one process |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['profile']} | {r['link']} | {r['exact_ms']:.1f} | {r['halo_ms']:.1f} | {r['halo_vs_exact']:.2f}x | "
              f"{twice_cells(r)} | {peer_cells(r, 'dllama')} | {peer_cells(r, 'llamacpp')} | {r['single_ms']:.1f} |"
              for r in rows]
    write_report(args.results, "profiles_headline", {"hosts": hosts, "rows": rows}, lines)  # (it prints the table)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
