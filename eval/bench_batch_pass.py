"""Where a batched pass's time goes: what continuous batching (halo-master serve --slots) gains per row, and why.

    python -m halo.eval.bench_batch_pass [--plans paired-mlp,even-mlp-only] [--rows 1,4,16] [--seconds 4]

For each plan, one master over --agents local agents (exact sync, loopback), then for each row count B a pass of B
decode rows (B requests in B KV-cache slots, one token each) repeated for --seconds: ms per pass and per row, and
where the pass goes on the master (halo/distributed/timing.py: its own compute, sending the inputs, waiting for the
partials; the slowest agent's compute as it reports it). Beside them, in the same run:
- the model in this one process (no agents, one compute thread) at the same B: the rows' compute without any
  synchronization;
- choosing a token from one row's logits at temperature 0.8 (what a serve pass does per request): halo's sampler
  against the same probabilities drawn by numpy's rng.choice (the sampler before it drew in blocks).
"batch gain": B rows' tokens/s over one row's, inside a plan: what `serve` with B clients can gain over one client.
--paired-shares 0.5,0.25: paired-mlp once per agent's part of each layer's MLP (the plan gives it half): on cores the
agents share with the master, how much of a layer the agent should compute depends on the model and on B.
Writes eval/results/NAME.{json,md} with the host.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from halo.eval.report import command_line, host, run_script, write_report

PHASES = ("own_compute", "send", "sync_wait", "slowest_agent_compute")


def passes(model, rows: int, seconds: float, warmed=lambda: None) -> float:
    """Mean seconds of a pass of `rows` decode rows (one per slot, position 10), after one untimed pass (then
    `warmed()`: what the caller times from there)."""
    from halo.compute.batch import Rows

    layout = Rows.of([(slot, 10, 1) for slot in range(rows)])
    tokens = [100 + slot for slot in range(rows)]
    model.forward_rows(tokens, layout)
    warmed()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        model.forward_rows(tokens, layout)
        n += 1
    return (time.perf_counter() - start) / n


def plan_label(plan: str, agent_share: float) -> str:
    return plan if agent_share == 0.5 else f"{plan}, agent {100 * agent_share:g} %"


def over_agents(weights, path: str, plan: str, agents: int, rows: list[int], seconds: float,
                agent_share: float = 0.5) -> list[dict]:
    from halo.distributed.connect import cluster_model
    from halo.distributed.timing import Timings
    from halo.runtime.local import LocalCluster
    from halo.sync import SyncSettings

    out = []
    with LocalCluster(agents, path) as cluster:
        model = cluster_model(weights, cluster.endpoints, cluster.key, plan=plan, context=256, slots=max(rows),
                              sync=SyncSettings(mode="exact"), fmt="native", agent_share=agent_share)
        try:
            for b in rows:
                seconds_per_pass = passes(model, b, seconds, lambda: setattr(model, "timings", Timings()))
                per_pass = model.timings.to_json()["per_token_ms"]  # (per forward pass)
                out.append({"plan": plan_label(plan, agent_share), "rows": b, "ms_per_pass": round(1e3 * seconds_per_pass, 2),
                            **{k: per_pass[k] for k in PHASES}})
        finally:
            model.close()
    return out


def in_one_process(weights, rows: list[int], seconds: float) -> list[dict]:
    from halo.compute.transformer import Transformer

    model = Transformer(weights, fmt="native", max_seq_len=256, slots=max(rows))
    return [{"plan": "one process", "rows": b, "ms_per_pass": round(1e3 * passes(model, b, seconds), 2)} for b in rows]


def sampling_us(vocab: int, draws: int = 400) -> dict:
    from halo.generation.sampling import Sampler, SamplingSettings

    logits = (np.random.default_rng(0).standard_normal(vocab) * 3).astype(np.float32)
    sampler = Sampler(SamplingSettings(temperature=0.8, seed=1))
    before = np.random.default_rng(1)

    def with_choice():
        probs = sampler.probabilities(logits)
        return int(before.choice(len(probs), p=probs))

    timed = {}
    for name, draw in (("halo's sampler", lambda: sampler(logits)), ("numpy's rng.choice (before)", with_choice)):
        draw()
        start = time.perf_counter()
        for _ in range(draws):
            draw()
        timed[name] = round(1e6 * (time.perf_counter() - start) / draws, 1)
    return timed


def render(result: dict) -> list[str]:
    lines = [f"# Where a batched pass's time goes ({result['model']})", "",
             f"Command: `{result['command']}`. Host: {result['host']['cpu']}, {result['host']['cores']} cores. "
             f"Master + {result['agents']} local agents, exact sync over loopback UDP; B decode rows a pass (B "
             f"requests, one token each), each B for {result['seconds']} s. Per pass on the master (ms): its own "
             "compute, sending the inputs, waiting for the partials; the slowest agent's compute as it reports it. "
             "Batch gain: B rows' tokens/s over one row's in the same plan.", "",
             "| plan | rows B | ms a pass | ms a row | batch gain | own compute | send | wait | slowest agent |",
             "|---|---|---|---|---|---|---|---|---|"]
    one = {r["plan"]: r["ms_per_pass"] for r in result["passes"] if r["rows"] == 1}
    for r in result["passes"]:
        gain = r["rows"] * one[r["plan"]] / r["ms_per_pass"] if r["plan"] in one else float("nan")
        phases = " | ".join(f"{r[k]:.1f}" if k in r else "-" for k in PHASES)
        lines.append(f"| {r['plan']} | {r['rows']} | {r['ms_per_pass']:.1f} | {r['ms_per_pass'] / r['rows']:.2f} | "
                     f"{gain:.2f}x | {phases} |")
    lines += ["", f"Choosing one token at temperature 0.8 from {result['vocab']} logits (us, the same probabilities):",
              ""] + [f"- {name}: {us:.0f}" for name, us in result["sampling_us"].items()]
    return lines


def main(argv=None) -> int:
    from halo.model.catalog import resolve_model
    from halo.model.loader import load_weights
    from halo.scheduler.even import EVEN_PLANS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model file or fetched name")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--plans", default="paired-mlp,even-mlp-only", help="comma-separated keyword plans")
    parser.add_argument("--rows", default="1,4,16", help="comma-separated rows a pass (each at most 256)")
    parser.add_argument("--seconds", type=float, default=4.0, help="time each (plan, B) is repeated for")
    parser.add_argument("--paired-shares", default="0.5", metavar="F,...",
                        help="paired-mlp: the agent's part of each layer's MLP, one setup each (default 0.5, the "
                             "plan's half; e.g. 0.5,0.25 compares a quarter)")
    parser.add_argument("--name", default="batch_pass")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    try:
        rows = [int(b) for b in args.rows.split(",")]
        shares = [float(f) for f in args.paired_shares.split(",")]
    except ValueError as e:
        raise SystemExit(f"--rows / --paired-shares: comma-separated numbers ({e})") from None
    plans = args.plans.split(",")
    if not all(1 <= b <= 256 for b in rows) or 1 not in rows or args.agents < 1 or args.seconds <= 0:
        raise SystemExit("--rows: 1 to 256 each, 1 among them (the batch gain is over one row); --agents: 1 or more; "
                         "--seconds: above 0")
    if not all(0 < f <= 0.5 for f in shares):
        raise SystemExit("--paired-shares: each in (0, 0.5] (the master takes the rest)")
    if unknown := [p for p in plans if p not in EVEN_PLANS]:  # (refused after the one-process pass had run)
        raise SystemExit(f"--plans: {', '.join(unknown)} is no keyword plan; choose from {', '.join(EVEN_PLANS)}")
    if args.paired_shares != "0.5" and "paired-mlp" not in plans:
        raise SystemExit("--paired-shares is for --plans paired-mlp (it was ignored)")
    path = str(resolve_model(args.model))
    weights = load_weights(path)
    measured = in_one_process(weights, rows, args.seconds)
    for plan in plans:
        for share in shares if plan == "paired-mlp" else [0.5]:
            measured += over_agents(weights, path, plan, args.agents, rows, args.seconds, share)
    result = {"command": command_line("halo.eval.bench_batch_pass", argv), "model": os.path.basename(path),
              "agents": args.agents, "seconds": args.seconds, "host": host(),
              "passes": measured, "vocab": weights.config.vocab_size,
              "sampling_us": sampling_us(weights.config.vocab_size)}
    write_report(args.out, args.name, result, render(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
