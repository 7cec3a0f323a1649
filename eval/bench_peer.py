"""halo against distributed-llama, the C++ peer, interleaved in one run on the namespace test bed, and against
llama.cpp's RPC backend where --llamacpp names a build of it.

    python -m halo.eval.bench_peer --dllama /path/to/distributed-llama/dllama [--llamacpp /path/to/llama.cpp/build/bin]
        [--plr 0,0.02,0.05] [--runs 2]

The same weights on both sides: the TinyLlama-1.1B-shaped random GGUF of the other speed benchmarks (Q4_0,
--weights native) and the very same quantized blocks in the peer's own file format (eval/dllama_files.py).
Master + 3 agents against root + 3 workers (the peer splits every layer over all nodes and syncs over TCP),
one compute thread each, every link losing --plr of its frames both ways (rpi/testbed.py). Per run, in
this order: each system alone (no network), then per PLR every halo mode and the peer twice: with
`--net-turbo 0` (blocking sockets: its faster setting at low loss on this 2-core machine, where four
busy-waiting processes share two cores) and with its default (non-blocking sockets, busy-waiting); with
--llamacpp, llama.cpp's RPC backend: an rpc-server on every node (master and agents), llama-bench on the master
offloading every layer to them (llama.cpp splits by layers: a pipeline over TCP), on the very same GGUF.

A token's time: halo's, as the speed benchmark measures it (wall time of one forward pass); the peer's, as the
wall time between two of its per-token lines (it prints and flushes one after every token), so both
include everything a token costs. The first WARMUP tokens of each are left out. llama.cpp's: llama-bench's own
timing of its generated tokens (after its warm-up token), over the same count.

Build the peers from their repositories (`make dllama`, CPU only; llama.cpp with `cmake -DGGML_RPC=ON`, its
rpc-server needing `-t` for one thread: upstream has it, older trees take a two-line patch); this benchmark does not
download or build them.
Needs root for the test bed. Writes eval/results/NAME.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from halo.eval.bench_halo_speed import add_profile_argument, profile_sentence, MODES, PLANS, WARMUP, Cluster, agents_at_work, cell, median_runs, mode_settings, run_master, summarize, with_testbed
from halo.eval.random_checkpoint import TINYLLAMA_1_1B
from halo.eval.report import command_line, host_line, run_script, write_report



@dataclass(frozen=True)
class PeerSetting:
    """One way of running the peer: a worker set of its own (a worker keeps the setting it was started with)."""

    name: str
    port: int
    turbo: str  # --net-turbo: "1" busy-waits on non-blocking sockets (its default), "0" blocks


PEER_SETTINGS = (PeerSetting("dllama", 9990, "0"), PeerSetting("dllama turbo", 9991, "1"))
CONTEXT = 256  # positions both systems are given (halo's bench masters use 256)
PEER_PROMPT = "hello"  # its tokenizer: <s> and 5 characters
PEER_TOKEN_LINE = re.compile(r"Pred\s*(\d+) ms Sync\s*(\d+) ms")
WORK = Path(tempfile.gettempdir()) / "halo-bench-peer"  # halo's model beside its predictors
LLAMACPP = "llama.cpp rpc"  # llama.cpp's RPC backend: its layers split over an rpc-server on every node (a pipeline)
LLAMACPP_PORT = 50052
ALONE = {"halo": "halo single process", "dllama": "dllama single process", "llama.cpp": "llama.cpp single process"}


def peer_files(layers: int) -> tuple[Path, Path]:
    """The peer's model and tokenizer for the benchmark GGUF's weights (written once, ~0.8 GB)."""
    from halo.eval.dllama_files import write_model, write_tokenizer

    cfg = {**TINYLLAMA_1_1B, "num_hidden_layers": layers}
    model = Path(tempfile.gettempdir()) / f"halo-bench-tinyllama-{layers}L-dllama-q40.m"
    tokenizer = model.with_suffix(".t")
    if not model.exists():
        partial = model.with_suffix(".partial")
        write_model(partial, cfg)
        partial.rename(model)
        os.sync()  # its 0.8 GB written back now, not during the first timed runs
    write_tokenizer(tokenizer, cfg["vocab_size"])
    return model, tokenizer


class BedServers:
    """A peer's servers in the test bed's namespaces, one per host, listening on one TCP port. A server serves one
    client at a time and listens again when it sees the client leave; a client killed under loss may have its reset
    lost, and that server would wait for it forever (no keepalive): `ready` starts such a server again."""

    def __init__(self, bed, hosts: list[str], port: int, argv: Callable[[str], list[str]]):
        self.bed, self.hosts, self.port, self.argv = bed, hosts, port, argv
        self.processes: dict[str, subprocess.Popen] = {}
        for host in hosts:
            self._start(host)

    def _start(self, host: str) -> None:
        self.processes[host] = self.bed.popen(host, self.argv(host), stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL)

    def ready(self, wait_s: float = 10.0) -> None:
        """Every server listening; one that is not within wait_s is started again (once)."""
        waiting = self._not_listening(wait_s)
        for host in waiting:
            self.processes[host].kill()
            self.processes[host].wait(timeout=10)
            self._start(host)
        if waiting and self._not_listening(3 * wait_s):
            raise RuntimeError(f"{' '.join(self.argv(sorted(waiting)[0]))}: not listening on {sorted(waiting)}")

    def _not_listening(self, wait_s: float) -> set[str]:
        deadline = time.monotonic() + wait_s
        waiting = set(self.hosts)
        while True:
            waiting = {h for h in waiting if not self._listening(h)}
            if not waiting or time.monotonic() > deadline:
                return waiting
            time.sleep(0.2)

    def _listening(self, host: str) -> bool:
        out = self.bed.popen(host, ["ss", "-ltnH", f"sport = :{self.port}"], stdout=subprocess.PIPE,
                             text=True).communicate(timeout=10)[0]
        return bool(out.strip())

    def addresses(self) -> list[str]:
        return [f"{self.bed.address(host)}:{self.port}" for host in self.hosts]

    def close(self) -> None:
        for p in self.processes.values():
            p.kill()
        for p in self.processes.values():
            p.wait(timeout=10)


def peer_workers(bed, binary: Path, n: int) -> dict[str, BedServers]:
    """distributed-llama's workers in the agents' namespaces, one set per setting (a worker keeps the setting it was
    started with)."""
    agents = [f"agent-{i}" for i in range(1, n + 1)]
    sets = {s.name: BedServers(bed, agents, s.port, lambda host, s=s: [
        str(binary), "worker", "--port", str(s.port), "--nthreads", "1", "--net-turbo", s.turbo]) for s in PEER_SETTINGS}
    for servers in sets.values():
        servers.ready()
    return sets


class PeerStalled(RuntimeError):
    """The peer's root produced no timed token before the watchdog or the deadline (a lossy link can stall its
    blocking TCP sockets for minutes): recorded as such, not as a time."""

    def __init__(self, short: str, detail: str):
        super().__init__(detail)
        self.short = short


def run_peer(bed, binary: Path, model: Path, tokenizer: Path, workers: list[str], turbo: str, tokens: int,
             time_limit: float, threads: int = 1, stall_s: float = 600.0) -> dict:
    """The peer's root in the master's namespace (bed: anything with the test bed's popen(host, argv, **kwargs)):
    greedy steps from PEER_PROMPT, each token's wall time from the arrival of its line; stopped once time_limit has
    passed with 8 tokens timed."""
    steps = len(PEER_PROMPT) + 1 + WARMUP + tokens  # its steps count the prompt's positions
    argv = [str(binary), "inference", "--model", str(model), "--tokenizer", str(tokenizer), "--buffer-float-type",
            "q80", "--nthreads", str(threads), "--prompt", PEER_PROMPT, "--steps", str(steps), "--temperature", "0",
            "--max-seq-len", str(CONTEXT), "--net-turbo", turbo]
    if workers:
        argv += ["--workers", *workers]
    p = bed.popen("master", argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                  encoding="utf-8", errors="replace")  # its lines carry emoji
    started = time.monotonic()
    watchdog = threading.Timer(time_limit + stall_s, p.kill)  # a root that hangs (its sockets wait forever) ends here
    watchdog.start()
    arrivals, reported, tail = [], [], []
    deadline = time.monotonic() + time_limit + 120.0  # loading the model comes first
    try:
        for line in p.stdout:
            tail = (tail + [line])[-20:]
            found = PEER_TOKEN_LINE.search(line)
            if found:
                arrivals.append(time.perf_counter())
                reported.append(int(found[1]) + int(found[2]))
                if len(arrivals) == WARMUP + 1:
                    deadline = time.monotonic() + time_limit
                if time.monotonic() > deadline and len(arrivals) > WARMUP + 8:
                    break
            elif time.monotonic() > deadline:
                break
    finally:
        watchdog.cancel()
        p.kill()
        p.wait(timeout=30)
    times = np.diff(arrivals)[WARMUP:]  # the first line's token also waited for the prompt
    if len(times) == 0:
        raise PeerStalled(f"no timed token within {time.monotonic() - started:.0f} s ({len(arrivals)} lines)",
                          f"the peer generated no timed tokens ({' '.join(argv)}):\n{''.join(tail)}")
    return {"ms_per_token": [1e3 * t for t in times], "reported_ms": reported[WARMUP + 1:]}


@dataclass(frozen=True)
class DllamaFiles:
    """distributed-llama's binary and its files of the benchmark's weights."""

    binary: Path
    model: Path
    tokenizer: Path


def bench(args) -> None:
    from halo.eval.bench_churn import q4_with_predictors
    from halo.transport.reliable import generate_key

    dllama = None
    if args.dllama:
        binary = Path(args.dllama).resolve()
        if not binary.is_file():
            raise SystemExit(f"--dllama {args.dllama}: no such file (build it: git clone distributed-llama; make dllama)")
        dllama = DllamaFiles(binary, *peer_files(args.layers))
    model = q4_with_predictors(WORK / f"{args.layers}L", args.layers)  # the weights peer_files gives the peer
    modes = args.modes.split(",")
    rows, stalled = [], []  # stalled: the peers' settings that timed no token (PeerStalled)
    partial = Path(args.out) / f"{args.name}.partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)

    def add(row: dict) -> None:
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("generated", "ms_per_token")}), flush=True)
        partial.write_text(json.dumps(rows, indent=1))  # an interrupted run keeps its rows

    with tempfile.TemporaryDirectory() as tmp, with_testbed(args.agents, args.profile) as bed:
        key = Path(tmp) / "cluster.key"
        generate_key(key)
        cluster = Cluster(bed, model, key, args.agents)
        peers = {}
        try:
            if dllama:
                peers = peer_workers(bed, dllama.binary, args.agents)
            if args.llamacpp:
                peers[LLAMACPP] = llamacpp_servers(bed, Path(args.llamacpp), args.agents)
            for run in range(args.runs):  # interleaved: every configuration sees the machine's drift
                bed.set_loss(0.0)
                add({"system": "halo", "sync": ALONE["halo"], "plr": 0.0, "run": run,
                     **summarize(run_master(bed, model, key, [], "single", args.tokens, {}, args.time_limit))})
                if dllama:
                    add_dllama(args, bed, dllama, None, 0.0, run, add, stalled)
                if args.llamacpp:
                    add_llamacpp(args, bed, None, model, 0.0, run, add, stalled)
                for plr in [float(p) for p in args.plr.split(",")]:
                    bed.set_loss(plr)
                    for mode in modes:
                        sync, settings, plan = mode_settings(mode, args)
                        result = run_master(bed, model, key, cluster.endpoints, sync, args.tokens, settings,
                                            args.time_limit, "native", plan)
                        add({"system": "halo", "sync": mode, "plr": plr, "run": run, **summarize(result)})
                    for setting in PEER_SETTINGS if dllama else ():
                        add_dllama(args, bed, dllama, (setting, peers[setting.name]), plr, run, add, stalled)
                    if args.llamacpp:
                        add_llamacpp(args, bed, peers[LLAMACPP], model, plr, run, add, stalled)
        finally:
            for servers in peers.values():
                servers.close()
            cluster.close()
    for r in rows:
        r["agents"] = args.agents  # median_runs groups by (agents, PLR, sync)
    medians = median_runs(rows)
    lines = render(medians, modes, args, stalled)
    write_report(args.out, args.name, {"command": command_line("halo.eval.bench_peer", args.argv), "host": host_line(),
                                        "model": str(model), "peer_model": str(dllama.model) if dllama else None,
                                        "runs": args.runs, "rows": medians, "every_run": rows, "stalled": stalled},
                 lines)
    plot(medians, modes, args, Path(args.out) / f"{args.name}.png")
    partial.unlink(missing_ok=True)


def add_dllama(args, bed, files: DllamaFiles, workers: tuple[PeerSetting, BedServers] | None, plr: float, run: int,
               add, stalled: list) -> None:
    """One distributed-llama row: alone (workers None) or over one setting's workers; a run that times no token
    is recorded as stalled, and the benchmark goes on."""
    name, turbo = (ALONE["dllama"], "0") if workers is None else (workers[0].name, workers[0].turbo)
    if workers is not None:
        workers[1].ready()
    try:
        result = run_peer(bed, files.binary, files.model, files.tokenizer, [] if workers is None else
                          workers[1].addresses(), turbo, args.tokens, args.time_limit, stall_s=args.peer_stall)
    except PeerStalled as e:  # a row of its own: the run goes on with the others
        print(f"{name} at {100 * plr:g} %: {e}", file=sys.stderr, flush=True)
        stalled.append({"sync": name, "plr": plr, "run": run, "why": e.short})
        return
    add({"system": "dllama", "sync": name, "plr": plr, "run": run, **peer_summary(result)})


def llamacpp_servers(bed, bin_dir: Path, n: int) -> BedServers:
    """llama.cpp's rpc-server on the master and every agent (one CPU thread each, as every system here gets): the
    client, on the master, splits the layers over all of them as halo splits them over master + agents."""
    hosts = ["master", *(f"agent-{i}" for i in range(1, n + 1))]
    servers = BedServers(bed, hosts, LLAMACPP_PORT, lambda host: [
        str(bin_dir / "rpc-server"), "-H", bed.address(host), "-p", str(LLAMACPP_PORT), "-t", "1"])
    servers.ready()
    return servers


def run_llamacpp(bed, bin_dir: Path, model: Path, servers: list[str], tokens: int, timeout_s: float) -> dict:
    """llama-bench in the master's namespace: `tokens` greedy tokens after its own one-token warm-up, on one thread
    (servers empty) or over the rpc-servers (every layer offloaded to them). Its whole run, which sends every
    layer's weights to the servers first, is in wall_s."""
    argv = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(tokens), "-r", "1", "-t", "1",
            "-o", "json", "-ngl", "99" if servers else "0", *(["-rpc", ",".join(servers)] if servers else [])]
    started = time.monotonic()
    p = bed.popen("master", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate(timeout=30)
        raise PeerStalled(f"no result within {timeout_s:.0f} s", f"{' '.join(argv)}: no result in {timeout_s:.0f} s")
    wall = time.monotonic() - started
    try:
        result = json.loads(out)[0]
    except (ValueError, IndexError, KeyError):
        raise PeerStalled(f"failed (exit {p.returncode})", f"{' '.join(argv)} (exit {p.returncode}):\n"
                          f"{(out + err)[-2000:]}") from None
    per_token = [ns / result["n_gen"] / 1e6 for ns in result["samples_ns"]]
    return {"tokens": result["n_gen"], "ms_mean": float(np.mean(per_token)), "ms_median": float(np.median(per_token)),
            "wall_s": wall, "backends": result.get("backends")}


def add_llamacpp(args, bed, servers: BedServers | None, model: Path, plr: float, run: int, add, stalled: list) -> None:
    """One llama.cpp row: alone (servers None) or over its rpc-servers; a run that times out or fails is recorded
    as stalled, and the benchmark goes on."""
    name = ALONE["llama.cpp"] if servers is None else LLAMACPP
    if servers is not None:
        servers.ready()
    try:
        result = run_llamacpp(bed, Path(args.llamacpp), model, [] if servers is None else servers.addresses(),
                              args.tokens, args.time_limit + args.peer_stall)
    except PeerStalled as e:
        print(f"{name} at {100 * plr:g} %: {e}", file=sys.stderr, flush=True)
        stalled.append({"sync": name, "plr": plr, "run": run, "why": e.short})
        return
    add({"system": "llama.cpp", "sync": name, "plr": plr, "run": run, **result})


def peer_summary(result: dict) -> dict:
    """summarize's figures, and the mean of what the peer itself reported a token to take (its Pred + Sync)."""
    reported = result["reported_ms"]
    return {**summarize({"ms_per_token": result["ms_per_token"], "tokens": []}),
            "reported_ms_mean": float(np.mean(reported)) if reported else None}


def render(rows: list[dict], modes: list[str], args, stalled: list[dict] = ()) -> list[str]:
    by = {(r["plr"], r["sync"]): r for r in rows}
    stuck = {(s["plr"], s["sync"]): s["why"] for s in stalled}
    ran = {sync for _, sync in [*by, *stuck]}
    dllamas = [s.name for s in PEER_SETTINGS] if ran & {ALONE["dllama"], *(s.name for s in PEER_SETTINGS)} else []
    # each peer that ran: its columns, the head of its ratio column, its single process
    peers = [(cols, head, ALONE[key]) for cols, head, key in (
        (dllamas, "fastest dllama / fastest halo", "dllama"), ([LLAMACPP] if LLAMACPP in ran else [],
                                                              f"{LLAMACPP} / fastest halo", "llama.cpp")) if cols]
    columns = [*modes, *(c for cols, _, _ in peers for c in cols)]
    alone = {c: by.get((0.0, next((single for cols, _, single in peers if c in cols), ALONE["halo"])))
             for c in columns}
    lines = [*introduction(args, bool(dllamas), LLAMACPP in ran),
             "Alone (no network): " + ", ".join(f"{name} {cell(by.get((0.0, ALONE[key])))} ms" for key, name in
                                                (("halo", "halo"), ("dllama", "distributed-llama"),
                                                 ("llama.cpp", "llama.cpp")) if ALONE[key] in ran) + " per token.", "",
             "| PLR | " + " | ".join(f"{c} ms" for c in columns) + " | " + " | ".join(h for _, h, _ in peers) + " |",
             "|---|" + "---|" * (len(columns) + len(peers))]
    for plr in sorted({r["plr"] for r in rows if r["sync"] not in ALONE.values()} | {p for p, _ in stuck}):
        ours = [by[(plr, m)]["ms_mean"] for m in modes if (plr, m) in by]
        theirs = [[by[(plr, c)]["ms_mean"] for c in cols if (plr, c) in by] for cols, _, _ in peers]
        ratios = [f"{min(t) / min(ours):.2f}x" if ours and t else "-" for t in theirs]
        lines.append(f"| {100 * plr:g} % | " + " | ".join(
            cell(by.get((plr, c))) if (plr, c) not in stuck else stuck[plr, c] for c in columns) +
            f" | {' | '.join(ratios)} |")
    lines.append("")
    zero = {c: by.get((0.0, c)) for c in columns}
    if all(alone.values()):
        lines.append("At 0 % loss vs its own single process: " + ", ".join(
            f"{c} {zero[c]['ms_mean'] / alone[c]['ms_mean']:.2f}x" for c in columns if zero[c]) + ".")
    used = agents_at_work(rows, modes, args.agents)
    if used:
        lines.append(f"Agents halo's plan gave work to (the median runs): {used}.")
    worst = max(r["plr"] for r in rows)
    if worst > 0:
        lines.append(f"At {100 * worst:g} % vs its own 0 %: " + ", ".join(
            f"{c} {by[(worst, c)]['ms_mean'] / zero[c]['ms_mean']:.2f}x" for c in columns
            if zero[c] and (worst, c) in by) + ".")
    return lines + [""]


def introduction(args, dllama: bool, llamacpp: bool) -> list[str]:
    """The report's title and what its figures are."""
    peers = " and ".join(name for name, ran in (("distributed-llama", dllama), ("llama.cpp's RPC backend", llamacpp))
                         if ran)
    files = "; ".join(text for text, ran in (("distributed-llama: the same blocks in its Q40 file, the embedding "
                                              "unquantized", dllama), ("llama.cpp: the same GGUF", llamacpp)) if ran)
    return [f"# halo and {peers} side by side under real packet loss", "",
            f"Command: `{command_line('halo.eval.bench_peer', args.argv)}`. {host_line()} Namespace test bed: nftables "
            "drops every agent link's frames both ways with the given probability; 1 master/root + "
            f"{args.agents} agents/workers share this machine's 2 cores, one compute thread each"
            f"{profile_sentence(args.profile)}. The same weights: TinyLlama-1.1B shape with {args.layers} layers, "
            f"random, 4-bit (halo: the Q4_0 GGUF, --weights native; {files}), greedy. Mean wall ms per output token "
            f"over up to {args.tokens} tokens after {WARMUP} warm-up tokens. halo plan `{args.plan}`." + (
                " `dllama` is the peer with `--net-turbo 0` (blocking sockets), `dllama turbo` its default "
                "(busy-waiting sockets)." if dllama else "") + (
                f" `{LLAMACPP}`: llama-bench on the master with every layer offloaded to an rpc-server on each of "
                f"the {args.agents + 1} nodes (one thread each; layers split evenly: a pipeline, one node at a time), "
                "its mean ms per token over the same count after its own warm-up; its weights cross the links at "
                "start (not in the token time)." if llamacpp else "") + (
                f" Every configuration ran {args.runs} times, interleaved: a cell is the median run (the faster "
                "of two; every run in parentheses)." if args.runs == 2 else
                f" Every configuration ran {args.runs} times, interleaved: a cell is the median run (every run in "
                "parentheses)." if args.runs > 2 else ""), ""]


def plot(rows: list[dict], modes: list[str], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in [*modes, *(s.name for s in PEER_SETTINGS), LLAMACPP]:
        points = sorted((r["plr"], r["ms_mean"]) for r in rows if r["sync"] == c)
        ax.plot([100 * p for p, _ in points], [v for _, v in points], marker="o",
                label=f"halo {c}" if c in modes else c, linestyle="-" if c in modes else "--")
    for r in rows:
        if r["sync"] in ALONE.values():
            ax.axhline(r["ms_mean"], color="black" if r["system"] == "halo" else "gray", linestyle=":",
                       label=r["sync"])
    ax.set_yscale("log")
    ax.set_xlabel("packet loss rate on every link (%)")
    ax.set_ylabel("ms per output token")
    ax.set_title(f"TinyLlama-1.1B shape ({args.layers} layers), 4-bit, {args.agents + 1} nodes on 2 cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def check_arguments(args) -> None:
    """What the peer or the bench cannot run, refused before anything starts (SystemExit with the fix)."""
    if not (getattr(args, "dllama", None) or getattr(args, "llamacpp", None)):
        raise SystemExit("name a peer to run beside halo: --dllama PATH (distributed-llama), --llamacpp DIR "
                         "(llama.cpp's RPC backend) or both")
    kv_heads = TINYLLAMA_1_1B["num_key_value_heads"]
    if args.agents < 1 or (args.dllama and kv_heads % (args.agents + 1)):
        raise SystemExit(f"--agents {args.agents}: distributed-llama splits the model's {kv_heads} KV heads evenly over its nodes, "
                         f"so master + agents must divide {kv_heads} (--agents 1 or 3; at least 1)")
    unknown = [m for m in args.modes.split(",") if m.partition("@")[0] not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown halo sync mode(s) {', '.join(unknown)} (choose from {', '.join(MODES)})")
    for mode in args.modes.split(","):  # a variant --variants does not define stops here, not mid-run
        mode_settings(mode, argparse.Namespace(**{"settings": "{}", "variants": "{}", "plan": "even-mlp-only",
                                                  **vars(args)}))
    try:
        plrs = [float(p) for p in args.plr.split(",")]
    except ValueError:
        raise SystemExit(f"--plr {args.plr!r}: give loss rates as fractions, comma-separated (e.g. 0,0.02,0.05)") from None
    if not all(0.0 <= p < 1.0 for p in plrs):
        raise SystemExit(f"--plr {args.plr}: every loss rate must lie in [0, 1) (0.05 is 5 %)")
    if getattr(args, "llamacpp", None):
        missing = [tool for tool in ("rpc-server", "llama-bench") if not (Path(args.llamacpp) / tool).is_file()]
        if missing:
            raise SystemExit(f"--llamacpp {args.llamacpp}: no {' or '.join(missing)} there (build llama.cpp with "
                             "cmake -DGGML_RPC=ON, then --target rpc-server llama-bench; give its bin directory)")
    most = CONTEXT - len(PEER_PROMPT) - 2 - WARMUP
    if not 8 <= args.tokens <= most:
        raise SystemExit(f"--tokens {args.tokens}: between 8 and {most} (both systems get {CONTEXT} positions)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Build the peer first (CPU only): git clone https://github.com/b4rtaz/"
                                            "distributed-llama && make -C distributed-llama dllama",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dllama", help="distributed-llama's dllama binary (--dllama, --llamacpp or both)")
    parser.add_argument("--llamacpp", metavar="DIR", help="a llama.cpp build's bin directory with rpc-server and "
                        "llama-bench (cmake -DGGML_RPC=ON): llama.cpp's RPC backend on the same GGUF, in the same run")
    parser.add_argument("--agents", type=int, default=3, help="agents (halo) and workers (the peer) besides the "
                                                              "master/root (default 3; the peer takes at most as many "
                                                              "nodes as the model has KV heads: 4)")
    parser.add_argument("--plr", default="0,0.02,0.05", help="packet loss rates, comma-separated (default 0,0.02,0.05)")
    add_profile_argument(parser)
    parser.add_argument("--modes", default="exact,halo", help="halo sync modes (default exact,halo); MODE@NAME runs "
                        "MODE with the SyncSettings of --variants' NAME, e.g. --modes exact,exact@twice --variants "
                        "'{\"twice\": {\"copies\": 2}}'")
    parser.add_argument("--variants", default="{}", help="named SyncSettings overrides for --modes (JSON)")
    parser.add_argument("--settings", default="{}", help="SyncSettings fields for every halo cluster run (JSON)")
    parser.add_argument("--plan", default="even-mlp-only", choices=PLANS, help="halo's plan (bench_halo_speed "
                                                                               "--plan; default even-mlp-only)")
    parser.add_argument("--layers", type=int, default=22, help="layers of the TinyLlama-shaped model both run "
                                                                 "(default 22, all of them)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=1, help="run every configuration this many times, interleaved")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds of timed tokens per run, at most")
    parser.add_argument("--peer-stall", type=float, default=600.0, metavar="S",
                        help="the peer's run is ended after --time-limit + S seconds and recorded as stalled if it "
                             "timed no token (on lossy links its blocking TCP can stall for minutes; default 600)")
    parser.add_argument("--name", default="peer_speed_tinyllama")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    check_arguments(args)
    from halo.rpi.testbed import available

    ok, why = available()
    if not ok:
        raise SystemExit(f"the test bed cannot run here: {why}")
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
