"""Tensor-parallel decode over local agents vs the single-process reference.

    python -m halo.eval.bench_tp [--agents 1,2,4,8] [--tiny-layers 4] [--tokens 32] [--sync tcp]

Two models: the bundled stories260K and a TinyLlama-1.1B-shaped checkpoint with random weights cut
to --tiny-layers layers (all 22 would not leave this 2-core machine's agents enough memory bandwidth
to say anything different; the per-layer behaviour is the same). Every setting runs in a fresh
cluster: the master computes its own share and N agent processes theirs, all on these 2 cores, so
agents contend for CPU: the table also reports the master's own compute, the time it waited for
agents, and each agent's own compute per token, which is what a cluster of real devices would see.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from halo.compute.transformer import Transformer
from halo.distributed import LocalCluster, cluster_model
from halo.generation.generate import generate
from halo.model.loader import load_tokenizer, load_weights
from halo.sync import SyncSettings

from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_llama
from halo.eval.report import command_line, run_script, write_report


def measure(model_path, agents: list[int], tokens: int, context: int, sync: str) -> list[dict]:
    weights = load_weights(model_path)
    tokenizer = None
    try:
        tokenizer = load_tokenizer(weights)
    except Exception:  # a random checkpoint has no tokenizer: feed token ids directly
        pass
    rows = []
    single = Transformer(weights, max_seq_len=context)
    rows.append({"agents": 0, **run(single, tokenizer, tokens, weights)})
    for n in agents:
        with LocalCluster(n, model_path=str(model_path) if model_path else None) as cluster:
            model = cluster_model(weights, cluster.endpoints, cluster.key, context=context, timeout_s=30,
                                  sync=SyncSettings(mode=sync))
            try:
                row = run(model, tokenizer, tokens, weights)
                steps = model.step
                report = model.report()
                row["master_compute_ms_per_token"] = model.own_compute_ms / steps
                row["master_cpu_ms_per_token"] = model.own_cpu_ms / steps
                row["wait_for_agents_ms_per_token"] = sum(r["wait_ms"] for r in report) / steps
                row["agent_compute_ms_per_token"] = [r["compute_ms"] / steps for r in report]
                row["agent_cpu_ms_per_token"] = [r["cpu_ms"] / steps for r in report]
            finally:
                model.close()
        rows.append({"agents": n, **row})
    return rows


def run(model, tokenizer, tokens: int, weights) -> dict:
    if tokenizer is not None:
        result = generate(model, tokenizer, "", tokens)
        times = result.decode_ms
    else:
        model.reset()
        logits = model.forward([1, 5, 9, 13])
        times = []
        for _ in range(tokens):
            t = time.perf_counter()
            logits = model.forward([int(np.argmax(logits))])
            times.append(1e3 * (time.perf_counter() - t))
    return {"ms_per_token": float(np.mean(times)), "ms_per_token_median": float(np.median(times))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="1,2,4,8")
    parser.add_argument("--tiny-layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--sync", default="tcp", help="sync mode of every cluster (default tcp: reliable ZMQ)")
    parser.add_argument("--name", default="tp_local_cluster", help="results file name under --out")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    agents = [int(a) for a in args.agents.split(",")]
    results = {"stories260K": measure(None, agents, args.tokens * 4, 512, args.sync)}
    with tempfile.TemporaryDirectory(prefix="halo-tp-") as tmp:
        write_random_llama(tmp, dict(TINYLLAMA_1_1B, num_hidden_layers=args.tiny_layers))
        results[f"TinyLlama-shape, {args.tiny_layers} layers"] = measure(Path(tmp), agents, args.tokens, 256, args.sync)
    command = command_line("halo.eval.bench_tp", argv)
    lines = [f"# Tensor-parallel decode over local agents ({args.sync} sync, one 2-core machine)", "",
             f"Command: `{command}`. 0 agents = the single-process reference. All processes share 2 cores, so "
             "wall time mostly shows contention and per-message overhead; per-agent compute is what each device "
             "would spend on real hardware.", "",
             "| model | agents | ms/token (mean / median) | vs single | master compute ms (wall / CPU) | "
             "waiting for agents ms | agent compute ms, wall (mean / max) | agent CPU ms (mean / max) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        base = rows[0]["ms_per_token"]
        for r in rows:
            agent, cpu = r.get("agent_compute_ms_per_token"), r.get("agent_cpu_ms_per_token")
            master = (f"{r['master_compute_ms_per_token']:.2f} / {r['master_cpu_ms_per_token']:.2f}"
                      if agent else f"{r['ms_per_token']:.2f}")
            lines.append(f"| {name} | {r['agents']} | {r['ms_per_token']:.2f} / {r['ms_per_token_median']:.2f} | "
                         f"{r['ms_per_token'] / base:.2f}x | {master} | {r.get('wait_for_agents_ms_per_token', 0):.2f} | "
                         + (f"{np.mean(agent):.2f} / {np.max(agent):.2f} | {np.mean(cpu):.2f} / {np.max(cpu):.2f} |"
                            if agent else "- | - |"))
    write_report(args.out, args.name, {"command": command, "results": results}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
