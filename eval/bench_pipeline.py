"""Pipeline mode: time and bytes per token over 1-4 native stages vs tensor-parallel mode on the same
number of local devices, the cost model's prediction vs the measurement, recovery time, and (with
--browser) a WebGPU browser stage in headless Chromium.

    python -m halo.eval.bench_pipeline [--layers 22] [--weights native] [--tokens 16] [--stages 1,2,3,4]
                                       [--browser] [--screenshot docs/browser-worker.png]

The model is a TinyLlama-1.1B-shaped GGUF with random Q4_0 weights (bench_churn.q4_checkpoint) with --layers
layers (22 = the whole model). Stages and agents compute in --weights (native: the file's 4-bit blocks with
the C decode steps, as the TP runtime does); each stage's own compute time is set against the single process's. Pipeline: N halo-stage-worker processes, an even split of the units, the
coordinator holds no stage. TP: the master and N - 1 halo-agent processes (N devices computing),
tcp sync (every byte on the control connections, where they are counted).
Bytes per token: everything the coordinator / master sent and received per decode step (both
measured at the sockets). Prediction: scheduler/pipeline.py's cost for the plan, from the profiles the
workers measured at start (thesis 000's "initial estimate"). All processes share this machine's cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from halo.compute.transformer import Transformer
from halo.model.loader import load_weights, model_fingerprint
from halo.sync import SyncSettings

from halo.compute.linear import FORMATS

from halo.eval.bench_churn import q4_checkpoint
from halo.eval.report import command_line, host_line, run_script, write_report

PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975]


def decode_ms(model, tokens: int, traffic=lambda: 0) -> tuple[list[float], float]:
    """Per-step decode times after a prefill of PROMPT, and the bytes per step (traffic() counts them)."""
    model.reset()
    logits = model.forward(PROMPT)
    times, before = [], traffic()
    for _ in range(tokens):
        t = time.perf_counter()
        logits = model.forward([int(np.argmax(logits))])
        times.append(1e3 * (time.perf_counter() - t))
    return times, (traffic() - before) / tokens


def run_pipeline(weights, path: Path, n: int, tokens: int, context: int, fmt: str) -> dict:
    import zmq

    from halo.pipeline.connect import local_stage_workers
    from halo.pipeline.coordinator import PipelineModel
    from halo.pipeline.links import NativeStage
    from halo.pipeline.replan import even_stages

    sha = model_fingerprint(path)
    with local_stage_workers(n, model_path=str(path), startup_timeout_s=600) as workers:
        ctx = zmq.Context()
        links = [NativeStage(ctx, e, workers.key, False, 120.0, sha, hello_timeout_s=600) for e in workers.endpoints]
        model = PipelineModel(weights, links, even_stages(weights.config, n), context, fmt)
        try:
            model.forward(PROMPT)  # warm: first touches of the weights' pages
            times, per_token = decode_ms(model, tokens, lambda: model.traffic.total)
            report = model.report()
            row = {"mode": "pipeline", "devices": n, "ms_per_token": float(np.median(times)),
                   "ms_per_token_mean": float(np.mean(times)), "bytes_per_token": per_token,
                   "predicted_ms": report["predicted_ms_per_token"],
                   "stage_decode_compute_ms": [s["decode_compute_ms"] for s in report["stages"]],
                   "stages": [(s["worker"], s["start"], s["stop"]) for s in report["stages"]],
                   "profiles": report["profiles"]}
        finally:
            model.close()
            ctx.destroy(linger=0)
    return row


def stage_threads(n: int) -> int:
    """What local_stage_workers gives each of n stage workers."""
    return max(1, (os.cpu_count() or 1) // n)


def run_single(weights, tokens: int, context: int, fmt: str, threads: int) -> dict:
    model = Transformer(weights, fmt=fmt, max_seq_len=context, threads=threads)
    model.forward(PROMPT)
    times, _ = decode_ms(model, tokens)
    return {"mode": "single process", "devices": 1, "threads": threads, "ms_per_token": float(np.median(times)),
            "ms_per_token_mean": float(np.mean(times)), "bytes_per_token": 0.0}


def run_tp(weights, path: Path, n: int, tokens: int, context: int, fmt: str) -> dict:
    from halo.distributed import LocalCluster, cluster_model

    if n == 1:
        return run_single(weights, tokens, context, fmt, 1)
    with LocalCluster(n - 1, model_path=str(path), startup_timeout_s=600) as cluster:
        model = cluster_model(weights, cluster.endpoints, cluster.key, context=context, timeout_s=120, fmt=fmt,
                              hello_timeout_s=600, probe_links=False, sync=SyncSettings(mode="tcp"))

        def traffic() -> int:
            return sum(a.stats.bytes_sent + a.stats.bytes_received for a in model.agents.values())

        try:
            model.forward(PROMPT)  # warm
            times, per_token = decode_ms(model, tokens, traffic)
            return {"mode": "tp", "devices": n, "ms_per_token": float(np.median(times)),
                    "ms_per_token_mean": float(np.mean(times)), "bytes_per_token": per_token}
        finally:
            model.close()


def run_recovery(weights, path: Path, tokens: int, context: int, fmt: str) -> dict:
    """Three stages; the middle worker is killed after `tokens` decode steps; the rest finish the run."""
    import zmq

    from halo.pipeline.connect import local_stage_workers
    from halo.pipeline.coordinator import PipelineModel
    from halo.pipeline.links import NativeStage
    from halo.pipeline.replan import even_stages

    sha = model_fingerprint(path)
    reference = Transformer(weights, fmt=fmt, max_seq_len=context)
    expected = _greedy(reference, 2 * tokens)
    with local_stage_workers(3, model_path=str(path), startup_timeout_s=600) as workers:
        ctx = zmq.Context()
        links = [NativeStage(ctx, e, workers.key, False, 120.0, sha, hello_timeout_s=600) for e in workers.endpoints]
        model = PipelineModel(weights, links, even_stages(weights.config, 3), context, fmt)
        try:
            got = _greedy(model, 2 * tokens, kill_at=tokens, kill=lambda: (workers.processes[1].kill(),
                                                                            workers.processes[1].wait()))
            (recovery,) = model.report()["recoveries"]
        finally:
            model.close()
            ctx.destroy(linger=0)
    return {**recovery, "tokens_equal": got == expected, "killed_after_tokens": tokens}


def _greedy(model, n: int, kill_at: int | None = None, kill=None) -> list[int]:
    model.reset()
    logits = model.forward(PROMPT)
    out = []
    for i in range(n):
        out.append(int(np.argmax(logits)))
        if i == kill_at:
            kill()
        logits = model.forward([out[-1]])
    return out


def run_browser(screenshot: str | None) -> dict:
    """stories260K with units [3, 7) on a WebGPU tab (SwiftShader), the rest in the coordinator."""
    import subprocess

    from halo.generation.generate import generate
    from halo.model.loader import load_tokenizer
    from halo.pipeline.browser import BrowserHub
    from halo.pipeline.coordinator import PipelineModel
    from halo.pipeline.links import LocalStage
    from halo.pipeline.replan import Stage
    from halo.runtime.replanning import SurvivalSettings

    weights = load_weights()
    tokenizer = load_tokenizer(weights)
    reference = Transformer(weights, max_seq_len=256)
    expected = generate(reference, tokenizer, "", 48)
    web = Path(__file__).resolve().parents[1] / "web"
    with BrowserHub(weights, "127.0.0.1:0", 256, announce=lambda line: None) as hub:
        argv = ["node", str(web / "scripts" / "drive.mjs"), hub.url, "--timeout", "300"]
        if screenshot:
            argv += ["--screenshot", str(Path(screenshot).resolve()), "--after", "40"]
        tab = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            (browser,) = hub.wait_for_workers(1, 300)
            # the split stays as given (a re-plan moved the slow software-rendered tab's layers to the coordinator
            # mid-run, and the tab's stage was no longer there to report on)
            model = PipelineModel(weights, [LocalStage(weights, "coordinator"), browser], [Stage(0, 0, 3), Stage(1, 3, 7)],
                                  256, head_top_k=0, survive=SurvivalSettings(rebalance_every_s=0.0))
            result = generate(model, tokenizer, "", 48)
            worst = 0.0
            for tokens, start in [(expected.prompt_ids + expected.token_ids[:8], 0), ([expected.token_ids[8]], 9)]:
                got = model.forward(tokens, start_pos=start, all_logits=True)
                want = reference.forward(tokens, start_pos=start, all_logits=True)
                worst = max(worst, float(np.abs(got - want).max()))
            row = {"engine": browser.engine, "tokens_equal": result.token_ids == expected.token_ids,
                   "max_abs_logit_difference": worst, "ms_per_token": result.ms_per_token,
                   "browser_compute_ms_per_call": model.report()["stages"][1]["compute_ms"] / model.report()["stages"][1]["calls"]}
            if screenshot:
                line = ""
                while not line.startswith("SCREENSHOT"):
                    line = tab.stdout.readline()
                    if not line:
                        break
                row["screenshot"] = screenshot
        finally:
            tab.stdin.close()
            tab.wait(30)
    return row


def mape(rows: list[dict]) -> float:
    errors = [abs(r["predicted_ms"] - r["ms_per_token"]) / r["ms_per_token"] for r in rows if "predicted_ms" in r]
    return 100 * float(np.mean(errors))


def compute_ratio(rows: list[dict]) -> list[dict]:
    """Per pipeline row: its stages' decode compute (each worker's own median time of a one-token call, summed over
    the stages) against the single process's ms/token with as many threads as each stage has, on the same weights:
    what a stage costs beyond the TP runtime's compute for the same layers (the issue's goal: <= 1.1x)."""
    single = {r["threads"]: r["ms_per_token"] for r in rows if r["mode"] == "single process"}
    out = []
    for r in rows:
        if r["mode"] == "pipeline" and all(ms is not None for ms in r["stage_decode_compute_ms"]):
            total, threads = sum(r["stage_decode_compute_ms"]), stage_threads(r["devices"])
            out.append({"devices": r["devices"], "threads_per_stage": threads, "stage_compute_ms": total,
                        "single_process_ms": single[threads], "ratio": total / single[threads]})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=22, help="TinyLlama layers to keep (22: all)")
    parser.add_argument("--weights", choices=FORMATS, default="native",
                        help="what stages and agents compute in (native: the GGUF's Q4_0 blocks, the default)")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps timed per setting")
    parser.add_argument("--stages", default="1,2,3,4")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--browser", action="store_true", help="also run a WebGPU browser stage (headless Chromium)")
    parser.add_argument("--screenshot", help="with --browser: save the worker page's screenshot here")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    if 1 not in stages:
        parser.error("--stages must include 1: the single process is the yardstick")
    results: dict = {"host": host_line(), "weights": args.weights,
                     "gpu": "the stage workers ran halo's CPU engine (local_stage_workers start them with --device "
                            "cpu); the torch engine a CUDA worker runs is measured only where a GPU is lent"}
    path = q4_checkpoint(args.layers)
    weights = load_weights(path)
    rows = []
    for n in stages:
        rows.append(run_pipeline(weights, path, n, args.tokens, args.context, args.weights))
        rows.append(run_tp(weights, path, n, args.tokens, args.context, args.weights))
        print(rows[-2], rows[-1], flush=True)
    for threads in sorted({stage_threads(n) for n in stages} - {1}):  # the yardsticks of multi-threaded stages
        rows.append(run_single(weights, args.tokens, args.context, args.weights, threads))
    results["rows"] = rows
    results["mape_percent"] = mape(rows)
    results["stage_compute"] = compute_ratio(rows)
    results["recovery"] = run_recovery(weights, path, args.tokens, args.context, args.weights)
    if args.browser:
        results["browser"] = run_browser(args.screenshot)
    command = command_line("halo.eval.bench_pipeline", argv)
    lines = [f"# Pipeline mode vs tensor-parallel mode (TinyLlama-1.1B shape, {args.layers} layers, random Q4_0, "
             f"--weights {args.weights})", "",
             f"Command: `{command}`. {results['host']} Every stage worker / agent is a local process, so the "
             "numbers show per-message and compute cost, not a real network. Pipeline: N stage workers, even split, "
             "the coordinator holds no stage; TP: the master + N - 1 agents, tcp sync. Bytes: what the coordinator/master sent "
             "and received per decode step. Predicted: scheduler/pipeline.py's cost of the plan from the workers' "
             "own measured profiles at start.", "",
             "| devices | pipeline ms/token (median) | predicted ms | error | pipeline bytes/token | TP ms/token | "
             "TP bytes/token |", "|---|---|---|---|---|---|---|"]
    by = {(r["mode"], r["devices"]): r for r in rows if r.get("threads", 1) == 1}
    for n in stages:
        p = by[("pipeline", n)]
        t = by.get(("tp", n)) or by.get(("single process", n))
        error = 100 * abs(p["predicted_ms"] - p["ms_per_token"]) / p["ms_per_token"]
        lines.append(f"| {n} | {p['ms_per_token']:.1f} | {p['predicted_ms']:.1f} | {error:.1f} % | "
                     f"{p['bytes_per_token']:.0f} | {t['ms_per_token']:.1f}{' (single process)' if n == 1 else ''} | "
                     f"{t['bytes_per_token']:.0f} |")
    lines += ["", f"Cost model MAPE over these plans: **{results['mape_percent']:.1f} %** (goal <= 15 %).", "",
              "Stage compute against the TP runtime (the stages' own median time of a one-token call, summed over the "
              "stages, against the single process's ms/token on the same weights; goal <= 1.1x):", "",
              "| stages | threads each | stages' compute ms/token | single process ms/token, as many threads | ratio |",
             "|---|---|---|---|---|"]
    lines += [f"| {c['devices']} | {c['threads_per_stage']} | {c['stage_compute_ms']:.1f} | {c['single_process_ms']:.1f} | "
              f"{c['ratio']:.2f}x |"
              for c in results["stage_compute"]]
    rec = results["recovery"]
    lines += ["", f"Recovery: the middle of 3 workers killed after {rec['killed_after_tokens']} tokens: detected after "
              f"{1e3 * rec['detected_after_s']:.0f} ms, re-planned to {rec['members']}, {rec['replayed_tokens']} "
              f"positions replayed, recovery took {1e3 * rec['seconds']:.0f} ms; tokens equal to the uninterrupted "
              f"run: {rec['tokens_equal']}.", "", f"GPU: {results['gpu']}."]
    if args.browser:
        b = results["browser"]
        lines += ["", f"Browser stage (stories260K, units [3, 7) in headless Chromium, {b['engine']}): tokens equal to "
                  f"the single-process run: {b['tokens_equal']}; max |logit difference| {b['max_abs_logit_difference']:.2e}; "
                  f"{b['ms_per_token']:.1f} ms/token ({b['browser_compute_ms_per_call']:.1f} ms in the tab per call)."]
    write_report(args.out, f"pipeline_tinyllama_{args.weights}", {"command": command, **results}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
