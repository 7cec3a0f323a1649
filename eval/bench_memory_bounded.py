"""Agents under memory limits (HALO's 8 GB Pi that cannot hold the model) and SD-card read rates.

    python -m halo.eval.bench_memory_bounded [--model tinyllama-q4] [--agents 3] [--modes exact,halo]
                                             [--limits 1.25,1.10] [--read-mbps 40] [--tokens 16] [--plr 0.05]

The namespace test bed (rpi/testbed.py; --plr: loss on every node's port, both directions, 0 % by default), the
master unlimited, every agent in its own cgroup-v1 memory group (rpi/limits.py) with its own copy of the model file. Per sync mode, first unlimited: each agent's
share is what its cgroup's charge grew by in exact mode (peak usage minus its usage idle before the hello: weights
as built, KV cache, buffers; what the limit counts, not the resident set, which also holds library pages other
cgroups were charged for). Then every agent limited to its idle usage + the mode's own runtime memory (HALO: its
predictors' onnxruntime sessions, as the agent measured loading them in its cgroup) + FACTOR x its share (--limits: share +
25 %, share + 10 %), the agent budgeting from what its cgroup leaves (its default budget). HALO mode re-maps
MLP groups per token: unlimited, an agent builds every candidate group of its layers (the whole MLP); limited, it
keeps what its budget allows (halo/compute/group_cache.py) and builds the rest when the predictors rank them onto it
(over lossy links: the groups crossing the critical cut; where every link is lossless nothing moves, see
halo/distributed/master.py's `_tiers`).

Storage: in the "page cache" rows each agent's copy and prepared groups are read into the host's page cache first
(storage as fast as memory, outside the agent's limit). --read-mbps adds rows with the agents' storage throttled
(blkio) after their copies are evicted from the page cache, with the load thread on and off (the prefetch
ablation): bytes read from the disk per token.

Reported per row: time per output token (median after a warm-up), vs unlimited in the same mode; the cgroup's
peak usage (page cache included) against its limit and OOM kills; the agent's peak resident set; per timed token:
groups built (HALO mode), bytes read from storage and major faults; partials dropped; whether the tokens equal the
unlimited run's (HALO mode drops partials that come too late, so a slow agent changes them). Writes
eval/results/<name>.{json,md}. Needs root (test bed, cgroups); skips otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from halo.eval.bench_churn import TINYLLAMA_Q4, add_model_argument
from halo.eval.bench_halo_speed import run_master, summarize
from halo.eval.report import command_line, host_line, run_script, write_report

WORK = Path(tempfile.gettempdir()) / "halo-memory-bounded"


def model_and_predictors(name: str) -> tuple[Path, Path]:
    """The model file the master reads and the predictors every agent ranks with."""
    if name == TINYLLAMA_Q4:
        from halo.eval.bench_churn import q4_with_predictors

        path = q4_with_predictors(WORK / "master")
        return path, path.parent / "predictors"
    from halo.model.loader import model_path
    from halo.predictors.store import predictors_path

    path = model_path(name)
    return path, predictors_path(path)


def agent_copies(model: Path, n: int) -> list[Path]:
    """Each agent's own copy of the model file (its page cache is its own), fingerprinted once (cached on disk, so an
    agent does not read the whole file again at start)."""
    from halo.model.loader import model_fingerprint

    copies = []
    for i in range(1, n + 1):
        copy = WORK / f"agent-{i}" / model.name
        if not copy.exists() or copy.stat().st_size != model.stat().st_size:
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model, copy)
        model_fingerprint(copy)
        copies.append(copy)
    return copies


def status_of(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _then(first, second):
    """A Popen preexec_fn that runs two (AgentProcess's own, then joining the cgroups)."""
    def both():
        if first is not None:
            first()
        second()
    return both


def prepared_root(copy: Path) -> Path:
    return copy.parent / "prepared"


def prepare_copies(copies: list[Path], weights: str) -> None:
    """`halo-agent prepare` for each agent's copy, into the agent's own directory (its own page cache)."""
    import subprocess

    from halo.compute.prepared import VERSION
    from halo.runtime.local import module_command

    def prepared(manifest: dict, copy: Path) -> bool:  # (agents' directories hold every model's copy and groups)
        return manifest.get("version") == VERSION and manifest.get("source") == str(copy)

    for copy in copies:
        if not any(prepared(json.loads(m.read_text()), copy) for m in prepared_root(copy).glob("*/manifest.json")):
            subprocess.run(module_command("halo.edge_agent", "prepare", "--model", str(copy), "--weights", weights),
                           env={**os.environ, "HALO_PREPARED_DIR": str(prepared_root(copy))}, check=True, timeout=3600)


def one_run(bed, args, model: Path, predictors: Path, copies: list[Path], key: Path, mode: str,
            limits_bytes: list[int | None], read_bps: float | None = None, settings: dict | None = None,
            master_bytes: int | None = None, prompt_tokens: int = 0, master_prepared: Path | None = None) -> dict:
    """Agents in fresh cgroups with these limits, one master decoding (in a cgroup of its own: limited to
    master_bytes, None unlimited; from a prompt of prompt_tokens tokens, 0: the short fixed one); what each used. Mode
    "halo+prepared": halo with each agent building re-mapped groups from its prepared directory (halo-agent prepare),
    and the master from master_prepared where given (None: from its model file)."""
    prepared = mode.endswith("+prepared")
    mode = mode.removesuffix("+prepared")
    from contextlib import ExitStack

    from halo.distributed import AgentProcess, agent_command, stop_processes
    from halo.rpi.limits import DeviceLimits, drop_cached, read_into_cache

    with ExitStack() as stack:
        limits, processes = [], []
        for i, (copy, limit) in enumerate(zip(copies, limits_bytes), start=1):
            host = f"agent-{i}"
            device = stack.enter_context(DeviceLimits(f"mb-{i}", limit, read_bps, copy))
            for file in [copy, *prepared_root(copy).glob("*/groups.bin")]:
                if read_bps is not None:  # nothing of the model in memory: the agent reads it from the "card"
                    drop_cached(file)
                else:  # storage as fast as memory: the host's page cache holds it (earlier rows had evicted it)
                    read_into_cache(file)
            # (a model without predictors runs exact mode: the agents are not told of a directory that is not there)
            argv = agent_command(f"tcp://{bed.address(host)}:7070", key, host, 1, copy,
                                 predictors if predictors.is_dir() else None)
            env = {**os.environ, "HALO_PREPARED_DIR": str(prepared_root(copy) if prepared else WORK / "none")}
            processes.append(AgentProcess(host, argv, popen=lambda a, host=host, device=device, env=env, preexec_fn=None,
                                          **kw: bed.popen(host, a, preexec_fn=_then(preexec_fn, device.join), env=env,
                                                          **kw)))
            limits.append(device)
        stack.callback(stop_processes, processes)
        master = stack.enter_context(DeviceLimits("mb-master", master_bytes))
        endpoints = [p.wait_listening(120.0) for p in processes]
        idle = [(status_of(p.pid)["VmRSS"], device.usage()["usage_bytes"]) for p, device in zip(processes, limits)]
        row = {"mode": mode + ("+prepared" if prepared else ""), "limits_bytes": limits_bytes, "read_bps": read_bps, "settings": settings or {}}
        try:
            result = run_master(bed, model, key, endpoints, mode, args.tokens, settings or {}, args.time_limit,
                                args.weights, prompt_tokens=prompt_tokens, preexec_fn=master.join,
                                env={**os.environ, "HALO_PREPARED_DIR": str(master_prepared or WORK / "none")})
            row.update(summarize(result))
            row["agents_memory"] = result.get("agents_memory")
            row["agents_memory_at_timed_start"] = result.get("agents_memory_at_timed_start")
            unprepared = [i for i, m in enumerate(row["agents_memory"] or [], start=1)
                          if prepared and not (m.get("group_cache") or {}).get("prepared")]
            if unprepared:  # (stop 31's TinyLlama rows were: another model's prepared groups were taken for these)
                raise RuntimeError(f"agents {unprepared} built their groups from the model file in a +prepared row")
        except (RuntimeError, OSError) as e:
            row["error"] = str(e).strip().splitlines()[-1][:400]
        row["master"] = master.usage()
        row["agents"] = []
        for p, device, (rss, usage) in zip(processes, limits, idle):
            agent = {"idle_rss_bytes": rss, "idle_usage_bytes": usage, **device.usage()}
            if p.poll() is None:
                agent["peak_rss_bytes"] = status_of(p.pid)["VmHWM"]
            else:
                agent["exit_code"] = p.returncode
            row["agents"].append(agent)
    return row


def run(args) -> None:
    from halo.rpi.testbed import LossyTestbed
    from halo.transport.reliable import generate_key

    model, predictors = model_and_predictors(args.model)
    copies = agent_copies(model, args.agents)
    modes = args.modes.split(",")
    if any(m.endswith("+prepared") for m in modes):
        prepare_copies(copies, args.weights)
    rows, partial = [], Path(args.out) / f"{args.name}.partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)

    def record(row: dict, **labels) -> dict:
        row.update(labels)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("generated", "agents_memory")}), flush=True)
        partial.write_text(json.dumps(rows, indent=1))
        return row

    with tempfile.TemporaryDirectory() as tmp, LossyTestbed(n_agents=args.agents, prefix="mb") as bed:
        key = Path(tmp) / "cluster.key"
        generate_key(key)
        bed.set_loss(args.plr)
        unlimited = list(dict.fromkeys(m.removesuffix("+prepared") for m in modes))  # unlimited, all built at start
        sizing = None
        for round_ in range(args.rounds):  # every configuration once per round, its ratio taken inside the round
            alone = run_master(bed, model, key, [], "single", args.tokens, {}, args.time_limit, args.weights,
                               prompt_tokens=args.prompt_tokens)
            record({"mode": SINGLE, **summarize(alone)}, limit="none", factor=None, round=round_)
            free = {m: record(one_run(bed, args, model, predictors, copies, key, m, [None] * args.agents,
                                      prompt_tokens=args.prompt_tokens),
                              limit="none", factor=None, round=round_) for m in unlimited}
            if sizing is None:  # the limits stay those of the first round's shares
                sizing = Sizing.of(free)

            def limited(m: str, factor: float, **settings) -> None:
                limit = sizing.limit(m, factor)
                record(one_run(bed, args, model, predictors, copies, key, m, limit, prompt_tokens=args.prompt_tokens,
                               **settings),
                       limit=f"share+{factor - 1:.0%}", factor=factor, shares_bytes=sizing.shares,
                       runtime_bytes=sizing.runtime_of(m), round=round_)

            for factor in [float(f) for f in args.limits.split(",")]:
                for m in modes:
                    limited(m, factor)
            if args.read_mbps:
                factor = float(args.limits.split(",")[0])
                for m in modes:
                    for overlap in ([True, False] if m.startswith("halo") else [True]):
                        limited(m, factor, read_bps=args.read_mbps * 1e6,
                                settings={} if overlap else {"load_overlap": False})
                        rows[-1].update(read_mbps=args.read_mbps, prefetch=overlap)
    lines = render(rows, args, model)
    write_report(args.out, args.name, {"command": command_line("halo.eval.bench_memory_bounded", args.argv),
                                        "model": str(model), "weights": args.weights, "agents": args.agents,
                                        "rows": rows}, lines)
    partial.unlink(missing_ok=True)


