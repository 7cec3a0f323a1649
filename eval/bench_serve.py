"""Load test of `halo-master serve`: concurrent streaming clients against one cluster, batched and one at a time.

    python -m halo.eval.bench_serve                      # the settings below, 16 clients, 60 s each
    python -m halo.eval.bench_serve --settings one,many --duration 30

Settings (--model over --agents local agents on loopback, exact sync, in one run):
- one-sequential: one client, `--slots 1` (one generation at a time: the engine before continuous batching);
- one: one client, `--slots --slots` (continuous batching, alone in the batch);
- many: --clients clients, `--slots --slots`;
- many-sequential: --clients clients, `--slots 1` (each waits in the queue for the one before);
  (--plan: the local settings' plan, default the measured one `halo-master serve` makes; no re-plans from the running
  estimates: on 2 shared cores they move a lone client's work to the master, and settings would compare plans);
- testbed: the namespace test bed (rpi/testbed.py, prefix "serve"; needs root): --agents agents in their own
  namespaces behind silent nftables loss of --plr (default 2 %) on every agent link both ways, the
  server in the master's namespace, one client and then --clients clients, `--slots --slots`, --testbed-sync
  (default exact).

"Inside this run" compares settings of the run: all clients' tokens/s against one client's, and one client's pace
batched against one generation at a time.

Each of --clients clients (the official openai client, asyncio) sends streaming completions back to
back for --duration seconds (prompts from a fixed list, --max-tokens tokens, temperature 0.8, fresh
seeds); a request started before the end runs to completion. Per request: time to first token (first
non-empty text, queueing included), ms per token after the first, completion tokens (the usage chunk), errors
(HTTP errors, error events, a stream without [DONE]). The server's resident memory is
sampled every second (psutil) from the first request on: "flat" = its growth over the run.

Writes eval/results/serve_load.{json,md}. The clients run in the server's namespace (a subprocess:
`python -m halo.eval.bench_serve clients ...`), so the test bed's loss hits only the agents' links.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from halo.errors import HaloError
from halo.eval.bench_halo_speed import add_profile_argument
from halo.eval.report import command_line, host, host_line, run_script, write_report
from halo.runtime.local import AgentProcess, module_command

PROMPTS = ("Once upon a time", "One day, a little girl named Lily", "The cat and the dog", "Tom wanted to",
           "In the park there was", "Sue and her mom went", "The sun was shining and", "A big red ball")


# ---- the clients (inside the server's namespace) -----------------------------------------------------------------
MODEL_NAME = "bench"  # the server's --model-name, what the clients ask for


async def one_client(client, index: int, deadline: float, max_tokens: int, records: list) -> None:
    n = 0
    while time.monotonic() < deadline:
        record = {"client": index, "start": time.time(), "ttft_s": None, "tokens": 0, "error": None, "last_s": None}
        t0 = time.perf_counter()
        try:
            stream = await client.completions.create(
                model=MODEL_NAME, prompt=PROMPTS[(index + n) % len(PROMPTS)], max_tokens=max_tokens,
                temperature=0.8, seed=1000 * index + n, stream=True, stream_options={"include_usage": True})
            finished = False
            async for chunk in stream:
                if chunk.usage:
                    record["tokens"] = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.text and record["ttft_s"] is None:
                        record["ttft_s"] = time.perf_counter() - t0
                    if choice.text:
                        record["last_s"] = time.perf_counter() - t0
                    finished = finished or choice.finish_reason is not None
            if not finished:
                record["error"] = "stream ended without a finish_reason"
        except Exception as e:  # noqa: BLE001 - every failure is a data point
            record["error"] = f"{type(e).__name__}: {e}"[:300]
        record["seconds"] = time.perf_counter() - t0
        records.append(record)
        n += 1


async def run_clients(url: str, clients: int, duration: float, max_tokens: int) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    records: list[dict] = []
    deadline = time.monotonic() + duration
    await asyncio.gather(*(one_client(client, i, deadline, max_tokens, records) for i in range(clients)))
    await client.close()
    return records


def clients_main(args) -> None:
    records = asyncio.run(run_clients(args.url, args.clients, args.duration, args.max_tokens))
    print("RESULT " + json.dumps(records), flush=True)


# ---- one setting -------------------------------------------------------------------------------------------------
def start_server(popen, argv: list[str]) -> tuple[AgentProcess, str]:
    server = AgentProcess("server", [*module_command("halo.cli.master"), "serve", "--port", "0", "--log-level", "warning",
                                     "--max-queue", "64", "--request-timeout", "600", "--model-name", MODEL_NAME,
                                     *argv], popen)
    try:
        return server, server.wait_listening(120)
    except HaloError as e:
        server.kill()
        raise RuntimeError(f"the server did not start: {e}") from None


def sample_memory(pid: int, stop: threading.Event, samples: list) -> None:
    import psutil

    process = psutil.Process(pid)
    t0 = time.monotonic()
    while not stop.is_set():
        try:
            samples.append((time.monotonic() - t0, process.memory_info().rss))
        except psutil.Error:
            return
        stop.wait(1.0)


def run_setting(name: str, popen, server_argv: list[str], args, clients: int | None = None) -> dict:
    from halo.distributed import stop_processes

    clients = clients or args.clients
    server, url = start_server(popen, ["--model", args.model, *server_argv])
    samples: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_memory, args=(server.pid, stop, samples), daemon=True)
    try:
        sampler.start()
        process = popen([*module_command("halo.eval.bench_serve"), "clients", "--url", url, "--clients",
                         str(clients), "--duration", str(args.duration), "--max-tokens", str(args.max_tokens)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = process.communicate(timeout=args.duration + 900)
        records = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), None)
        if records is None:
            raise RuntimeError(f"the clients failed: {err[-3000:]}")
        status = popen([*module_command("halo.cli.master"), "status", "--server", url, "--json"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
        view = json.loads(status.communicate(timeout=60)[0] or "null")  # the cluster view after the run
        alive = server.poll() is None
    finally:
        stop.set()
        sampler.join()
        stop_processes([server], grace_s=15)
    return summarize(name, records, samples, alive, args, view, clients, slots_of(server_argv))


def slots_of(argv: list[str]) -> int:
    return int(argv[argv.index("--slots") + 1])


def summarize(name: str, records: list[dict], samples: list, alive: bool, args, view, clients: int, slots: int) -> dict:
    ok = [r for r in records if r["error"] is None]
    ttft = np.array([r["ttft_s"] for r in ok if r["ttft_s"] is not None])
    pace = np.array([1e3 * (r["last_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in ok
                     if r["ttft_s"] is not None and r["last_s"] is not None and r["tokens"] > 1])
    tokens = sum(r["tokens"] for r in ok)
    span = (max(r["start"] + r["seconds"] for r in records) - min(r["start"] for r in records)) if records else 0.0
    rss = np.array([s[1] for s in samples], dtype=float) / 2**20
    times = np.array([s[0] for s in samples])
    half = len(rss) // 2
    return {
        "setting": name, "clients": clients, "slots": slots, "duration_s": args.duration, "max_tokens": args.max_tokens,
        "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
        "error_examples": sorted({r["error"] for r in records if r["error"]})[:5],
        "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else None,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else None,
        "ttft_min_s": float(ttft.min()) if len(ttft) else None,
        "ms_per_token_p50": float(np.percentile(pace, 50)) if len(pace) else None,
        "completion_tokens": tokens, "wall_s": span, "tokens_per_s": tokens / span if span else None,
        "server_alive_after": alive,
        "rss_mb_first": float(rss[0]) if len(rss) else None, "rss_mb_last": float(rss[-1]) if len(rss) else None,
        "rss_mb_max": float(rss.max()) if len(rss) else None,
        # flat: the second half's mean against the first half's (start-up allocations settle early)
        "rss_mb_growth_second_half": float(rss[half:].mean() - rss[:half].mean()) if half else None,
        "rss_mb_per_min_fit": float(np.polyfit(times, rss, 1)[0] * 60) if len(rss) > 2 else None,
        "server_view": view, "records": records,
    }


def local_setting(slots: int, clients: int):
    def run(args) -> dict:
        how = "one at a time" if slots == 1 else "batched"
        plan = ["--plan", args.plan] if args.plan else []
        result = run_setting(f"{clients} client{'s' if clients > 1 else ''}, {args.agents} local agents, exact sync, "
                             f"{args.plan or 'measured'} plan, --slots {slots} ({how})", subprocess.Popen,
                             ["--local-agents", str(args.agents), "--slots", str(slots), "--rebalance-every", "0", *plan],
                             args, clients)
        return [{**result, "place": "local"}]
    return run


def testbed(args) -> list[dict]:
    """One client, then --clients clients, each against its own server on one bed (the agents stay up between)."""
    from halo.model.catalog import resolve_model
    from halo.rpi.testbed import LossyTestbed, available
    from halo.transport.reliable import generate_key

    from halo.eval.bench_halo_speed import Cluster

    ok, why = available()
    if not ok:
        return [{"setting": f"testbed {100 * args.plr:g} % loss", "skipped": why}]
    with tempfile.TemporaryDirectory() as tmp, LossyTestbed(n_agents=args.agents, prefix="serve",
                                                            links=args.profile) as bed:
        key = Path(tmp) / "cluster.key"
        generate_key(key)
        os.chmod(tmp, 0o755)
        cluster = Cluster(bed, Path(resolve_model(args.model)), key, args.agents)
        try:
            bed.set_loss(args.plr)

            def popen(argv, **kwargs):
                return bed.popen("master", argv, **kwargs)

            # a keyword plan (--testbed-plan) and no re-plans: the measured plan, and the running estimates, would leave both
            # lossy agents out for a model this small (the master alone is faster), and no load would cross a
            # lossy link
            results = []
            for clients in (1, args.clients):
                before = bed.drop_counters()
                result = run_setting(
                    f"test bed: {clients} client{'s' if clients > 1 else ''}, {args.agents} agents, {100 * args.plr:g} % "
                    f"loss on every agent link, {args.testbed_sync} sync, {args.testbed_plan} plan, --slots {args.slots}", popen,
                    ["--agents", ",".join(e.removeprefix("tcp://") for e in cluster.endpoints),
                     "--key", str(key), "--sync", args.testbed_sync, "--timeout", "5", "--plan", args.testbed_plan,
                     "--rebalance-every", "0", "--slots", str(args.slots)], args, clients)
                after = bed.drop_counters()
                results.append({**result, "place": "bed",
                                "frames_dropped": {k: v - before.get(k, 0) for k, v in after.items()}})
            return results
        finally:
            cluster.close()


def report(results: list[dict], args) -> None:
    lines = [f"# `halo-master serve` under load ({args.model})", "",
             f"Command: `{command_line('halo.eval.bench_serve', args.argv)}`. Streaming clients (official openai "
             f"client) send completions back to back for {args.duration:g} s each, {args.max_tokens} tokens per "
             "request, temperature 0.8, prompts of 4-9 words. Time to first token includes any wait for a slot. "
             "Server memory: resident set sampled every second. --slots 1 is one generation at a time (the engine "
             "before continuous batching); more slots decode the running requests together in every pass.", "",
             "| setting | devices (share of the groups) | requests completed | errors | TTFT p50 s | TTFT p99 s | "
             "ms/token p50 (per request) | tokens/s (all clients) | server up after | RSS first / max / last MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['setting']} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        shares = ", ".join(f"{d['name']} {100 * d['share']:.0f} %" for d in (r.get("server_view") or {}).get("devices", [])
                           if d.get("share") is not None)
        lines.append(f"| {r['setting']} | {shares or '?'} | {r['completed']} | {r['errors']} | {f(r['ttft_p50_s'])} | "
                     f"{f(r['ttft_p99_s'])} | {f(r['ms_per_token_p50'], 1)} | {f(r['tokens_per_s'], 1)} | "
                     f"{'yes' if r['server_alive_after'] else 'NO'} | "
                     f"{f(r['rss_mb_first'], 0)} / {f(r['rss_mb_max'], 0)} / {f(r['rss_mb_last'], 0)} |")
    ratios = compare(results)
    if ratios:
        lines += ["", "Inside this run:", ""] + [f"- {line}" for line in ratios]
    for r in results:
        if r.get("error_examples"):
            lines += ["", f"Errors in '{r['setting']}': " + "; ".join(r["error_examples"])]
        if r.get("frames_dropped"):
            lines += ["", f"Frames dropped by the test bed in '{r['setting']}': {r['frames_dropped']}"]
    lines += ["", f"{host_line()} Load average when the "
              f"run started (above ~0.5 something else ran): {args.load_at_start:.2f}."]
    data = {"command": command_line("halo.eval.bench_serve", args.argv), "load_at_start": args.load_at_start,
            "host": host(), "ratios": ratios, "results": results}
    write_report(args.out, "serve_load", data, lines)


def compare(results: list[dict]) -> list[str]:
    """The goals' ratios between settings of this run: all clients' tokens/s batched against one client's, one
    client's pace batched against one generation at a time."""
    out = []
    for place in ("local", "bed"):
        here = [r for r in results if r.get("place") == place]
        one = {r["slots"]: r for r in here if r["clients"] == 1}
        many = {r["slots"]: r for r in here if r["clients"] > 1}
        for slots, r in many.items():
            alone = one.get(slots) or one.get(1)
            if alone and alone["tokens_per_s"] and r["tokens_per_s"]:
                out.append(f"{place}: {r['clients']} clients, --slots {slots}: "
                           f"{r['tokens_per_s'] / alone['tokens_per_s']:.2f}x the tokens/s of one client alone (--slots "
                           f"{alone['slots']}); TTFT p99 {r['ttft_p99_s']:.2f} s")
        batched = [s for s in one if s > 1]
        if batched and 1 in one and one[1]["ms_per_token_p50"] and one[batched[0]]["ms_per_token_p50"]:
            out.append(f"{place}: one client: {one[batched[0]]['ms_per_token_p50'] / one[1]['ms_per_token_p50']:.2f}x "
                       f"the ms/token of one generation at a time (--slots {batched[0]} against --slots 1)")
    return out


