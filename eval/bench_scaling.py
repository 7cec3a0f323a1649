"""Does the cluster beat one of its devices? Nodes pinned to cores of their own, against one node, in one run.

    python -m halo.eval.bench_scaling [--model tinyllama-q4] [--nodes 1,2] [--threads-per-node 1]
                                      [--plans even,even-mlp-only] [--busy-poll on,off] [--tokens 48] [--runs 2]
                                      [--bed --plr 0,0.05] [--dllama PATH]

Every node is one process pinned (os.sched_setaffinity) to a core set of its own: node i takes cores
i*K .. i*K+K-1 (K = --threads-per-node, its compute threads). Node 0 is the master (`halo-master generate`,
exactly as a user runs it: greedy from BOS, --json), nodes 1.. are `halo-agent` daemons; sync exact over
loopback UDP (or, with --bed, inside the namespace test bed with real nftables loss on every link). Per run,
interleaved so that every row sees the same drift of the host:

- one node: the single process on K cores (the 1.0x every ratio divides by);
- one process on N*K cores with N*K threads: what the same cores do without any network;
- the bandwidth ceiling: N single processes at once, each on its own core set. A decode step streams every
  weight once, so it is bound by memory bandwidth; when N cores stream together each slows down by however much
  they share the memory bus, and N x (one alone) / (each beside the others) is the most an N-node TP cluster can
  gain on this host at that hour. On a 2-core cloud VM it has ranged from 1.25x to 1.95x;
- the cluster: master + N-1 agents for every --plans x --busy-poll, its tokens checked against the single
  process's (exact sync gives one device's tokens), its per-round overhead (round wall time beyond the slowest
  device's compute, halo/distributed/timing.py) from the master's --json.

--dllama PATH runs distributed-llama (a `dllama` binary built from its repository; this benchmark neither
downloads nor builds it) on the same Q4_0 blocks (eval/dllama_files.py), root + N-1 workers pinned alike, in the
same runs. Writes eval/results/NAME.{json,md,png} with the host's CPU model and core count.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from halo.eval.bench_churn import add_model_argument, model_file
from halo.eval.bench_halo_speed import add_profile_argument
from halo.eval.report import command_line, host, run_script, write_report

CONTEXT = 256
START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 600.0


def core_sets(nodes: int, per_node: int) -> list[set[int]]:
    """Node i's cores: i*K .. i*K+K-1 of the cores this process may use (their order)."""
    cores = sorted(os.sched_getaffinity(0))
    if nodes * per_node > len(cores):
        raise SystemExit(f"{nodes} nodes x {per_node} cores need {nodes * per_node} cores; this process may use "
                         f"{len(cores)} ({', '.join(map(str, cores))})")
    return [set(cores[i * per_node:(i + 1) * per_node]) for i in range(nodes)]


def pinned(cores: set[int], popen=subprocess.Popen):
    """popen that starts its program on `cores` only (the affinity survives the exec of nsenter and python)."""
    def start(argv, preexec_fn=None, **kwargs):
        def before():
            os.sched_setaffinity(0, cores)
            if preexec_fn is not None:
                preexec_fn()
        return popen(argv, preexec_fn=before, **kwargs)
    return start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- halo --------------------------------------------------------------------------------------------------
@contextmanager
def agents(model: Path, key: Path, cores: list[set[int]], busy_poll: str, bed=None):
    """One halo-agent per core set, pinned; their endpoints. In the bed: agent-i in its namespace."""
    from halo.distributed import AgentProcess, agent_command, stop_processes

    processes = []
    try:
        for i, mine in enumerate(cores, start=1):
            host = f"agent-{i}"
            listen = f"tcp://{bed.address(host)}:7070" if bed else f"tcp://127.0.0.1:{free_port()}"
            argv = agent_command(listen, key, host, len(mine), model) + ["--busy-poll", busy_poll]
            popen = (lambda a, host=host, **kw: bed.popen(host, a, **kw)) if bed else subprocess.Popen
            processes.append(AgentProcess(host, argv, popen=pinned(mine, popen)))
        yield [p.wait_listening(START_TIMEOUT_S) for p in processes]
    finally:
        stop_processes(processes)