@dataclass
class Sizing:
    """What the limits are sized from, per agent, as its cgroup counts memory: its usage idle before the hello, its
    share (what its usage grew by in exact mode: weights as built, KV cache, buffers) and, per mode, the runtime's own memory the mode needs
    beyond the share (HALO: the predictors' onnxruntime sessions, as the agent measured loading them). A limit is
    idle + runtime + FACTOR x share: "share + 10 %" leaves every mode the same 10 % of its share."""

    idle: list[int]
    shares: list[int]
    runtime: dict[str, list[int]]

    @classmethod
    def of(cls, free: dict[str, dict]) -> "Sizing":
        base = free.get("exact") or next(iter(free.values()))
        runtime = {m: [(a or {}).get("predictors_bytes", 0) for a in (row.get("agents_memory") or [{}] * len(base["agents"]))]
                   for m, row in free.items()}
        return cls([a["idle_usage_bytes"] for a in base["agents"]],
                   [a["max_usage_bytes"] - a["idle_usage_bytes"] for a in base["agents"]], runtime)

    def runtime_of(self, mode: str) -> list[int]:
        return self.runtime.get(mode.removesuffix("+prepared"), [0] * len(self.idle))

    def limit(self, mode: str, factor: float) -> list[int]:
        return [int(i + r + factor * s) for i, r, s in zip(self.idle, self.runtime_of(mode), self.shares)]


