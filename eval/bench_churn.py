"""Churn: continuous generation while agents die and come back (halo/distributed/survive.py).

    python -m halo.eval.bench_churn [--mttf 10,30,60] [--duration 300] [--sync exact] [--plr 0]

The namespace test bed (rpi/testbed.py, needs root; --plr silent loss on every agent link) with 4
agents serving stories260K, each in its own namespace, and a master in its own, generating requests
back to back (64 greedy tokens each, prompts from a fixed list) for --duration seconds with
`--on-agent-loss replan` (the default). Meanwhile each agent independently fails after an
exponentially distributed time of mean MTTF (kill -9) and is restarted 1-10 s later at its address
(a rebooting Pi); a kill that would leave no agent up is skipped, so at least two devices (the master
and one agent) are always up. Per MTTF:

- availability: requests completed / requests started (a request fails only when the cluster cannot
  go on: the error it raised);
- tokens per second over the whole run (re-plans and replays included);
- recovery: per re-plan after a loss, the time from the failure noticed to the history replayed on the
  new assignment (mean, p99), and the longest pause between two tokens of a request (detection, i.e.
  --timeout for a stopped agent and at once for a dead process, plus recovery);
- whether every completed text equals the uninterrupted single-process one (exact sync).

Writes eval/results/churn.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from halo.runtime.local import module_command

from halo.eval.report import command_line, run_script, write_report

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a big bird",
           "The sun was shining", "Sam had a red ball", "There was a cat who", "Mom said"]
TOKENS = 64
SHAPES = {"stories260K": None, "tinyllama": 22, "tinyllama-q4": 22}  # layers of a TinyLlama-shaped random checkpoint


# ---- the master (runs inside the master's namespace) ----------------------------------------------------
def master(args) -> None:
    from contextlib import ExitStack

    from halo.compute.transformer import Transformer
    from halo.distributed import connect
    from halo.distributed.survive import SurvivalSettings
    from halo.model.loader import load_weights
    from halo.sync import SyncSettings

    weights = load_weights(args.model)
    prompts = prompt_ids(weights)
    single = Transformer(weights, fmt=args.weights, max_seq_len=256)
    reference = [greedy(single, p, args.tokens, []) for p in prompts]
    records = []
    with ExitStack() as stack:
        model = connect(weights, stack, agents=args.endpoints.split(","), key=args.key, plan="even", context=256,
                        timeout=args.timeout, fmt=args.weights, sync=SyncSettings(mode=args.sync),
                        # re-plans for speed off: on one 2-core machine the running estimates find the master alone
                        # faster for a 260K model, and no agent (nothing to kill) would take part
                        survive=SurvivalSettings(rejoin_after_s=args.rejoin_after, rebalance_every_s=0.0,
                                                 sticky=args.replan == "sticky",
                                                 input_log_mb=256.0 if args.replan == "sticky" else 0.0))
        print("READY", flush=True)
        end = time.monotonic() + args.duration
        i = 0
        while time.monotonic() < end:
            k = i % len(prompts)
            i += 1
            stamps = [time.perf_counter()]
            t0, error, ids = time.time(), None, []
            try:
                ids = greedy(model, prompts[k], args.tokens, stamps)
            except Exception as e:  # noqa: BLE001 - a failed request is what availability counts
                error = f"{type(e).__name__}: {e}"
            gaps = np.diff(stamps) if len(stamps) > 1 else np.zeros(1)
            records.append({"start": t0, "seconds": time.time() - t0, "error": error, "tokens": len(stamps) - 1,
                            "matches": error is None and ids == reference[k], "max_gap_s": float(gaps.max())})
            if error and "ClusterLost" in error:
                break
        report = model.survival_report() if hasattr(model, "survival_report") else {}
    print("RESULT " + json.dumps({"records": records, "recoveries": report.get("recoveries", [])}), flush=True)


def prompt_ids(weights) -> list[list[int]]:
    """The prompts as token ids (BOS first): through the model's tokenizer, or fixed ids for a checkpoint without one."""
    from halo.errors import HaloError
    from halo.model.loader import load_tokenizer

    try:
        tokenizer = load_tokenizer(weights)
        return [tokenizer.encode(p, bos=True) for p in PROMPTS]
    except (HaloError, OSError):
        rng = np.random.default_rng(0)
        return [[1, *rng.integers(3, weights.config.vocab_size, 6).tolist()] for _ in PROMPTS]