def generate(model: Path, cores: set[int], tokens: int, threads: int, extra: list[str] = (), bed=None) -> dict:
    """`halo-master generate --json` on `cores` (in the bed: in the master's namespace): its JSON."""
    from halo.runtime.local import module_command

    argv = module_command("halo.cli.master", "generate", "--model", model, "--prompt", "", "--max-new-tokens", tokens,
                          "--context", CONTEXT, "--threads", threads, "--json", *extra)
    popen = pinned(cores, (lambda a, **kw: bed.popen("master", a, **kw)) if bed else subprocess.Popen)
    p = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"halo-master generate {' '.join(map(str, extra))} failed ({p.returncode}): {err[-2000:]}")
    return json.loads(out)


def at_once(jobs: list) -> list:
    """Run the zero-argument callables in threads, started together; their results in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        return [f.result() for f in [pool.submit(job) for job in jobs]]


def row_of(result: dict, **fields) -> dict:
    t = result["timings"]
    breakdown = (result.get("sync") or {}).get("breakdown") or {}
    return {**fields, "ms_mean": t["mean_ms_per_output_token"], "ms_median": t.get("median_ms_per_output_token"),
            "tokens": result["token_ids"], "round_overhead_ms": breakdown.get("round_overhead_ms"),
            "per_token_ms": breakdown.get("per_token_ms"), "sync_rounds_per_token": breakdown.get("sync_rounds_per_token")}


# ---- distributed-llama ---------------------------------------------------------------------------------------
class Pinned:
    """The test bed's popen(host, argv) for loopback: every program on the cores of its host (bench_peer.run_peer
    starts the peer's root through it)."""

    def __init__(self, cores: dict[str, set[int]], bed=None):
        self.cores, self.bed = cores, bed

    def popen(self, host: str, argv, **kwargs):
        start = (lambda a, **kw: self.bed.popen(host, a, **kw)) if self.bed else subprocess.Popen
        return pinned(self.cores[host], start)(argv, **kwargs)


