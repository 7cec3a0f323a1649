"""HALO mode speed under real packet loss, straggling agents, and the overlap ablation.

    python -m halo.eval.bench_halo_speed speed     [--agents 3,7] [--plr 0,0.01,0.02,0.05] [--tokens 32]
    python -m halo.eval.bench_halo_speed straggler [--tokens 300]
    python -m halo.eval.bench_halo_speed ablation  [--agents 3] [--plr 0.02]

speed (HALO Table I / Fig. 8 in kind): the namespace test bed (rpi/testbed.py: silent nftables loss on
every agent link, both directions), a TinyLlama-1.1B-shaped checkpoint with random weights cut to
--layers layers (all 22 would only make every run 5x longer on this 2-core machine: every sync
point behaves the same), untrained random predictors (their rankings are noise; speed does not
depend on them). The master and every agent run in their own namespaces; per (agents, PLR, sync
mode) a fresh master decodes --tokens tokens after a 6-token warm-up: time per output token.

straggler: stories260K over 4 local agents on loopback, no loss; one agent's CPU is cut to 5 % of a
core during every other 300 ms (cgroup v1 CFS quota, rpi/throttle.py). Time per output token and
accuracy (top-1 agreement with the single-process model, exact match of the greedy text) for
exact vs halo, against the same cluster without the straggler.

ablation (HALO Table VI in kind): halo mode with prediction/communication overlap and load/compute
overlap on or off, and the upper bound with neither prediction nor loading (static groups).

Needs root for the test bed and the cgroup (skips otherwise). Writes eval/results/halo_<what>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from halo.eval.report import command_line, host_line, run_script, write_report
from halo.generation.generate import prefill
from halo.runtime.local import module_command
from halo.scheduler.even import EVEN_PLANS

CHECKPOINT = Path(tempfile.gettempdir()) / "halo-bench-tinyllama"
MODES = ("tcp", "exact", "lossy", "halo", "halo-tcp")
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975]
WARMUP = 6  # tokens before timing: page tables of the memory-mapped weights, deadline estimates
ABLATIONS = {"no overlap": dict(pred_overlap=False, load_overlap=False),
             "Pred-Comm only": dict(pred_overlap=True, load_overlap=False),
             "Load-Comp only": dict(pred_overlap=False, load_overlap=True),
             "both (default)": dict(pred_overlap=True, load_overlap=True),
             "no prediction, no loading (upper bound)": dict(predict=False)}


def checkpoint(layers: int) -> Path:
    from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_llama, write_random_predictors

    path = CHECKPOINT.with_name(f"{CHECKPOINT.name}-{layers}L")
    if not (path / "predictors" / "manifest.json").exists():
        write_random_llama(path, {**TINYLLAMA_1_1B, "num_hidden_layers": layers})
        write_random_predictors(path)
    return path


# ---- the master, inside its namespace ------------------------------------------------------------------
def master(args) -> None:
    from halo.compute.transformer import Transformer
    from halo.distributed import cluster_model
    from halo.distributed.remote import ask_status
    from halo.model.loader import load_weights
    from halo.sync import SyncSettings
    from halo.transport.reliable import load_key

    started = time.perf_counter()
    weights = load_weights(args.model)
    fmt = resolved_format(args.weights, weights)
    prompt = long_prompt(args.prompt_tokens, weights.config.vocab_size) if args.prompt_tokens else PROMPT
    context = max(256, len(prompt) + args.tokens + WARMUP + 1)
    if args.sync == "single":
        single = Transformer(weights, fmt=fmt, max_seq_len=context)
        out = decode(single, args.tokens, args.time_limit, prompt=prompt)
        out["load_s"] = out.pop("started_s") - started
        print("RESULT " + json.dumps(out), flush=True)
        return
    sync = SyncSettings(mode=args.sync, **json.loads(args.settings))
    model = cluster_model(weights, args.endpoints.split(","), load_key(args.key), plan=args.plan, context=context,
                          timeout_s=60.0, hello_timeout_s=600.0, sync=sync, fmt=fmt)
    endpoints = args.endpoints.split(",")

    def agents_memory() -> list:  # budgets, group caches, storage reads
        answers = ask_status(endpoints, load_key(args.key), timeout_s=5.0)
        return [answers[e].get("memory") for e in endpoints]

    try:
        start = {}
        out = decode(model, args.tokens, args.time_limit, at_timed_start=lambda: start.update(memory=agents_memory()),
                     prompt=prompt)
        out["load_s"] = out.pop("started_s") - started
        out.update(sync=model.sync_report(), udp=[r.get("udp") for r in model.report()])
        out.update(agents_memory=agents_memory(), agents_memory_at_timed_start=start.get("memory"))
    finally:
        model.close()
    print("RESULT " + json.dumps(out), flush=True)


def resolved_format(fmt: str, weights) -> str:
    from halo.compute import linear

    return linear.resolve_format(fmt, weights) if hasattr(linear, "resolve_format") else fmt


def long_prompt(n: int, vocab_size: int) -> list[int]:
    """A prompt of n token ids, the same in every run (BOS, then a seeded draw from the vocabulary)."""
    return [1, *np.random.default_rng(0).integers(3, vocab_size, n - 1).tolist()]


def decode(model, tokens: int, time_limit: float, at_timed_start=None, prompt: list[int] = PROMPT) -> dict:
    """Greedy from a fixed prompt: WARMUP steps, then up to `tokens` timed ones (or until time_limit);
    at_timed_start(): called once, after the warm-up (untimed). Also when decoding started (perf_counter seconds:
    the model's load before it) and the prompt's pass (ms: the time to the first token)."""
    times, out = [], []
    deadline = time.monotonic() + time_limit
    started = time.perf_counter()
    logits = prefill(model, prompt)
    prefill_ms = 1e3 * (time.perf_counter() - started)
    for step in range(tokens + WARMUP):
        token = int(np.argmax(logits))
        out.append(token)
        if step == WARMUP and at_timed_start is not None:
            at_timed_start()
        t = time.perf_counter()
        logits = model.forward([token])
        if step >= WARMUP:
            times.append(time.perf_counter() - t)
        if time.monotonic() > deadline and len(times) >= 8:
            break
    return {"ms_per_token": [1e3 * t for t in times], "tokens": out, "prefill_ms": prefill_ms,
            "prompt_tokens": len(prompt), "started_s": started}


class Cluster:
    """N agents in the test bed's namespaces, listening on their namespace addresses."""

    def __init__(self, bed, model: Path, key: Path, n: int):
        from halo.distributed import AgentProcess, agent_command

        self.bed, self.processes = bed, []
        for i in range(1, n + 1):
            host = f"agent-{i}"
            argv = agent_command(f"tcp://{bed.address(host)}:7070", key, host, 1, model)
            self.processes.append(AgentProcess(host, argv, popen=lambda a, host=host, **kw: bed.popen(host, a, **kw)))
        self.endpoints = [p.wait_listening(60.0) for p in self.processes]

    def close(self) -> None:
        from halo.distributed import stop_processes

        stop_processes(self.processes)


def run_master(bed, model: Path, key: Path, endpoints: list[str], sync: str, tokens: int, settings: dict,
               time_limit: float, weights: str = "native", plan: str = "even", prompt_tokens: int = 0,
               preexec_fn=None, env: dict | None = None) -> dict:
    """sync "single": the single-process model, in the master's namespace (same machine, same weights).
    prompt_tokens: a prompt of that many tokens (0: the short fixed one); preexec_fn: run in the started process
    before the program (e.g. joining a memory cgroup); env: the master's environment (None: this one's)."""
    argv = [*module_command("halo.eval.bench_halo_speed"), "master", "--model", str(model), "--key", str(key),
            "--endpoints", ",".join(endpoints), "--sync", sync, "--tokens", str(tokens), "--weights", weights,
            "--settings", json.dumps(settings), "--time-limit", str(time_limit), "--plan", plan,
            "--prompt-tokens", str(prompt_tokens)]
    p = bed.popen("master", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn,
                  env=env)
    out, err = p.communicate(timeout=time_limit + 180)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"master failed ({sync}): {err[-2000:]}")