def greedy(model, prompt: list[int], n: int, stamps: list) -> list[int]:
    """n greedy tokens after the prompt; the time of each appended to stamps."""
    model.reset()
    logits, out = model.forward(prompt), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        stamps.append(time.perf_counter())
        if len(out) < n:
            logits = model.forward([out[-1]])
    return out


# ---- chaos and the run (as root, outside) ------------------------------------------------------------------
class Agents:
    """The test bed's agents, killable and restartable at their addresses."""

    def __init__(self, bed, model: Path, key: Path, n: int):
        from halo.distributed import AgentProcess, agent_command

        self.bed, self.model, self.key = bed, model, key
        self.argv = {f"agent-{i}": agent_command(f"tcp://{bed.address(f'agent-{i}')}:7070", key, f"agent-{i}", 1, model)
                     for i in range(1, n + 1)}
        self.make = lambda host: AgentProcess(host, self.argv[host],
                                              popen=lambda a, **kw: bed.popen(host, a, **kw))
        self.processes = {host: self.make(host) for host in self.argv}
        self.endpoints = [p.wait_listening(60.0) for p in self.processes.values()]
        self.lock = threading.Lock()
        self.kills = self.skipped = 0

    def up(self) -> int:
        return sum(p.poll() is None for p in self.processes.values())

    def chaos(self, host: str, mttf: float, stop: threading.Event, rng: random.Random) -> None:
        """Kill this agent after Exp(mttf) seconds, restart it 1-10 s later; until stop. Runs in its own
        thread for the whole run: restarted agents die with the thread that started them."""
        while not stop.wait(rng.expovariate(1.0 / mttf)):
            with self.lock:
                if self.up() <= 1:
                    self.skipped += 1
                    continue
                p = self.processes[host]
                p.kill()
                p.wait()
                self.kills += 1
            if stop.wait(rng.uniform(1.0, 10.0)):
                return
            with self.lock:
                self.processes[host] = self.make(host)
                self.processes[host].wait_listening(60.0)
        stop.wait()

    def close(self) -> None:
        from halo.distributed import stop_processes

        stop_processes(list(self.processes.values()))


def run_mttf(mttf: float, args) -> dict:
    from halo import BUNDLED_MODEL
    from halo.rpi.testbed import LossyTestbed
    from halo.transport.reliable import generate_key

    if SHAPES[args.shape] is None:
        model = Path(str(BUNDLED_MODEL))
    elif args.shape == "tinyllama-q4":
        model = q4_checkpoint(SHAPES[args.shape])
    else:
        from halo.eval.bench_halo_speed import checkpoint

        model = checkpoint(SHAPES[args.shape])
    with tempfile.TemporaryDirectory() as tmp, LossyTestbed(n_agents=4, prefix="churn", links=args.profile) as bed:
        key = Path(tmp) / "cluster.key"
        generate_key(key)
        Path(tmp).chmod(0o755)
        agents = Agents(bed, model, key, 4)
        stop = threading.Event()
        threads = []
        try:
            if args.plr:
                bed.set_loss(args.plr)
            argv = [*module_command("halo.eval.bench_churn"), "master", "--model", str(model), "--key", str(key),
                    "--weights", args.weights, "--tokens", str(args.tokens),
                    "--endpoints", ",".join(agents.endpoints), "--duration", str(args.duration), "--sync", args.sync,
                    "--timeout", str(args.timeout), "--rejoin-after", str(args.rejoin_after), "--replan", args.replan]
            master_process = bed.popen("master", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            ready = master_process.stdout.readline()
            if not ready.startswith("READY"):
                raise RuntimeError(f"the master did not start: {master_process.stderr.read()[-3000:]}")
            rng = random.Random(int(mttf))
            for host in agents.processes:
                t = threading.Thread(target=agents.chaos, args=(host, mttf, stop, random.Random(rng.random())),
                                     daemon=True)
                t.start()
                threads.append(t)
            out, err = master_process.communicate(timeout=args.duration + 600)
            result = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), None)
            if result is None:
                raise RuntimeError(f"the master failed: {err[-3000:]}")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=70)
            agents.close()
    return summarize(mttf, result, agents, args)


TINYLLAMA_Q4 = "tinyllama-q4"  # the speed benchmarks' model: q4_checkpoint(22)


def model_file(name: str) -> Path:
    """A benchmark's --model: TINYLLAMA_Q4, a fetched model's name or a path."""
    if name == TINYLLAMA_Q4:
        return q4_checkpoint(22)
    from halo.model.loader import model_path

    return model_path(name)