def run_dllama(binary: Path, model: Path, tokenizer: Path, cores: list[set[int]], tokens: int) -> dict:
    """distributed-llama's root + len(cores)-1 workers on loopback, pinned alike (its blocking sockets, as on the
    bed): the wall time between its per-token lines (bench_peer.run_peer)."""
    from halo.eval.bench_peer import run_peer

    hosts = Pinned({"master": cores[0], **{f"agent-{i}": c for i, c in enumerate(cores[1:], start=1)}})
    ports = [free_port() for _ in cores[1:]]
    workers = [hosts.popen(f"agent-{i}", [str(binary), "worker", "--port", str(port), "--nthreads", str(len(c)),
                                          "--net-turbo", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for i, (c, port) in enumerate(zip(cores[1:], ports), start=1)]
    try:
        time.sleep(1.0 if workers else 0.0)  # listening
        result = run_peer(hosts, binary, model, tokenizer, [f"127.0.0.1:{p}" for p in ports], "0", tokens,
                          RUN_TIMEOUT_S, threads=len(cores[0]))
    finally:
        for w in workers:
            w.kill()
            w.wait()
    ms = result["ms_per_token"]
    return {"timings": {"mean_ms_per_output_token": float(np.mean(ms)), "median_ms_per_output_token": float(np.median(ms))},
            "token_ids": []}


# ---- the benchmark -------------------------------------------------------------------------------------------
def bench(args) -> dict:
    from halo.transport.reliable import generate_key

    model = model_file(args.model)
    k = args.threads_per_node
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        overhead = (row.get("round_overhead_ms") or {}).get("p50")
        print(f"run {row['run'] + 1}/{args.runs} nodes {row['nodes']} plr {row['plr']:g}: {row['setup']}: "
              f"{row['ms_mean']:.2f} ms/token" + (f", round overhead p50 {1e3 * overhead:.0f} us" if overhead else ""),
              flush=True)

    peer = None
    if args.dllama:
        from halo.eval.bench_peer import peer_files

        peer = peer_files(22)
    with tempfile.TemporaryDirectory(prefix="halo-scaling-") as tmp, bed_for(args) as bed:
        key = Path(tmp) / "cluster.key"
        generate_key(key)
        for run in range(args.runs):
            if bed:
                bed.set_loss(0.0)
            one = generate(model, core_sets(1, k)[0], args.tokens, k, bed=bed)
            reference = one["token_ids"]
            add(row_of(one, run=run, nodes=1, plr=0.0, setup="one node"))
            if peer:
                add(row_of(run_dllama(Path(args.dllama), *peer, core_sets(1, k), args.tokens), run=run, nodes=1,
                           plr=0.0, setup="distributed-llama"))
            for n in [n for n in args.nodes if n > 1]:
                cores = core_sets(n, k)
                if bed:
                    bed.set_loss(0.0)
                together = set().union(*cores)
                add(row_of(generate(model, together, args.tokens, n * k, bed=bed), run=run, nodes=n, plr=0.0,
                           setup=f"one process, {n * k} threads"))
                each = at_once([lambda mine=mine: generate(model, mine, args.tokens, k, bed=bed) for mine in cores])
                add({**row_of(each[0], run=run, nodes=n, plr=0.0, setup="ceiling"),
                     "ms_mean": float(np.mean([e["timings"]["mean_ms_per_output_token"] for e in each])),
                     "ms_each": [e["timings"]["mean_ms_per_output_token"] for e in each]})
                for busy in args.busy_poll:
                    with agents(model, key, cores[1:], busy, bed) as endpoints:
                        for plr in args.plr:
                            if bed:
                                bed.set_loss(plr)
                            for plan in args.plans:
                                result = generate(model, cores[0], args.tokens, k,
                                                  ["--agents", ",".join(e.split("://")[-1] for e in endpoints),
                                                   "--key", str(key), "--plan", plan, "--sync", "exact",
                                                   "--busy-poll", busy, "--timeout", "30"], bed=bed)
                                add({**row_of(result, run=run, nodes=n, plr=plr, setup=f"halo {plan}, busy poll {busy}"),
                                     "same_tokens": result["token_ids"] == reference})
                if peer and not bed:
                    add(row_of(run_dllama(Path(args.dllama), *peer, cores, args.tokens), run=run, nodes=n, plr=0.0,
                               setup="distributed-llama"))
    return {"command": command_line("halo.eval.bench_scaling", args.argv), "model": str(model),
            "host": {**host(), "usable_cores": len(os.sched_getaffinity(0))},
            "threads_per_node": k, "tokens": args.tokens, "runs": args.runs, "bed": args.bed, "profile": args.profile, "rows": rows}


@contextmanager
def bed_for(args):
    """The namespace test bed for --bed (master + the most agents asked for), else None."""
    if not args.bed:
        yield None
        return
    from halo.rpi.testbed import LossyTestbed, available

    ok, why = available()
    if not ok:
        raise SystemExit(f"--bed: the namespace test bed cannot run here: {why}")
    with LossyTestbed(n_agents=max(args.nodes) - 1, prefix="hs", links=args.profile) as bed:
        yield bed


def speedup(row: dict, one: dict[int, float]) -> float:
    """A row's speedup over the one node of its own run (one: run -> that node's ms/token; the host's memory traffic
    from outside changes by the hour: only ratios inside one run mean anything). A ceiling row's is what its N
    processes streamed together: N x one node / each beside the others."""
    return one[row["run"]] / row["ms_mean"] * (row["nodes"] if row["setup"] == "ceiling" else 1)


def one_node(rows: list[dict]) -> dict[int, float]:
    """run -> the one node's ms/token in it."""
    return {r["run"]: r["ms_mean"] for r in rows if r["setup"] == "one node"}


def by_setup(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(nodes, plr, setup) -> its rows, one a run, in run order."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["nodes"], r["plr"], r["setup"]), []).append(r)
    return groups


def median(values: list[float]) -> float:
    return float(np.median(values))


def render(result: dict) -> list[str]:
    rows, host, k = result["rows"], result["host"], result["threads_per_node"]
    one, groups = one_node(rows), by_setup(rows)
    ceiling = {(r["nodes"], r["run"]): speedup(r, one) for r in rows if r["setup"] == "ceiling"}
    lines = [f"# Scaling with a core set per node ({Path(result['model']).name})", "",
             f"Command: `{result['command']}`. Host: {host['cpu']}, {host['cores']} cores. Every node one process "
             f"pinned to {k} core{'s' if k > 1 else ''} of its own, {k} compute thread{'s' if k > 1 else ''}; sync exact "
             + ("inside the namespace test bed (nftables loss on every link, both ways"
                + (f"; every agent link emulated as `{result['profile']}`, rpi/links.py" if result.get("profile") else "")
                + "). " if result["bed"] else
                "over loopback UDP. ")
             + f"Greedy from BOS, mean ms per output token over {result['tokens']} tokens (`halo-master generate "
             f"--json`). Each setup ran {result['runs']} time(s), interleaved. Speedup: over the one node of the same "
             "run, the median of the runs (every run's in parentheses). `ceiling`: N single processes at once, each on "
             "its own cores: N x (one alone) / (each beside the others), what N cores stream together, the most any "
             "N-node split of a bandwidth-bound decode can gain in that run; `of ceiling`: a setup's speedup over its "
             "run's ceiling. Round overhead: a sync round's wall time beyond the slowest device's compute (the median "
             "round of the median run).", "",
             "| nodes | loss | setup | ms/token (median run) | speedup over one node | of ceiling | round overhead p50 "
             "| same tokens as one node |", "|---|---|---|---|---|---|---|---|"]
    order = sorted(groups, key=lambda key: (key[0], key[1], key[2] != "one node", key[2] != "ceiling",
                                           "halo" in key[2], key[2]))
    for key in order:
        runs = groups[key]
        ratios = [speedup(r, one) for r in runs]
        middle = sorted(runs, key=lambda r: r["ms_mean"])[(len(runs) - 1) // 2]
        of_ceiling = [ratio / ceiling[(r["nodes"], r["run"])] for r, ratio in zip(runs, ratios)
                      if (r["nodes"], r["run"]) in ceiling and key[2] != "ceiling" and key[0] > 1]
        overhead = (middle.get("round_overhead_ms") or {}).get("p50")
        same = "-" if "same_tokens" not in middle else ("yes" if all(r["same_tokens"] for r in runs) else "**no**")
        ms = f"{middle['ms_mean']:.2f}" if key[2] != "ceiling" else f"each {', '.join(f'{v:.1f}' for v in middle['ms_each'])}"
        lines.append(f"| {key[0]} | {100 * key[1]:g} % | {key[2]} | {ms} | {median(ratios):.2f}x "
                     f"({', '.join(f'{v:.2f}' for v in ratios)}) | "
                     f"{f'{median(of_ceiling):.2f}' if of_ceiling else '-'} | "
                     f"{f'{1e3 * overhead:.0f} us' if overhead is not None else '-'} | {same} |")
    return lines + peer_lines(rows)


def peer_lines(rows: list[dict]) -> list[str]:
    """distributed-llama against its own one node, run by run, and halo's one node against the peer's."""
    peer = [r for r in rows if r["setup"] == "distributed-llama"]
    alone = {r["run"]: r["ms_mean"] for r in peer if r["nodes"] == 1}
    if not alone or len(alone) == len(peer):
        return []
    parts = []
    for n in nodes_of(rows):
        ratios = [alone[r["run"]] / r["ms_mean"] for r in peer if r["nodes"] == n and r["run"] in alone]
        if ratios:
            parts.append(f"{n} nodes {median(ratios):.2f}x ({', '.join(f'{v:.2f}' for v in ratios)})")
    one = one_node(rows)
    ours = [ms / one[run] for run, ms in alone.items()]
    return ["", f"distributed-llama against its own one node: {'; '.join(parts)}. halo's one node is "
                f"{median(ours):.2f}x as fast as the peer's."]


def nodes_of(rows: list[dict]) -> list[int]:
    return sorted({r["nodes"] for r in rows if r["nodes"] > 1})


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = one_node(result["rows"])
    ratios = {key: [speedup(r, one) for r in runs] for key, runs in by_setup(result["rows"]).items()
              if key[1] == 0.0 and key[2] != "one node"}
    setups = sorted({s for (_, _, s) in ratios}, key=lambda s: (s != "ceiling", "halo" in s, s))
    nodes = sorted({n for (n, _, _) in ratios})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(setups))
    for j, setup in enumerate(setups):
        at = [(i, ratios[(n, 0.0, setup)]) for i, n in enumerate(nodes) if (n, 0.0, setup) in ratios]
        ax.bar([i + j * width for i, _ in at], [median(v) for _, v in at], width, label=setup)
        for i, v in at:  # every run's ratio: the host's noise shows
            ax.plot([i + j * width] * len(v), v, "k.", ms=3)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + width * (len(setups) - 1) / 2 for i in range(len(nodes))], [f"{n} nodes" for n in nodes])
    ax.set_ylabel("speedup over one node of the same run (0 % loss)")
    ax.set_title(f"{result['host']['cpu']}, {result['host']['cores']} cores: a core set per node")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_arguments(args) -> None:
    if args.threads_per_node < 1 or not args.nodes or min(args.nodes) < 1:
        raise SystemExit("--nodes: node counts of 1 or more (e.g. 1,2); --threads-per-node: 1 or more")
    core_sets(max(args.nodes), args.threads_per_node)  # enough cores, or a clear exit
    if args.tokens < 8 or args.tokens + 2 > CONTEXT:
        raise SystemExit(f"--tokens: 8 to {CONTEXT - 2}")
    if args.runs < 1:
        raise SystemExit("--runs: 1 or more")
    from halo.scheduler.even import EVEN_PLANS, PAIRED_PLANS

    plans = (*EVEN_PLANS, *PAIRED_PLANS, "measured")
    if any(p not in plans for p in args.plans):
        raise SystemExit(f"--plans: any of {', '.join(plans)}")
    if any(b not in ("on", "off", "auto") for b in args.busy_poll):
        raise SystemExit("--busy-poll: any of on, off, auto")
    if any(not 0 <= p < 1 for p in args.plr) or (not args.bed and args.plr != [0.0]):
        raise SystemExit("--plr: loss rates in [0, 1), and only with --bed (loopback loses nothing)")
    if args.profile and not args.bed:  # (it ran on loopback and the results said profile wifi-busy)
        raise SystemExit("--profile: radio links are the test bed's; add --bed")
    if args.dllama and not os.access(args.dllama, os.X_OK):
        raise SystemExit(f"--dllama {args.dllama}: not an executable (build distributed-llama's `dllama` first)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser)
    parser.add_argument("--nodes", type=lambda s: [int(a) for a in s.split(",")], default=None,
                        help="node counts, comma-separated (default: 1, 2, 4, 8 as far as the cores go)")
    parser.add_argument("--threads-per-node", type=int, default=1, help="cores (and compute threads) a node (default 1)")
    parser.add_argument("--plans", type=lambda s: s.split(","), default=["even", "even-mlp-only"],
                        help="halo plans to run, comma-separated (default even,even-mlp-only)")
    parser.add_argument("--busy-poll", type=lambda s: s.split(","), default=["on", "off"],
                        help="busy-poll settings of master and agents to compare (default on,off)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--bed", action="store_true", help="run the cluster in the namespace test bed (needs root)")
    parser.add_argument("--plr", type=lambda s: [float(p) for p in s.split(",")], default=[0.0],
                        help="with --bed: loss rates on every link, comma-separated (default 0)")
    add_profile_argument(parser)
    parser.add_argument("--dllama", help="distributed-llama's dllama binary: run it alike in the same runs")
    parser.add_argument("--name", default="scaling")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if args.nodes is None:
        usable = len(os.sched_getaffinity(0)) // max(1, args.threads_per_node)
        args.nodes = [n for n in (1, 2, 4, 8, 16) if n <= usable]
    check_arguments(args)
    result = bench(args)
    write_report(args.out, args.name, result, render(result))
    plot(result, Path(args.out) / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