SINGLE = "single process"  # the model in one process in the master's namespace, unlimited: the run's yardstick


def during_decoding(row: dict, field) -> float | None:
    """A cumulative agent counter summed over agents, from the end of the warm-up to the end: per timed token."""
    start, end = row.get("agents_memory_at_timed_start"), row.get("agents_memory")
    if not start or not end:
        return None
    values = [(field(a), field(b)) for a, b in zip(start, end) if a and b]
    if any(x is None or y is None for x, y in values):
        return None
    return sum(y - x for x, y in values) / max(1, row["tokens"])


def configuration(row: dict) -> tuple:
    return row["mode"], row["limit"], row.get("read_mbps"), row.get("prefetch")


def render(rows: list[dict], args, model: Path) -> list[str]:
    """One line per configuration: the median over rounds of its median ms/token, and of its ratio to the unlimited
    run of the same mode in the same round (the machine drifts between rounds); counters from its median round."""
    free = {(r.get("round", 0), r["mode"]): r for r in rows if r["limit"] == "none"}
    free.update({(k, m + "+prepared"): r for (k, m), r in list(free.items())})  # the same unlimited run
    one = {r.get("round", 0): r["ms_median"] for r in rows if r["mode"] == SINGLE}
    runs: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["mode"] != SINGLE:
            runs.setdefault(configuration(r), []).append(r)
    mb = 1e6
    lines = [f"# Agents under memory limits: {model.name}, master + {args.agents} agents", "",
             f"`{command_line('halo.eval.bench_memory_bounded', args.argv)}`. {host_line()}", "",
             f"Weights `{args.weights}`, {args.tokens} tokens after a warm-up, {args.plr:.0%} loss (every node's port, "
             "both directions), every agent in its own memory "
             "cgroup with its own model copy, the master unlimited. Share = what an agent's cgroup charge grew by in exact "
             "mode unlimited (peak usage minus idle usage); limit = idle usage + the mode's runtime memory (HALO: the "
             "predictors' sessions, as its cgroup counted them) + factor x share. Storage \"page cache\": "
             "each agent's model copy and prepared groups read into the host's page cache before the row (storage as "
             "fast as memory; outside the agent's limit); \"N MB/s\": evicted first and read through a blkio "
             "throttle. Per-token columns count "
             f"the timed tokens only (agents' counters after the warm-up and at the end), summed over the agents. "
             f"{args.rounds} round(s): every configuration once per round; ms/token is the median over rounds, the ratio "
             "the median of each round's ratio to that round's unlimited run (all rounds' ratios in brackets); the other "
             "columns are the median round's, but the last: in how many rounds the tokens equal that round's exact, "
             "unlimited run's (HALO mode gives them within rounding unless it dropped partials). vs one process: against "
             "the same round's " + (f"single process (the model alone in the master's namespace, unlimited, one thread: "
                                    f"{float(np.median(list(one.values()))):.0f} ms/token)" if one else "single process (not run)")
             + ".", "",
             "| mode | limit | storage | ms/token (median) | vs unlimited | vs one process | cgroup peak / limit (MB, max over agents) "
             "| OOM kills | agent peak RSS (MB) | groups built per token (in line) | storage MB read per token "
             "| major faults per token | partials dropped | tokens = exact unlimited (rounds) |", "|" + "---|" * 14]
    for (mode, limit_name, read_mbps, prefetch), group in runs.items():
        storage = f"{read_mbps:g} MB/s, prefetch {'on' if prefetch else 'off'}" if read_mbps else "page cache"
        done = [r for r in group if "error" not in r]
        if not done:
            lines.append(f"| {mode} | {limit_name} | {storage} | failed: {group[0]['error']} |" + " |" * 10)
            continue
        done.sort(key=lambda r: r["ms_median"])
        r = done[(len(done) - 1) // 2]
        agents = r["agents"]
        ratios = [x["ms_median"] / free[(x.get("round", 0), mode)]["ms_median"] for x in done
                  if (x.get("round", 0), mode) in free]
        ratio = "-" if not ratios else f"{float(np.median(ratios)):.2f}x" + (
            f" ({', '.join(f'{v:.2f}' for v in ratios)})" if len(ratios) > 1 else "")
        versus = [x["ms_median"] / one[x.get("round", 0)] for x in done if x.get("round", 0) in one]
        versus_one = f"{float(np.median(versus)):.2f}x" if versus else "-"
        peak = max(a["max_usage_bytes"] for a in agents) / mb
        limit = f"{max(a['limit_bytes'] for a in agents) / mb:.0f}" if agents[0]["limit_bytes"] else "none"
        rss = max(a.get("peak_rss_bytes", 0) for a in agents) / mb
        built = during_decoding(r, lambda m: m.get("group_cache", {}).get("prefetched", 0) + m.get("group_cache", {})
                                .get("stalls", 0) if m.get("group_cache") else 0)
        stalls = during_decoding(r, lambda m: m.get("group_cache", {}).get("stalls", 0))
        read = during_decoding(r, lambda m: m.get("storage_read_bytes"))
        faults = during_decoding(r, lambda m: m.get("major_faults"))
        show = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
        dropped = f"{r['partials_dropped']} of {r['partials']}" if r.get("partials") else "-"
        exact = [free.get((x.get("round", 0), "exact"), {}).get("generated") for x in done]
        same = f"{sum(x['generated'] == e for x, e in zip(done, exact) if e)} of {sum(1 for e in exact if e)}"
        lines.append(f"| {mode} | {limit_name} | {storage} | {float(np.median([x['ms_median'] for x in done])):.0f} | {ratio} "
                     f"| {versus_one} "
                     f"| {peak:.0f} / {limit} | {max(sum(a['oom_kills'] for a in x['agents']) for x in done)} | {rss:.0f} "
                     f"| {show(built)} ({show(stalls)}) | {show(None if read is None else read / mb)} "
                     f"| {show(faults, '{:.0f}')} | {dropped} | {same} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every configuration this many times, round by round, each ratio against the "
                             "unlimited run of its own round (this 2-core machine drifts +-20 %% over a run)")
    parser.add_argument("--modes", default="exact,halo,halo+prepared",
                        help="sync modes; halo+prepared: halo, agents building re-mapped groups from `halo-agent "
                             "prepare`d directories (unlimited, it is the halo row: everything is built at the start)")
    parser.add_argument("--limits", default="1.25,1.10", help="limit factors over each agent's share")
    parser.add_argument("--read-mbps", type=float, default=0.0, help="also rows with storage read at this rate")
    parser.add_argument("--weights", default="native")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=0, help="a prompt of this many tokens first (its pass "
                        "needs every MLP group of every layer; 0: a short fixed one)")
    parser.add_argument("--plr", type=float, default=0.0, help="packet loss on every node's port, both directions "
                        "(HALO mode keeps a layer's groups in place only where every agent's link is lossless)")
    parser.add_argument("--time-limit", type=float, default=300.0)
    parser.add_argument("--name", default="memory_bounded")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    from halo.rpi.limits import available as limits_available
    from halo.rpi.testbed import available

    for ok, why in (available(), limits_available(storage=bool(args.read_mbps))):
        if not ok:
            print(f"skipped: {why}")
            return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