def summarize(result: dict) -> dict:
    ms = np.asarray(result["ms_per_token"])
    out = {"tokens": len(ms), "ms_mean": float(ms.mean()), "ms_median": float(np.median(ms)),
           "ms_p90": float(np.percentile(ms, 90)), "generated": result["tokens"],
           **{k: result[k] for k in ("load_s", "prefill_ms", "prompt_tokens") if k in result}}
    if "sync" in result:
        loss, breakdown = result["sync"]["loss"], result["sync"].get("breakdown", {})
        out.update(partials_dropped=loss["partials_dropped"], partials=loss["partials"],
                   dropped_for_loss=loss.get("dropped_for_loss"), dropped_late=loss.get("dropped_late"),
                   groups_dropped=loss["groups_dropped"], groups_offered_lossy=loss["groups_offered_lossy"],
                   round_overhead_ms=breakdown.get("round_overhead_ms"), per_token_ms=breakdown.get("per_token_ms"))
    if "udp" in result:  # one report per agent the plan gave work to (a measured plan may leave some out)
        out["agents_used"] = len(result["udp"])
    if result.get("udp"):  # the master's view of each agent's link: how its losses were recovered
        out["udp"] = [{k: u.get(k) for k in UDP_COUNTERS} for u in result["udp"] if u]
    return out