def main(argv=None) -> int:
    from halo.scheduler.even import EVEN_PLANS
    from halo.sync import SYNC_MODES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="run", choices=("run", "clients"))
    parser.add_argument("--settings", default="one-sequential,one,many,many-sequential,testbed",
                        help="comma-separated: one-sequential, one, many, many-sequential, testbed")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model file or fetched name (default "
                        "smollm2-135m-instruct)")
    parser.add_argument("--agents", type=int, default=3, help="local agents (and test-bed agents) beside the master")
    parser.add_argument("--slots", type=int, default=16, help="KV-cache slots of the batched settings (default 16)")
    parser.add_argument("--plan", help="the local settings' plan (default: measured, as halo-master serve plans; "
                        "paired-mlp suits agents on the master's cores)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=60.0, metavar="S")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--plr", type=float, default=0.02, help="test bed loss on every agent link (default 0.02)")
    parser.add_argument("--testbed-sync", default="exact", help="the test bed's sync mode (default exact)")
    parser.add_argument("--testbed-plan", default="paired-mlp", choices=tuple(EVEN_PLANS),
                        help="the test bed's keyword plan (default paired-mlp: on the bed's 2 shared cores 2.6x the "
                             "tokens/s of even, one client and 16 alike)")
    add_profile_argument(parser)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.load_at_start = os.getloadavg()[0]
    if args.what == "clients":
        clients_main(args)
        return 0
    runners = {"one-sequential": local_setting(1, 1), "one": local_setting(args.slots, 1),
               "many": local_setting(args.slots, args.clients), "many-sequential": local_setting(1, args.clients),
               "testbed": testbed}
    unknown = [name for name in args.settings.split(",") if name not in runners]
    if unknown:
        parser.error(f"unknown settings {unknown}: choose from {', '.join(runners)}")
    if min(args.clients, args.slots, args.max_tokens, args.agents) < 1 or args.duration <= 0:
        parser.error("--clients, --slots, --max-tokens and --agents must be at least 1, --duration above 0")
    if args.testbed_sync not in SYNC_MODES:
        parser.error(f"--testbed-sync {args.testbed_sync!r}: choose from {', '.join(SYNC_MODES)}")
    bed_only = [option for option, used in (("--plr", args.plr != 0.02), ("--profile", bool(args.profile)),
                                            ("--testbed-sync", args.testbed_sync != "exact"),
                                            ("--testbed-plan", args.testbed_plan != "paired-mlp")) if used]
    if bed_only and "testbed" not in args.settings.split(","):  # (they were ignored)
        parser.error(f"{', '.join(bed_only)}: the testbed setting's options; add testbed to --settings")
    results = []
    for name in args.settings.split(","):
        for result in runners[name](args):
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k not in ("records", "server_view")}), flush=True)
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
