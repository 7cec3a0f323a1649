"""The offline TinyStories tasks through lm-eval under injected packet loss (issue: lm-eval plugin).

    python -m halo.eval.lm_eval_loss_table [--model NAME|PATH] [--agents 4] [--plr 0,0.01,0.02,0.05] [--limit N]

For each sync mode (exact, lossy = static groups + deadline drops, halo = predictors + recover
first, drop last) and each PLR, runs lm-eval's `simple_evaluate` on tinystories_ppl and
tinystories_cloze with the `halo` backend over N local agents, every sender dropping PLR of its UDP
datagrams (seeded). Reliable mode sends nothing over UDP (TCP recovers every loss, exactly): its
numbers are the same at every PLR, so it runs once and stands for all; under real loss its price is
time (see the speed benchmark), not accuracy. Writes eval/results/lm_eval_loss.{json,md} for the bundled
stories260K, lm_eval_loss_<model>.{json,md} for another model (its own weight format: `weights=native`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from halo.eval.report import command_line, run_script, write_report

TASKS = ["tinystories_ppl", "tinystories_cloze"]
METRICS = [("tinystories_ppl", "word_perplexity,none", "word ppl"), ("tinystories_ppl", "bits_per_byte,none", "bits/byte"),
           ("tinystories_cloze", "acc,none", "cloze acc"), ("tinystories_cloze", "acc_norm,none", "cloze acc_norm")]


def run(agents: int, sync: str, plr: float, limit: int | None, seed: int, model: str | None = None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from halo.eval.lm_eval_plugin import HaloLM
    from halo.eval.lm_eval_tasks import TASKS_DIR

    lm = HaloLM(model=model, local_agents=agents, sync=sync, inject_plr=plr, seed=seed, weights="native")
    t = time.perf_counter()
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=TASKS, limit=limit, task_manager=TaskManager(include_path=str(TASKS_DIR)),
                                      log_samples=False, verbosity="WARNING")
        loss = lm.model.sync_report()["loss"] if hasattr(lm.model, "sync_report") else {}
    finally:
        lm.close()
    row = {"sync": sync, "plr": plr, "seconds": round(time.perf_counter() - t, 1), "loss": loss}
    for task, key, name in METRICS:
        row[name] = out["results"][task][key]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model file or name (default: the bundled stories260K)")
    parser.add_argument("--modes", default="lossy,halo", help="sync modes run at every PLR (default: %(default)s)")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--plr", default="0,0.01,0.02,0.05")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    from halo.model.catalog import resolve_model

    plrs = [float(p) for p in args.plr.split(",")]
    model = str(resolve_model(args.model)) if args.model else None
    name = Path(model).name.split(".")[0] if model else "stories260K"
    rows = [run(args.agents, "exact", 0.0, args.limit, args.seed, model)]
    for sync in args.modes.split(","):
        for plr in plrs:
            rows.append(run(args.agents, sync, plr, args.limit, args.seed, model))
            print(rows[-1], flush=True)
    lines = [f"# lm-eval under injected loss: {name}, {args.agents} local agents + master", "",
             f"Command: `{command_line('halo.eval.lm_eval_loss_table', argv)}`. Every sender drops PLR of its UDP "
             "datagrams (seeded). exact = every lost datagram recovered, the same at every PLR (run once). Partial sums lost = fraction of "
             "agents' partial sums with a zero-filled chunk.", "",
             "| sync | PLR | " + " | ".join(n for *_, n in METRICS) + " | partial sums lost | seconds |",
             "|---|---|" + "---|" * (len(METRICS) + 2)]
    for r in rows:
        lost = (r["loss"]["partials_dropped"] / r["loss"]["partials"]) if r["loss"].get("partials") else 0.0
        plr = "any" if r["sync"] == "exact" else f"{100 * r['plr']:g} %"
        lines.append(f"| {r['sync']} | {plr} | {r['word ppl']:.3f} | {r['bits/byte']:.4f} | {r['cloze acc']:.3f} | "
                     f"{r['cloze acc_norm']:.3f} | {100 * lost:.2f} % | {r['seconds']} |")
    write_report(args.out, "lm_eval_loss" + (f"_{name}" if model else ""), {"command": command_line("halo.eval.lm_eval_loss_table", argv),
                                            "agents": args.agents, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