def add_model_argument(parser, default: str = TINYLLAMA_Q4, why: str = "") -> None:
    """The benchmarks' --model option (model_file resolves it)."""
    parser.add_argument("--model", default=default,
                        help=f"{TINYLLAMA_Q4} (the speed benchmarks' random TinyLlama-1.1B-shaped Q4_0 GGUF, 22 layers), "
                             f"a fetched model's name (e.g. smollm2-135m-instruct) or a path (default: {default}{why})")


def q4_checkpoint(layers: int) -> Path:
    """A TinyLlama-shaped random GGUF in Q4_0 (written once, ~0.6 GB): agents slice its 4-bit blocks as stored
    (--weights native), nothing to quantize at a hello, as with the GGUF files users run."""
    from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf

    path = Path(tempfile.gettempdir()) / f"halo-bench-tinyllama-{layers}L-Q4_0.gguf"
    if not path.exists():
        partial = path.with_suffix(".partial")
        write_random_gguf(partial, {**TINYLLAMA_1_1B, "num_hidden_layers": layers}, "Q4_0")
        partial.rename(path)
    return path


def q4_with_predictors(directory: Path, layers: int = 22) -> Path:
    """q4_checkpoint's file in `directory` with untrained predictors beside it (`with_random_predictors`)."""
    return with_random_predictors(q4_checkpoint(layers), directory)


def with_random_predictors(original: Path, directory: Path) -> Path:
    """A model file in `directory` (a hard link: the same file) with untrained predictors beside it, where a master
    looks for them: HALO mode ranks groups with them (speed does not depend on what they rank)."""
    from halo.eval.random_checkpoint import write_random_predictors

    path = Path(directory) / original.name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        os.link(original, path)
    if not (path.parent / "predictors" / "manifest.json").exists():
        write_random_predictors(path, out=path.parent / "predictors")
    return path


def summarize(mttf: float, result: dict, agents: Agents, args) -> dict:
    records, recoveries = result["records"], result["recoveries"]
    ok = [r for r in records if r["error"] is None]
    span = (max(r["start"] + r["seconds"] for r in records) - min(r["start"] for r in records)) if records else 0.0
    after_loss = np.array([r["seconds"] for r in recoveries if r["kind"] == "lost"] or [np.nan])
    gaps = np.array([r["max_gap_s"] for r in records] or [np.nan])
    moved = [r["moved_groups"] for r in recoveries if r["kind"] == "lost" and r.get("moved_groups") is not None]
    return {"shape": args.shape, "weights": args.weights, "replan": args.replan, "mttf_s": mttf, "duration_s": args.duration,
            "sync": args.sync, "plr": args.plr, "tokens_per_request": args.tokens,
            "requests": len(records), "completed": len(ok), "availability": len(ok) / len(records) if records else None,
            "tokens_per_s": sum(r["tokens"] for r in ok) / span if span else None,
            "kills": agents.kills, "kills_skipped_last_agent": agents.skipped,
            "replans_after_loss": int(sum(1 for r in recoveries if r["kind"] == "lost")),
            "replans_joining": int(sum(1 for r in recoveries if r["kind"] == "joined")),
            "replans_rebalancing": int(sum(1 for r in recoveries if r["kind"] == "rebalanced")),
            "recovery_mean_s": float(np.nanmean(after_loss)), "recovery_p99_s": float(np.nanpercentile(after_loss, 99)),
            "longest_pause_s": float(np.nanmax(gaps)),
            "moved_groups_per_loss": float(np.mean(moved)) if moved else None,
            "all_texts_match": all(r["matches"] for r in ok), "texts_matching": sum(r["matches"] for r in ok),
            "errors": sorted({r["error"] for r in records if r["error"]})[:5], "recoveries": recoveries}


