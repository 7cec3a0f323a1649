"""The scheduler's cost model against real runs, and measured plans against even and PLR-blind ones.

    python -m halo.eval.bench_cost_model [--tokens 16] [--ppl-tokens 1024] [--ppl-model NAME|PATH] [--out eval/results]

A heterogeneous cluster on the namespace test bed (rpi/testbed.py): the master and three agents, each in
its own network namespace, the agents' CPUs capped with cgroup v1 CFS quotas (100 / 50 / 25 % of a core,
4 ms accounting period), their links capped with tc tbf (200 / 100 / 50 Mbit/s, both ways) and losing
datagrams silently (nftables: 0 / 1 / 2 %). Three parts:

1. cost model (exact sync): the master profiles the cluster (halo/distributed/connect.py: kernel
   benchmarks on every device, link probes), then runs 20+ plans (Vanilla, Galaxy, Min-Max, Memory,
   Computation-Greedy, the default measured plan, Eq. 1's selection, the exact MILP of Eq. 1, Min-Max and
   Vanilla on every participant subset, random splits) for --tokens decode tokens each on a TinyLlama-
   width random checkpoint cut to 4 layers (random weights: speed does not depend on them). Predicted
   (cost.py) from the profile ("initial") and from the running estimates of the plan's own run
   ("running": compute speeds and link loss as observed) vs measured time per token: MAPE and Spearman's
   rank correlation; the default plan vs the even plan vs the best tried.
2. one lossy link (agent-1, the fastest, at 5 %, the others clean): the PLR-aware default plan vs the
   same planner told every link is clean (PLR-blind), time per token in exact, halo and tcp sync.
3. accuracy (stories260K with its trained predictors, the same lossy link, no CPU quotas: with them the
   25 % agent misses the deadline so often that straggling, not loss, decides what is dropped): every
   device takes part with an equal share (for stories260K a block's time is all overhead);
   perplexity on held-out text (the last 20 % of tinystories_valid_dev.txt, teacher-forced, one token
   per forward) in halo and lossy sync: PLR-aware vs PLR-blind rank ranges (Algorithm 3), and heads
   placed by importance vs by index. --ppl-model runs this part on another model (e.g. SmolLM2, with
   its predictors beside it) instead.

Needs root (namespaces, cgroups); skips otherwise. With at least 4 cores every device gets a core of its
own (the master core 0, agent i core i); with fewer they share them, and when several compute at once
they slow each other down, which no per-device profile can predict: run it on a quiet machine, with 4+
cores for numbers to quote. About 10 minutes. Writes eval/results/cost_model.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from halo.eval.accuracy_runtime import held_out_windows, teacher_forced
from halo.eval.report import command_line, run_script, write_report
from halo.runtime.local import module_command

CHECKPOINT = Path(tempfile.gettempdir()) / "halo-bench-costmodel-2048"
MODEL_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=32,
                   num_key_value_heads=4, vocab_size=8192, max_position_embeddings=512, rms_norm_eps=1e-5,
                   rope_theta=10000.0, tie_word_embeddings=False)
AGENTS = {"agent-1": dict(cpu=1.0, mbit=200, plr=0.0), "agent-2": dict(cpu=0.5, mbit=100, plr=0.01),
          "agent-3": dict(cpu=0.25, mbit=50, plr=0.02)}
LOSSY_LINK = {"agent-1": 0.05}
CFS_PERIOD_US = 4_000  # short (a 25 % quota is then the kernel's least, 1 ms): a capped agent is slow within every burst of work, as a slow CPU is
WARMUP = 4
PIN = (os.cpu_count() or 1) >= len(AGENTS) + 1  # every device on a core of its own where there are enough
CONTEXT = 256
DATA = next((p / "shared" / "data" / "tinystories_valid_dev.txt" for p in Path(__file__).resolve().parents[2:4]
             if (p / "shared" / "data" / "tinystories_valid_dev.txt").is_file()), None)


def checkpoint() -> Path:
    from halo.eval.random_checkpoint import write_random_llama, write_random_predictors

    if not (CHECKPOINT / "predictors" / "manifest.json").exists():
        write_random_llama(CHECKPOINT, MODEL_SHAPE)
        write_random_predictors(CHECKPOINT)  # halo sync runs on them (rankings are noise; speed is what counts)
    return CHECKPOINT


# ---- inside the master's namespace --------------------------------------------------------------------
def decode_ms(model, tokens: int) -> list[float]:
    """Milliseconds per decode step after a short prompt and WARMUP steps."""
    model.reset()
    logits = model.forward([1, 5, 9, 13])
    times = []
    for step in range(tokens + WARMUP):
        t = time.perf_counter()
        logits = model.forward([int(np.argmax(logits))])
        if step >= WARMUP:
            times.append(1e3 * (time.perf_counter() - t))
    return times


def candidate_plans(cluster, profile, mode: str, sync, seed: int = 0) -> list[tuple[str, object]]:
    """The plans to run: the paper's algorithms, the default, Eq. 1's selection and MILP, Min-Max on every
    participant subset, random splits; duplicates (same participants and counts) removed."""
    import itertools

    from halo.scheduler.milp import solve_exact
    from halo.scheduler.plan import TensorParallelPlan
    from halo.scheduler.ratios import InsufficientMemory
    from halo.scheduler.tp_plan import build_plan, plan_tp, round_counts

    plans = [("default (measured, PLR-aware)", plan_tp(cluster, profile, mode=mode, sync=sync)),
             ("Eq. 1 selection", plan_tp(cluster, profile))]
    for algorithm in ("vanilla", "galaxy", "minmax", "memory", "greedy"):
        plans.append((algorithm, build_plan(cluster, profile, algorithm)))
    exact = solve_exact(cluster, profile, time_limit_s=10.0)
    if exact.plan is not None:
        plans.append(("MILP (Eq. 1)" + ("" if exact.optimal else ", time limit"), exact.plan))
    others = [i for i in range(len(cluster.devices)) if i != cluster.master]
    for k in range(len(others)):
        for extra in itertools.combinations(others, k):
            subset = [cluster.master, *extra]
            names = "+".join(cluster.devices[i].name.split("#")[0] for i in extra) or "master alone"
            for algorithm in ("minmax", "vanilla"):
                try:
                    plans.append((f"{algorithm} on {names}", build_plan(cluster, profile, algorithm, subset)))
                except InsufficientMemory:
                    continue
    rng = np.random.default_rng(seed)
    devices = [cluster.master, *others]
    for r in range(6):
        ratios = rng.dirichlet(np.ones(len(devices)))
        counts = {k: round_counts(ratios, getattr(profile, k).count, profile.n_layers) for k in ("attention", "mlp")}
        counts["lm_head"] = round_counts(ratios, profile.lm_head.count, 1)[:, 0]
        plans.append((f"random split {r + 1}", TensorParallelPlan(cluster, profile, "random", devices, counts)))
    unique, seen = [], set()
    for name, plan in plans:
        key = (tuple(plan.devices), *(plan.counts[k].tobytes() for k in sorted(plan.counts)))
        if key not in seen:
            seen.add(key)
            unique.append((name, plan))
    return unique


def run_plan(weights, key, plan, settings: dict, tokens: int, heads: str = "index") -> tuple[list[float], object]:
    from halo.distributed import cluster_model

    model = cluster_model(weights, [d.address for d in plan.profiles()[1:]], key, plan=plan, heads=heads, **settings)
    try:
        return decode_ms(model, tokens), model.estimates
    finally:
        model.close()


def rebased(plan, cluster):
    from halo.scheduler.plan import TensorParallelPlan

    return TensorParallelPlan(cluster, plan.model, plan.algorithm, plan.devices, plan.counts)


def plan_row(name: str, plan, mode: str, sync, times: list[float], running_cluster=None) -> dict:
    from halo.scheduler.cost import estimate

    cost = estimate(plan, mode, sync=sync)
    row = {"plan": name, "participants": [plan.cluster.devices[i].name for i in plan.devices],
           "counts": {k: np.asarray(v).tolist() for k, v in plan.counts.items()},
           "predicted_ms": 1e3 * cost.total_s, "predicted": cost.to_json(),
           "measured_ms": float(np.mean(times)), "measured_ms_median": float(np.median(times)), "tokens": len(times)}
    if running_cluster is not None:
        row["predicted_running_ms"] = 1e3 * estimate(rebased(plan, running_cluster), mode, sync=sync).total_s
    return row


def master_settings(mode: str) -> dict:
    from halo.sync import SyncSettings

    return dict(context=CONTEXT, timeout_s=30.0, sync=SyncSettings(mode=mode))


def measured(weights, args, mode: str):
    from halo.compute.neuron_groups import GroupLayout
    from halo.distributed.connect import measure_cluster
    from halo.distributed.session import MasterSettings
    from halo.scheduler.profiles import model_profile
    from halo.transport.reliable import load_key

    layout = GroupLayout.for_model(weights.config)
    key = load_key(args.key)
    cluster = measure_cluster(weights, layout, MasterSettings(**master_settings(mode)), args.endpoints.split(","), key)
    profile = model_profile(weights.config, "fp32", mlp_group_size=layout.mlp_group_size,
                            vocab_group_size=layout.vocab_group_size)
    return cluster, profile, key


def job_sweep(weights, args) -> dict:
    """Part 1: every candidate plan, predicted from the profile and measured; and predicted again from the
    running estimates of its own run (compute speeds and link loss as observed, as the dynamic-partitioning
    thesis pairs each run with its running estimate)."""
    from halo.scheduler.plan_io import plan_summary

    mode = "exact"
    settings = master_settings(mode)
    cluster, profile, key = measured(weights, args, mode)
    plans = candidate_plans(cluster, profile, mode, settings["sync"])
    rows, observed = [], {}
    for name, plan in plans:
        times, estimates = run_plan(weights, key, plan, settings, args.tokens)
        rows.append(plan_row(name, plan, mode, settings["sync"], times, estimates.updated_cluster(plan)))
        observed[name] = estimates.to_json()
        print(json.dumps({k: rows[-1][k] for k in ("plan", "predicted_ms", "predicted_running_ms", "measured_ms")}),
              file=sys.stderr, flush=True)
    return {"profile": plan_summary(plans[0][1], mode), "running_estimates": observed, "rows": rows}


def blind(cluster):
    """The same cluster with every link reported clean: what a PLR-blind planner sees."""
    from dataclasses import replace

    return replace(cluster, devices=tuple(replace(d, plr=0.0) for d in cluster.devices))


def job_lossy(weights, args) -> dict:
    """Part 2: one link at 5 %: the PLR-aware default plan vs the PLR-blind one, per sync mode."""
    from halo.scheduler.tp_plan import plan_tp

    out = {}
    for mode, tokens in (("exact", args.tokens), ("halo", args.tokens), ("tcp", max(4, args.tokens // 2))):
        settings = master_settings(mode)
        cluster, profile, key = measured(weights, args, mode)
        aware = plan_tp(cluster, profile, mode=mode, sync=settings["sync"])
        unaware = rebased(plan_tp(blind(cluster), profile, mode=mode, sync=settings["sync"]), cluster)
        rows = []
        for name, plan in (("PLR-aware (default)", aware), ("PLR-blind", unaware)):
            times, _ = run_plan(weights, key, plan, settings, tokens)
            rows.append(plan_row(name, plan, mode, settings["sync"], times))
            print(json.dumps({k: rows[-1][k] for k in ("plan", "participants", "predicted_ms", "measured_ms")}),
                  file=sys.stderr, flush=True)
        out[mode] = {"plr": {d.name: d.plr for d in cluster.devices}, "rows": rows}
    return out


def perplexity(model, windows: list[list[int]]) -> tuple[float, list[float]]:
    """Teacher-forced, one token per forward (as generation runs): exp(mean NLL of every next token)."""
    scored = teacher_forced(model, windows)
    return scored.perplexity, scored.ms


def job_accuracy(weights, args) -> dict:
    """Part 3: halo and lossy sync with one lossy link, every device taking part: perplexity with PLR-aware
    vs PLR-blind rank ranges, and heads by importance vs by index."""
    from halo.distributed import cluster_model
    from halo.model.loader import load_tokenizer
    from halo.scheduler.tp_plan import build_plan

    windows = held_out_windows(load_tokenizer(weights), args.data, args.ppl_tokens)
    cluster, profile, key = measured(weights, args, "halo")
    aware = build_plan(cluster, profile, "vanilla")  # every device, equal shares (a tiny model: all overhead)
    unaware = rebased(aware, blind(cluster))  # the same counts; Algorithm 3 ranks as if every link were clean
    configs = [("exact (lossless reference)", "exact", aware, "index")]
    for mode in args.accuracy_modes.split(","):
        configs += [(f"{mode}: PLR-aware ranks, heads by importance", mode, aware, "importance"),
                    (f"{mode}: PLR-aware ranks, heads by index", mode, aware, "index"),
                    (f"{mode}: PLR-blind ranks, heads by index", mode, unaware, "index")]
    rows = []
    for name, mode, plan, heads in configs:
        endpoints = [d.address for d in plan.profiles()[1:]]
        model = cluster_model(weights, endpoints, key, plan=plan, heads=heads, **master_settings(mode))
        try:
            ppl, times = perplexity(model, windows)
            loss = model.sync_report()["loss"]
        finally:
            model.close()
        rows.append({"config": name, "mode": mode, "heads": heads, "perplexity": ppl, "ms_per_token": float(np.mean(times)),
                     "tokens": len(times), "partials_dropped": loss["partials_dropped"], "partials": loss["partials"],
                     "groups_dropped": loss["groups_dropped"]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"plr": {d.name: d.plr for d in cluster.devices},
            "ranks": {name: {cluster.devices[i].name: plan.priority_ranks("mlp")[j, 1].tolist()
                             for j, i in enumerate(plan.devices)} for name, plan in (("aware", aware), ("blind", unaware))},
            "rows": rows}


def master(args) -> None:
    from halo.model.loader import load_weights

    weights = load_weights(args.model)
    result = {"sweep": job_sweep, "lossy": job_lossy, "accuracy": job_accuracy}[args.job](weights, args)
    print("RESULT " + json.dumps(result), flush=True)


# ---- the orchestrator (root namespace) ----------------------------------------------------------------
class ThrottledAgents:
    """The three agents in their namespaces, CPU-capped as AGENTS says; stopped on exit."""

    def __init__(self, bed, model: Path, key: Path, throttle: bool = True):
        from contextlib import ExitStack

        from halo.rpi.throttle import CpuThrottle

        from halo.eval.bench_halo_speed import Cluster

        self.stack = ExitStack()
        self.cluster = Cluster(bed, model, key, len(AGENTS))
        self.stack.callback(self.cluster.close)
        for core, (process, (host, spec)) in enumerate(zip(self.cluster.processes, AGENTS.items()), start=1):
            if PIN:  # a core of its own, as a device has (the master has core 0)
                for task in Path(f"/proc/{process.pid}/task").iterdir():
                    os.sched_setaffinity(int(task.name), {core})
            if throttle and spec["cpu"] < 1:
                self.stack.enter_context(CpuThrottle(process.pid, spec["cpu"], period_s=None,
                                                     cfs_period_us=CFS_PERIOD_US, name=f"halo-sched-{host}"))
        self.endpoints = self.cluster.endpoints

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stack.close()


def run_master(bed, job: str, model: Path, key: Path, endpoints: list[str], args) -> dict:
    argv = [*module_command("halo.eval.bench_cost_model"), "master", "--job", job, "--model", str(model),
            "--key", str(key), "--endpoints", ",".join(endpoints), "--tokens", str(args.tokens),
            "--ppl-tokens", str(args.ppl_tokens), "--data", str(args.data), "--accuracy-modes", args.accuracy_modes]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if PIN:
        argv = ["taskset", "-c", "0", *argv]
    p = bed.popen("master", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = p.communicate(timeout=args.time_limit)
    sys.stderr.write(err[-4000:])
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"master job {job} failed: {err[-3000:]}")


def accuracy_part(model: Path) -> str:
    """The results key of the accuracy part on this model: "accuracy" for the bundled stories260K, else
    "accuracy:<file name>" (each model's rows kept beside the others')."""
    from halo import BUNDLED_MODEL

    return "accuracy" if model == Path(str(BUNDLED_MODEL)) else f"accuracy:{model.name}"


def parts_in(data: dict) -> list[str]:
    return [k for k in data if k in ("sweep", "lossy") or k.split(":")[0] == "accuracy"]


def measure_all(args) -> dict:
    from halo import BUNDLED_MODEL
    from halo.model.catalog import resolve_model
    from halo.rpi.testbed import LossyTestbed
    from halo.transport.reliable import generate_key

    data = {"agents": AGENTS, "lossy_link": LOSSY_LINK, "model_shape": MODEL_SHAPE}
    with tempfile.TemporaryDirectory(prefix="halo-sched-") as tmp:
        os.environ["HALO_DEVICE_CACHE_DIR"] = str(Path(tmp) / "cache")  # fresh benchmarks, shared by this run's devices
        key = Path(tmp) / "cluster.key"
        generate_key(key)
        rates = {host: spec["mbit"] for host, spec in AGENTS.items()}
        with LossyTestbed(len(AGENTS), prefix="sched", rate_mbit=rates) as bed:
            if "sweep" in args.parts or "lossy" in args.parts:
                model = checkpoint()
                with ThrottledAgents(bed, model, key) as agents:
                    if "sweep" in args.parts:
                        bed.set_losses({host: spec["plr"] for host, spec in AGENTS.items()})
                        data["sweep"] = run_master(bed, "sweep", model, key, agents.endpoints, args)
                    if "lossy" in args.parts:
                        bed.set_losses(LOSSY_LINK)
                        data["lossy"] = run_master(bed, "lossy", model, key, agents.endpoints, args)
            if "accuracy" in args.parts:
                model = resolve_model(args.ppl_model) if args.ppl_model else Path(str(BUNDLED_MODEL))
                bed.set_losses(LOSSY_LINK)
                with ThrottledAgents(bed, model, key, throttle=False) as agents:  # equal CPUs: the loss alone
                    part = accuracy_part(model)
                    data[part] = run_master(bed, "accuracy", model, key, agents.endpoints, args)
                data[part]["model"] = str(model)
    return data


# ---- the report ---------------------------------------------------------------------------------------
def accuracy_of(rows: list[dict], key: str) -> dict:
    from scipy.stats import spearmanr

    predicted = np.array([r[key] for r in rows])
    measured = np.array([r["measured_ms"] for r in rows])
    return {"mape": float(np.mean(np.abs(predicted - measured) / measured)),
            "spearman": float(spearmanr(predicted, measured).statistic), "plans": len(rows)}


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r["measured_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.scatter(measured, [r["predicted_ms"] for r in rows], label="initial (profile)", marker="o")
    if all("predicted_running_ms" in r for r in rows):
        ax.scatter(measured, [r["predicted_running_ms"] for r in rows], label="running estimates", marker="x")
    top = max(measured + [r["predicted_ms"] for r in rows]) * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="predicted = measured")
    ax.set_xlabel("measured ms per token")
    ax.set_ylabel("predicted ms per token")
    ax.set_title("cost model vs measurement (exact sync)")
    ax.legend()
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "cost_model.png", dpi=120)
    plt.close(fig)


def sweep_lines(sweep: dict) -> list[str]:
    rows = sweep["rows"]
    initial, running = accuracy_of(rows, "predicted_ms"), accuracy_of(rows, "predicted_running_ms")
    sweep["accuracy"] = {"initial": initial, "running": running}
    lines = [f"## 1. Predicted vs measured time per token ({len(rows)} plans, exact sync)", "",
             f"- initial (measured profile): MAPE **{100 * initial['mape']:.1f} %**, Spearman **{initial['spearman']:.2f}**",
             f"- running estimates (each plan's compute speeds and link loss as observed during its run): MAPE "
             f"**{100 * running['mape']:.1f} %**, Spearman **{running['spearman']:.2f}**", "",
             "| plan | participants | predicted ms (initial / running) | measured ms (mean / median) | error (initial) |",
             "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["measured_ms"]):
        error = (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
        lines.append(f"| {r['plan']} | {', '.join(p.split('#')[0] for p in r['participants'])} | "
                     f"{r['predicted_ms']:.1f} / {r['predicted_running_ms']:.1f} | {r['measured_ms']:.1f} / "
                     f"{r['measured_ms_median']:.1f} | {100 * error:+.0f} % |")
    default = next(r for r in rows if r["plan"].startswith("default"))
    even = next(r for r in rows if r["plan"] == "vanilla")
    best = min(rows, key=lambda r: r["measured_ms"])
    lines += ["", "## 2. Measured plans win", "",
              "| plan | ms/token | vs best tried |", "|---|---|---|"]
    for label, r in (("default (measured)", default), ("even (Vanilla, every device)", even), (f"best tried: {best['plan']}", best)):
        lines.append(f"| {label} | {r['measured_ms']:.1f} | {r['measured_ms'] / best['measured_ms']:.2f}x |")
    lines += ["", f"Goal: default within 5 % of the best ({'met' if default['measured_ms'] <= 1.05 * best['measured_ms'] else 'not met'})"
              f" and faster than even ({'met' if default['measured_ms'] < even['measured_ms'] else 'not met'})."]
    return lines


def lossy_lines(lossy: dict) -> list[str]:
    lines = ["", "## 3. One link at 5 % loss: PLR-aware vs PLR-blind plans", "",
             "| sync | plan | participants | predicted ms | measured ms |", "|---|---|---|---|---|"]
    for mode, part in lossy.items():
        for r in part["rows"] if isinstance(part, dict) else []:
            lines.append(f"| {mode} | {r['plan']} | {', '.join(p.split('#')[0] for p in r['participants'])} | "
                         f"{r['predicted_ms']:.1f} | {r['measured_ms']:.1f} |")
    return lines


def accuracy_lines(accuracy: dict, section: int = 4) -> list[str]:
    lines = ["", f"## {section}. Accuracy with one link at 5 % loss ({Path(accuracy['model']).name}, every device takes "
             "part with an equal share, no CPU quotas)", "",
             "Measured PLR per device: " + ", ".join(f"{n.split('#')[0]} {100 * p:.1f} %" for n, p in accuracy["plr"].items())
             + ". "
             f"MLP rank ranges of layer 1, PLR-aware: {accuracy['ranks']['aware']}; PLR-blind: {accuracy['ranks']['blind']}.", "",
             "| configuration | perplexity | vs lossless | ms/token | partial sums dropped |", "|---|---|---|---|---|"]
    lossless = accuracy["rows"][0]["perplexity"]
    for r in accuracy["rows"]:
        lines.append(f"| {r['config']} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / lossless - 1):+.2f} % | "
                     f"{r['ms_per_token']:.1f} | {r['partials_dropped']}/{r['partials']} |")
    rows = {r["config"]: r["perplexity"] for r in accuracy["rows"]}
    for mode in sorted({r["mode"] for r in accuracy["rows"]} - {"exact"}):
        aware, blind = rows.get(f"{mode}: PLR-aware ranks, heads by index"), rows.get(f"{mode}: PLR-blind ranks, heads by index")
        placed = rows.get(f"{mode}: PLR-aware ranks, heads by importance")
        if None in (aware, blind, placed):
            continue
        rise = lambda ppl: f"{100 * (ppl / lossless - 1):+.2f} %"  # noqa: E731
        lines += ["", f"{mode}: PLR-aware ranks {rise(aware)} vs PLR-blind {rise(blind)} "
                      f"({'aware better' if aware < blind else 'blind better'}); heads by importance {rise(placed)} vs by "
                      f"index {rise(aware)} ({'importance better' if placed < aware else 'index better'})."]
    return lines


def merged(data: dict, args) -> dict:
    """This run's parts over those of an earlier run in the same results file (--parts reruns one part)."""
    command = command_line("halo.eval.bench_cost_model", args.argv)
    for part in parts_in(data):
        data[part]["command"] = command
    try:
        earlier = json.loads((Path(args.out) / "cost_model.json").read_text())
    except (OSError, ValueError):
        return data
    kept = {k: {"command": earlier.get("command", "?"), **v} for k, v in earlier.items() if k in parts_in(earlier)}
    return {**kept, **data}