UDP_COUNTERS = ("chunks_expected", "chunks_recovered_parity", "chunks_recovered_nack", "chunks_missing", "nacks_sent",
                "nacks_answered", "resends", "observed_plr")


def with_testbed(n: int, profile: str | None = None, prefix: str = "hb"):
    """The namespace bed with n agents; `profile`: every agent's link emulated (rpi/links.py: ethernet, wifi-good,
    wifi-busy, wifi-bad), its loss in bursts on top of any --plr."""
    from halo.rpi.testbed import LossyTestbed

    return LossyTestbed(n_agents=n, prefix=prefix, links=profile)


def add_profile_argument(parser) -> None:
    """--profile for every benchmark that runs the namespace bed."""
    from halo.rpi.links import PROFILES

    parser.add_argument("--profile", choices=tuple(PROFILES), default=None,
                        help="emulate every agent's link (rpi/links.py: one-way delay, jitter, loss in bursts, rate; "
                             "wifi-busy: 5 +- 3 ms, 5 %% in bursts of ~5, 100 Mbit/s); default: the plain bed")


def profile_sentence(profile: str | None) -> str:
    """What a results file says of --profile (empty without one)."""
    from halo.rpi.links import PROFILES

    return "" if not profile else (f"; every agent link emulated as `{profile}` ({PROFILES[profile].describe()}; "
                                   "rpi/links.py)")


def speed(args) -> None:
    """Every sync mode under 0-5 % real loss, with the single-process time of the same weights in the same run."""
    from halo.transport.reliable import generate_key

    model = Path(args.model) if args.model else checkpoint(args.layers)
    modes = {m: mode_settings(m, args) for m in args.modes.split(",")}  # a bad variant stops here, not mid-run
    rows = []
    partial = Path(args.out) / f"{args.name}.partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "cluster.key"
        generate_key(key)
        for n in [int(a) for a in args.agents.split(",")]:
            with with_testbed(n, args.profile) as bed:
                cluster = None
                try:
                    for run in range(args.runs):  # interleaved: every configuration sees the machine's drift
                        bed.set_loss(0.0)
                        single = run_master(bed, model, key, [], "single", args.tokens, {}, args.time_limit,
                                            args.weights, prompt_tokens=args.prompt_tokens)
                        rows.append({"agents": n, "plr": 0.0, "sync": "single process", "run": run,
                                     **summarize(single)})
                        print(json.dumps(rows[-1]), flush=True)
                        cluster = cluster or Cluster(bed, model, key, n)
                        for plr in [float(p) for p in args.plr.split(",")]:
                            bed.set_loss(plr)
                            for sync, (mode, settings, plan) in modes.items():
                                result = run_master(bed, model, key, cluster.endpoints, mode, args.tokens,
                                                    settings, args.time_limit, args.weights, plan,
                                                    prompt_tokens=args.prompt_tokens)
                                rows.append({"agents": n, "plr": plr, "sync": sync, "run": run, **summarize(result),
                                             "dropped_frames": bed.drop_counters()})
                                print(json.dumps(rows[-1]), flush=True)
                                partial.write_text(json.dumps(rows, indent=1))  # an interrupted run keeps its rows
                finally:
                    if cluster is not None:
                        cluster.close()
    medians = median_runs(rows)
    lines = render_speed(medians, args)
    write_report(args.out, args.name, {"command": command_line("halo.eval.bench_halo_speed", args.argv),
                                        "layers": args.layers, "weights": args.weights, "model": str(model),
                                        "runs": args.runs, "rows": medians, "every_run": rows}, lines)
    plot_speed(medians, Path(args.out) / f"{args.name}.png")
    partial.unlink(missing_ok=True)