def report(results: list[dict], args) -> None:
    lines = ["# Churn: generation while agents die and come back", "",
             f"Command: `{command_line('halo.eval.bench_churn', args.argv)}`. Namespace test bed, 4 agents ({args.shape}, "
             f"{args.weights} weights, 1 thread each) and the master in their own namespaces on this 2-core machine, {args.sync} sync, "
             f"{100 * args.plr:g} % loss per agent link, even plan, --timeout {args.timeout:g} s, --rejoin-after "
             f"{args.rejoin_after:g} s. Requests of {args.tokens} greedy tokens back to back for {args.duration:g} s per row; "
             "every agent is killed (kill -9) after Exp(MTTF) s and restarted 1-10 s later at its address; a kill that "
             "would leave no agent is skipped; re-plans for speed (stragglers) are off, the 4 agents keep even shares "
             "(the running estimates would find the master alone faster for this model on one machine). Recovery: failure noticed -> the new plan's KV caches hold the history (refilled or replayed). Longest "
             "pause: the longest wait between two tokens of any request (detection + recovery).", "",
             "Re-plan (`--replan`): sticky (the default since stop 26: survivors keep their groups and kernels and "
             "split the lost agent's, a returning agent takes its own back, and the KV caches are filled from the "
             "residual stream the master recorded) or full (what the master did before: every share planned and "
             "built anew, the history replayed through every block). Groups built per loss: of the model's groups, "
             "those no device had kernels for.", "",
             "| re-plan | MTTF per agent | requests completed / started | availability | tokens/s | kills | re-plans after a "
             "loss / to take an agent back | recovery mean / p99 s | groups built per loss | longest pause s | texts equal "
             "the uninterrupted run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        moved = "" if r.get("moved_groups_per_loss") is None else f"{r['moved_groups_per_loss']:.0f}"
        lines.append(f"| {r.get('replan', 'full')} | {r['mttf_s']:g} s | {r['completed']} / {r['requests']} | "
                     f"{100 * r['availability']:.1f} % | "
                     f"{r['tokens_per_s']:.1f} | {r['kills']} | {r['replans_after_loss']} / {r['replans_joining']} | "
                     f"{r['recovery_mean_s']:.2f} / {r['recovery_p99_s']:.2f} | {moved} | {r['longest_pause_s']:.2f} | "
                     f"{r['texts_matching']} of {r['completed']} |")
    for r in results:
        if r["errors"]:
            lines += ["", f"Errors at MTTF {r['mttf_s']:g} s: " + "; ".join(r["errors"])]
    lines += ["", "Goal (issue 16): availability >= 99 % at MTTF 30 s with at least two devices up; recovery <= 2 s "
              "for stories260K, <= 10 s for the TinyLlama shape."]
    write_report(args.out, "churn" if args.shape == "stories260K" else f"churn_{args.shape}", {"command": command_line("halo.eval.bench_churn", args.argv), "results": results},
                 lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="run", choices=("run", "master"))
    parser.add_argument("--mttf", default="10,30,60", help="mean seconds to failure per agent, comma-separated")
    parser.add_argument("--duration", type=float, default=300.0, metavar="S", help="per MTTF (default 300)")
    parser.add_argument("--sync", default="exact", choices=("exact", "tcp"))
    parser.add_argument("--plr", type=float, default=0.0, help="silent loss on every agent link (default 0)")
    from halo.eval.bench_halo_speed import add_profile_argument

    add_profile_argument(parser)
    parser.add_argument("--timeout", type=float, default=1.0, help="the master's --timeout (default 1 s)")
    parser.add_argument("--rejoin-after", type=float, default=5.0)
    parser.add_argument("--replan", default="sticky", help="sticky (sticky re-plans, KV refill), full (full re-plans, "
                                                         "replay) or sticky,full: rows per kind (default sticky)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="stories260K",
                        help="stories260K (bundled), tinyllama (TinyLlama-1.1B shape, 22 layers, random float32 "
                             "weights) or tinyllama-q4 (the same shape as a Q4_0 GGUF: use --weights native)")
    parser.add_argument("--weights", default="fp32", help="weight format of the cluster (default fp32; int8 for "
                                                          "tinyllama, native for tinyllama-q4)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=f"greedy tokens per request (default {TOKENS})")
    parser.add_argument("--out", default="eval/results")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--endpoints", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.what == "master":
        master(args)
        return 0
    from halo.rpi.testbed import available

    ok, why = available()
    if not ok:
        print(f"the churn benchmark needs the namespace test bed: {why}", file=sys.stderr)
        return 2
    kinds = args.replan.split(",")
    if any(k not in ("sticky", "full") for k in kinds):
        parser.error(f"--replan {args.replan}: give sticky, full or sticky,full")
    results = []
    for kind in kinds:
        for mttf in [float(m) for m in args.mttf.split(",")]:
            args.replan = kind
            results.append(run_mttf(mttf, args))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "recoveries"}), flush=True)
            report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