def report(data: dict, args) -> None:
    data = merged(data, args)
    command = command_line("halo.eval.bench_cost_model", args.argv)
    out = Path(args.out)
    quotas = ", ".join(f"{100 * a['cpu']:.0f} %" for a in AGENTS.values())
    rates = ", ".join(str(a["mbit"]) for a in AGENTS.values())
    losses = ", ".join(f"{100 * a['plr']:g} %" for a in AGENTS.values())
    shape = MODEL_SHAPE
    commands = sorted({data[p]["command"] for p in parts_in(data) if "command" in data[p]})
    lines = ["# The scheduler's cost model against real runs (namespace test bed)", "",
             f"Command: {', '.join(f'`flock /tmp/halo-heavy.lock {c}`' for c in commands or [command])}. Master + 3 agents in network namespaces; agents' CPU "
             f"quotas {quotas} of a core, links {rates} Mbit/s (tbf, both ways), loss {losses}. Model for timing: a "
             f"random Llama ({shape['num_hidden_layers']} layers, dim {shape['hidden_size']}, "
             f"{shape['num_attention_heads']} heads, hidden {shape['intermediate_size']}, vocab {shape['vocab_size']}), "
             f"fp32, {args.tokens} decode tokens per plan after {WARMUP} warm-up tokens. "
             + ("Every device on its own core." if PIN else f"The 4 devices share this machine's {os.cpu_count()} "
                "cores (slowing each other down when they compute at once, which no profile predicts): re-run on a "
                "quiet machine with 4+ cores for numbers to quote."), ""]
    if "sweep" in data:
        lines += sweep_lines(data["sweep"])
        plot(data["sweep"]["rows"], out)
    if "lossy" in data:
        lines += lossy_lines(data["lossy"])
    for section, part in enumerate((p for p in parts_in(data) if p.startswith("accuracy")), start=4):
        lines += accuracy_lines(data[part], section)
    write_report(out, "cost_model", {"command": command, **data}, lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="run", choices=("run", "master"))
    parser.add_argument("--tokens", type=int, default=16, help="decode tokens timed per plan (default 16)")
    parser.add_argument("--ppl-tokens", type=int, default=1024, help="held-out tokens per perplexity (default 1024)")
    parser.add_argument("--ppl-model", help="model file or name for the accuracy part (default: the bundled "
                        "stories260K; e.g. smollm2-135m-instruct, with predictors/ beside it)")
    parser.add_argument("--data", default=DATA, help="text whose last 20 %% is the held-out set (default: "
                        "shared/data/tinystories_valid_dev.txt beside the checkout)")
    parser.add_argument("--parts", default="sweep,lossy,accuracy", help="which parts to run (default: all)")
    parser.add_argument("--accuracy-modes", default="halo,lossy", help="relaxed sync modes of the accuracy part "
                        "(default: halo,lossy; each runs three configurations against the exact reference)")
    parser.add_argument("--time-limit", type=float, default=1500.0, help="seconds per master job")
    parser.add_argument("--out", default="eval/results")
    # the master process (internal)
    parser.add_argument("--job")
    parser.add_argument("--model")
    parser.add_argument("--key")
    parser.add_argument("--endpoints")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if args.what == "master":
        master(args)
        return 0
    from halo.rpi.testbed import available as bed_available
    from halo.rpi.throttle import available as cgroups_available

    for ok, why in (bed_available(), cgroups_available()):
        if not ok:
            print(f"skipped: {why}")
            return 0
    args.parts = args.parts.split(",")
    if "accuracy" in args.parts and not (args.data and Path(args.data).is_file()):
        print(f"error: no held-out text at {args.data!r}; give --data", file=sys.stderr)
        return 2
    report(measure_all(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