def mode_settings(mode: str, args) -> tuple[str, dict, str]:
    """A --modes entry, 'exact' or 'exact@NAME' (NAME a --variants key), as its sync mode, SyncSettings fields and
    plan (a variant's "plan" key, else --plan)."""
    sync, _, variant = mode.partition("@")
    settings = json.loads(args.settings)
    if variant:
        variants = json.loads(args.variants)
        if variant not in variants:
            raise SystemExit(f"--modes names the variant {variant!r}, which --variants does not define "
                             f"({', '.join(variants) or 'none'})")
        settings = {**settings, **variants[variant]}
    plan = settings.pop("plan", args.plan)
    if plan not in PLANS:
        raise SystemExit(f"plan {plan!r}: the bench runs {', '.join(PLANS)}")
    return sync, settings, plan


def median_runs(rows: list[dict]) -> list[dict]:
    """Per (agents, PLR, mode): the run with the median time, with every run's time beside it."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["agents"], r["plr"], r["sync"]), []).append(r)
    out = []
    for runs in groups.values():
        ordered = sorted(runs, key=lambda r: r["ms_mean"])
        out.append({**ordered[(len(ordered) - 1) // 2], "ms_mean_runs": [round(r["ms_mean"], 1) for r in runs]})
    return out


PLANS = (*EVEN_PLANS, "measured")
PLAN_TEXT = {"measured": "Plan `measured` (what `halo-master` does by default): the agents' compute and links are "
                         "measured at connect and the scheduler plans from them; it may leave agents out, and the "
                         "table says how many took part.",
             "even": "Plan `even`: every block (attention heads, MLP and LM-head groups) in equal shares.",
             "even-mlp": "Plan `even-mlp`: every attention head on the master, the MLP and LM head in equal shares "
                         "(a token syncs once a layer).",
             "even-mlp-only": "Plan `even-mlp-only`: every attention head and the whole LM head on the master, the "
                              "MLP in equal shares (a token syncs once a layer, its logits never cross the network).",
             "paired-mlp": "Plan `paired-mlp`: every attention head and the whole LM head on the master, each "
                           "layer's MLP halved between the master and one agent, the agents taking the layers in turn "
                           "(a token syncs once a layer, each round engages two processes: what two cores run at "
                           "once)."}


def render_speed(rows: list[dict], args) -> list[str]:
    by = {(r["agents"], r["plr"], r["sync"]): r for r in rows}
    modes = args.modes.split(",")
    shape = f"{args.model}, " if args.model else f"TinyLlama-1.1B shape, random weights, {args.layers} layers, "
    lines = [f"# Time per output token under real packet loss ({shape}{args.weights} weights)", "",
             f"Command: `{command_line('halo.eval.bench_halo_speed', args.argv)}`. {host_line()} Namespace test bed: nftables drops "
             "every agent link's frames both ways with the given probability; master + agents share this machine's "
             f"2 cores, one compute thread each{profile_sentence(args.profile)}. Mean ms per output token over up to {args.tokens} greedy steps after "
             f"{WARMUP} warm-up steps; the single-process row runs the same weights in the master's namespace. "
             + PLAN_TEXT[args.plan] + (f" Every configuration ran {args.runs} times, interleaved: a cell is the median run (every run in "
                "parentheses), and the ratios compare median runs." if args.runs > 1 else "")
             + " `exact = exact at 0 %`: loss changed no token (exact recovers every datagram); `exact = single "
             "tokens`: a cluster equals one process only up to float summation order (docs/sync-modes.md), so greedy "
             "decoding may leave it at a near-tie, early on random weights, whose logits are nearly flat.", ""]
    for n in sorted({r["agents"] for r in rows}):
        base = by.get((n, 0.0, "single process"))
        lines += [f"## master + {n} agents (single process: {base['ms_mean']:.1f} ms/token)" if base else
                  f"## master + {n} agents", "",
                  "| PLR | " + " | ".join(f"{m} ms" for m in modes) + " | exact = tcp tokens | "
                  "exact = exact at 0 % | exact = single tokens | halo dropped (loss / late) | overhead per round p50 ms (exact) |",
                  "|---|" + "---|" * (len(modes) + 5)]
        for plr in sorted({r["plr"] for r in rows if r["agents"] == n and r["sync"] != "single process"}):
            cells = [cell(by.get((n, plr, m))) for m in modes]
            exact, tcp, halo = by.get((n, plr, "exact")), by.get((n, plr, "tcp")), by.get((n, plr, "halo"))
            drops = f"{halo['dropped_for_loss']} / {halo['dropped_late']}" if halo else "-"
            overhead = (exact or {}).get("round_overhead_ms") or {}
            lines.append(f"| {100 * plr:g} % | " + " | ".join(cells) + f" | {agreement(exact, tcp)} | {agreement(exact, by.get((n, 0.0, 'exact')))} | {agreement(exact, base)} | "
                         f"{drops} | {overhead.get('p50', '-')} |")
        lines.append("")
        zero = {m: by.get((n, 0.0, m)) for m in modes}
        worst = max(r["plr"] for r in rows if r["agents"] == n)
        ratios = []
        for m in modes:
            if zero[m] and by.get((n, worst, m)):
                ratios.append(f"{m} {by[(n, worst, m)]['ms_mean'] / zero[m]['ms_mean']:.2f}x")
        if base:
            lines.append("At 0 % loss vs single process: " + ", ".join(
                f"{m} {zero[m]['ms_mean'] / base['ms_mean']:.2f}x" for m in modes if zero[m]) + ".")
        lines.append(f"At {100 * worst:g} % vs its own 0 %: " + ", ".join(ratios) + ".")
        used = agents_at_work([r for r in rows if r["agents"] == n], modes, n)
        if used:
            lines.append(f"Agents the plan gave work to: {used}.")
        lines += [""] + recovery_table([r for r in rows if r["agents"] == n and r.get("udp") and r["plr"] > 0], modes)
    return lines


def agents_at_work(rows: list[dict], modes: list[str], n: int) -> str | None:
    """'exact 1 of 3, halo 0 or 1 of 3': how many of the n agents each mode's runs gave work to (a measured plan may
    leave some out); None when every run used all n."""
    used = {m: sorted({r["agents_used"] for r in rows if r["sync"] == m and "agents_used" in r}) for m in modes}
    if not any(u and u != [n] for u in used.values()):
        return None
    return ", ".join(f"{m} {' or '.join(map(str, u))} of {n}" for m, u in used.items() if u)


def recovery_table(rows: list[dict], modes: list[str]) -> list[str]:
    """How the UDP modes got their lost datagrams back (the master's counters, whole run: prompt and warm-up too)."""
    if not rows:
        return []
    lines = ["Recovery of lost datagrams over each whole run (the master's counters, prompt and warm-up included): "
             "chunks rebuilt from parity, NACKs the master sent for partials / agents sent for inputs, and all NACKs "
             "per forward pass.", "", "| PLR | mode | rebuilt from parity | NACKs master / agents | NACKs per forward pass |",
             "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["plr"], modes.index(r["sync"]) if r["sync"] in modes else 0)):
        udp = r["udp"]
        parity = sum(u.get("chunks_recovered_parity") or 0 for u in udp)
        master_nacks = sum(u.get("nacks_sent") or 0 for u in udp)
        agent_nacks = sum(u.get("nacks_answered") or 0 for u in udp)
        forwards = len(r["generated"]) + 1  # the prompt's pass, then one per generated token
        lines.append(f"| {100 * r['plr']:g} % | {r['sync']} | {parity} | {master_nacks} / {agent_nacks} | "
                     f"{(master_nacks + agent_nacks) / forwards:.2f} |")
    return lines + [""]


def cell(row: dict | None) -> str:
    """A table cell: the median run's ms/token, and every run's when there were several."""
    if row is None:
        return "-"
    runs = row.get("ms_mean_runs", [])
    return f"{row['ms_mean']:.1f}" + (f" ({', '.join(f'{t:.1f}' for t in runs)})" if len(runs) > 1 else "")


def agreement(a: dict | None, b: dict | None) -> str:
    """Do two runs' greedy tokens agree (over the steps both made: a slow mode may stop at the time limit)?"""
    if not (a and b):
        return "-"
    x, y = a["generated"], b["generated"]
    n = min(len(x), len(y))
    first = next((i for i in range(n) if x[i] != y[i]), None)
    if first is not None:
        return f"no: from token {first}"
    return "yes" if len(x) == len(y) else f"yes (the first {n})"


def plot_speed(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["agents"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    for ax, n in zip(axes[0], sizes):
        for m in sorted({r["sync"] for r in rows if r["agents"] == n and r["sync"] != "single process"}):
            points = sorted((r["plr"], r["ms_mean"]) for r in rows if r["agents"] == n and r["sync"] == m)
            ax.plot([100 * p for p, _ in points], [v for _, v in points], marker="o", label=m)
        single = [r["ms_mean"] for r in rows if r["agents"] == n and r["sync"] == "single process"]
        if single:
            ax.axhline(single[0], color="black", linestyle="--", label="single process")
        ax.set_yscale("log")
        ax.set_xlabel("packet loss rate on every agent link (%)")
        ax.set_ylabel("ms per output token")
        ax.set_title(f"master + {n} agents")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ablation(args) -> None:
    from halo.transport.reliable import generate_key

    model = checkpoint(args.layers)
    n, plr = int(args.agents.split(",")[0]), float(args.plr.split(",")[0])
    rows = []
    partial = Path(args.out) / f"{args.name}.partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "cluster.key"
        generate_key(key)
        with with_testbed(n, args.profile) as bed:
            cluster = Cluster(bed, model, key, n)
            try:
                bed.set_loss(plr)
                for repeat in range(args.repeats):
                    for name, settings in ABLATIONS.items():
                        result = run_master(bed, model, key, cluster.endpoints, "halo", args.tokens, settings,
                                            args.time_limit)
                        rows.append({"variant": name, "repeat": repeat, **summarize(result),
                                     "predict_ms": result["sync"].get("predict_ms"),
                                     "load_ms": result["sync"].get("load_ms")})
                        print(json.dumps(rows[-1]), flush=True)
            finally:
                cluster.close()
    lines = [f"# HALO overlap ablation ({n} agents, PLR {100 * plr:g} %, TinyLlama shape, {args.layers} layers)", "",
             f"Command: `{command_line('halo.eval.bench_halo_speed', args.argv)}`. Median over {args.repeats} "
             "runs of each variant's mean time per output token; the master's own prediction and load time per "
             "run.", "", "| variant | ms/token | vs both | master predict ms/token | master load ms/token |",
             "|---|---|---|---|---|"]
    med = {v: float(np.median([r["ms_mean"] for r in rows if r["variant"] == v])) for v in ABLATIONS}
    for v in ABLATIONS:
        sel = [r for r in rows if r["variant"] == v]
        per_token = lambda k: np.median([(r[k] or 0) / (r["tokens"] + WARMUP) for r in sel])  # noqa: E731
        lines.append(f"| {v} | {med[v]:.1f} | {med[v] / med['both (default)']:.2f}x | {per_token('predict_ms'):.2f} | "
                     f"{per_token('load_ms'):.2f} |")
    write_report(args.out, args.name, {"command": command_line("halo.eval.bench_halo_speed", args.argv),
                                             "rows": rows}, lines)


def straggler(args) -> None:
    from contextlib import ExitStack

    from halo.compute.transformer import Transformer
    from halo.distributed import LocalCluster
    from halo.model.loader import load_weights
    from halo.rpi.throttle import CpuThrottle

    weights = load_weights()
    reference = Transformer(weights, max_seq_len=512)
    ref_logits, token = [], 1
    ref_tokens = []
    for _ in range(args.tokens):
        logits = reference.forward([token])
        ref_logits.append(logits)
        token = int(np.argmax(logits))
        ref_tokens.append(token)
    rows = []
    for throttled, rebalance in ((False, False), (True, False), (False, True), (True, True)):
        for sync in ("exact", "halo"):
            with ExitStack() as stack:
                cluster = stack.enter_context(LocalCluster(4))
                model = _model_for(weights, cluster, sync, stack, rebalance)
                if throttled:
                    stack.enter_context(CpuThrottle(cluster.processes[1].pid, quota=0.05, period_s=0.3))
                times, agree, tokens, token = [], 0, [], 1
                for step in range(args.tokens):
                    t = time.perf_counter()
                    logits = model.forward([token])
                    times.append(time.perf_counter() - t)
                    agree += int(np.argmax(logits) == np.argmax(ref_logits[step]))
                    token = ref_tokens[step]  # teacher forcing: the same inputs for every setting
                    tokens.append(int(np.argmax(logits)))
                ms = 1e3 * np.asarray(times[2:])
                loss = model.sync_report()["loss"]
                replans = model.survival_report()["recoveries"] if rebalance else []
                rows.append({"straggler": throttled, "rebalance": rebalance, "sync": sync, "ms_mean": float(ms.mean()),
                             "ms_mean_second_half": float(ms[len(ms) // 2:].mean()), "replans": replans,
                             "ms_p90": float(np.percentile(ms, 90)), "top1_agreement": agree / args.tokens,
                             "partials_dropped": loss["partials_dropped"], "partials": loss["partials"]})
                print(json.dumps(rows[-1]), flush=True)
    by = {(r["straggler"], r.get("rebalance", False), r["sync"]): r for r in rows}
    lines = ["# A straggling agent: exact vs halo (stories260K, 4 local agents, no loss)", "",
             f"Command: `{command_line('halo.eval.bench_halo_speed', args.argv)}`. Agent 2's CPU is cut to 5 % of a "
             "core during every other 300 ms (cgroup v1). Inputs are teacher-forced with the single-process "
             "model's greedy tokens, so every setting sees the same sequence. 'Re-planned': the master re-plans "
             "from its running estimates (halo/distributed/survive.py, every 2 s once every device has 15 tokens "
             "of estimates, when the cost model predicts >= 20 % faster); the whole run's mean includes the "
             "tokens before the re-plan and the replay; its baseline is the same re-planning without the straggler "
             "(on this 2-core machine the estimates may show that fewer agents are faster even then). Partial "
             "sums dropped: counted since the last re-plan.", "",
             "| sync | straggler handling | ms/token, no straggler | ms/token, straggler (2nd half) | slowdown "
             "(2nd half) | p90 ms, straggler | top-1 agreement, straggler | partial sums dropped | re-plans |",
             "|---|---|---|---|---|---|---|---|---|"]
    for sync in ("exact", "halo"):
        for rebalance in (False, True):
            a, b = by[(False, rebalance, sync)], by[(True, rebalance, sync)]
            causes = "; ".join(f"{r['cause']} (agents after: {len(r['agents'])})" for r in b.get("replans", [])) or "-"
            lines.append(f"| {sync} | {'re-planned' if rebalance else 'deadline only'} | {a['ms_mean']:.2f} | "
                         f"{b['ms_mean']:.2f} ({b['ms_mean_second_half']:.2f}) | {b['ms_mean'] / a['ms_mean']:.2f}x "
                         f"({b['ms_mean_second_half'] / a['ms_mean_second_half']:.2f}x) | {b['ms_p90']:.2f} | "
                         f"{b['top1_agreement']:.3f} | {b['partials_dropped']}/{b['partials']} | {causes} |")
    write_report(args.out, args.name, {"command": command_line("halo.eval.bench_halo_speed", args.argv),
                                              "rows": rows}, lines)


def _model_for(weights, cluster, sync: str, stack, rebalance: bool = False):
    """An even plan over the local agents; rebalance: re-planned from the running estimates (survive.py)."""
    from halo.distributed import cluster_model, connect
    from halo.distributed.survive import SurvivalSettings
    from halo.sync import SyncSettings

    if rebalance:
        return connect(weights, stack, agents=cluster.endpoints, key=str(cluster.key_path), plan="even", context=512,
                       timeout=30.0, sync=SyncSettings(mode=sync), survive=SurvivalSettings(rebalance_every_s=2.0))
    model = cluster_model(weights, cluster.endpoints, cluster.key, context=512, timeout_s=30.0, sync=SyncSettings(mode=sync))
    stack.callback(model.close)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("speed", "straggler", "ablation", "master"))
    parser.add_argument("--agents", default="3,7", help="agents besides the master (default 3,7: 4 and 8 nodes)")
    parser.add_argument("--plr", default="0,0.01,0.02,0.05")
    add_profile_argument(parser)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--weights", default="int8", help="weight format of every device (default int8)")
    parser.add_argument("--name", help="results file name under --out (default halo_speed, halo_ablation or "
                        "halo_straggler)")
    parser.add_argument("--repeats", type=int, default=3, help="ablation: runs of every setting")
    parser.add_argument("--runs", type=int, default=1, help="speed: run every configuration this many times, "
                        "interleaved (the machine drifts between runs); the table shows the median run and each one")
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--out", default="eval/results")
    # the master process (internal)
    parser.add_argument("--model")
    parser.add_argument("--key")
    parser.add_argument("--endpoints")
    parser.add_argument("--sync", default="exact")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="a prompt of this many tokens in every run (0: "
                        "the short fixed one, whose ids a small vocabulary such as stories260K's lacks)")
    parser.add_argument("--settings", default="{}", help="SyncSettings fields as JSON for every cluster run of speed "
                        "and master, e.g. '{\"parity_group\": 8}'")
    parser.add_argument("--variants", default="{}", help="speed: named SyncSettings overrides that --modes entries "
                        "pick as MODE@NAME, to compare settings side by side in one run, e.g. --modes "
                        "exact,exact@xor --variants '{\"xor\": {\"parity_group\": 4, \"parity_chunks\": 1}}'; "
                        "a \"plan\" key picks that variant's plan")
    parser.add_argument("--plan", default="even", choices=PLANS, help="how the cluster runs share the "
                        "model: 'even' (equal shares of every block), 'even-mlp' (every attention head on the "
                        "master, equal shares of the rest: one sync round a layer), 'even-mlp-only' (the LM head "
                        "on the master too), 'paired-mlp' (as even-mlp-only, each layer's MLP halved between the "
                        "master and one agent in turn) or 'measured' (the scheduler's plan from measured agents and "
                        "links, halo-master's default: it may leave agents out)")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    args.name = args.name or {"ablation": "halo_ablation", "straggler": "halo_straggler"}.get(args.what, "halo_speed")
    if args.what in ("ablation", "straggler"):  # (their own models and settings: these were ignored)
        given = [option for option, used in (("--model", args.model is not None), ("--weights", args.weights != "int8"),
                                             ("--plan", args.plan != "even"), ("--settings", args.settings != "{}"))
                 if used]
        if given:
            parser.error(f"{', '.join(given)}: speed and master options; {args.what} runs its own configuration")
    if args.what == "master":
        master(args)
        return 0
    if args.what in ("speed", "ablation"):
        from halo.rpi.testbed import available

        ok, why = available()
        if not ok:
            print(f"skipped: {why}")
            return 0
    if args.what == "straggler":
        from halo.rpi.throttle import available

        ok, why = available()
        if not ok:
            print(f"skipped: {why}")
            return 0
    {"speed": speed, "straggler": straggler, "ablation": ablation}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
