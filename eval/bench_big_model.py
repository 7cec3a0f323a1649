"""A model no single device can hold, across small-memory devices: every node of the cluster in a memory cgroup.

    python -m halo.eval.random_checkpoint --shape llama-3.1-8b --qtype Q4_0 --out /tmp/halo-llama-3.1-8b-Q4_0.gguf
    python -m halo.eval.bench_big_model --model /tmp/halo-llama-3.1-8b-Q4_0.gguf [--agents 3] [--limit-mb 1600]
                                        [--master-limit-mb 1600] [--plr 0,0.05] [--prompt-tokens 512] [--tokens 16]
                                        [--modes exact,halo+prepared]

The namespace test bed (rpi/testbed.py), master + N agents, each agent in its own cgroup-v1 memory group with its own
copy of the model file (rpi/limits.py), the master in one too: each --modes sync mode at each loss rate (every
node's port, both directions). HALO modes rank groups with untrained predictors written beside a hard link of the
model (speed does not depend on what they rank), every node keeping its re-mapped MLP groups within its budget;
halo+prepared: built from `halo-agent prepare`d groups, each node's own (written once per copy, ~0.7x the model). The yardstick, in the same run: the model in one process in the master's namespace, unlimited (the
Llama-3.1-8B shape's 4.5 GB fit no 1.6 GB device), and the same process under an agent's limit (it refuses, saying
what it needs, rather than be killed loading). Per row: load time (the master's start until the cluster is
ready: its weights mapped, every agent's share built and said so), the time to the first token of a prompt of
--prompt-tokens tokens (its prefill), ms per output token (median after a warm-up), each cgroup's peak against its
limit, OOM kills, and whether the tokens are the single process's. --dllama PATH adds distributed-llama (a `dllama`
binary built from its repository), root + N workers in the same namespaces, on the very Q4_0 blocks of the GGUF
(eval/dllama_files.py, written a run of rows at a time from the --shape the GGUF was written from), without memory
limits (its root keeps the 128k x 4096 embedding in float32: 2.1 GB), at no loss. Writes
eval/results/<name>.{json,md}. Needs root (test bed, cgroups); skips otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from halo.eval.bench_halo_speed import run_master, summarize
from halo.eval.bench_memory_bounded import WORK, agent_copies, one_run, prepare_copies, prepared_root
from halo.eval.report import command_line, host_line, run_script, write_report

MB = 1 << 20


def run(args) -> list[dict]:
    from halo.rpi.testbed import LossyTestbed
    from halo.transport.reliable import generate_key

    model = Path(args.model)
    copies = agent_copies(model, args.agents)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LossyTestbed(n_agents=args.agents, prefix="big") as bed:
        key = Path(tmp) / "cluster.key"
        generate_key(key)
        single = run_master(bed, model, key, [], "single", args.tokens, {}, args.time_limit, args.weights,
                            prompt_tokens=args.prompt_tokens)
        rows.append({"setup": "single process, unlimited", "plr": 0.0, **summarize(single)})
        print(rows[-1], flush=True)
        rows.append(one_process_limited(bed, args, model, key))
        print(rows[-1], flush=True)
        masters = {mode: halo_master(model, copies, mode, args.weights) if mode.startswith("halo") else (model, None)
                   for mode in args.modes.split(",")}
        for plr in (float(p) for p in args.plr.split(",")):
            bed.set_loss(plr)
            for mode, (master_model, master_prepared) in masters.items():
                row = one_run(bed, args, master_model, master_model.parent / "predictors", copies, key, mode,
                              [args.limit_mb * MB] * args.agents, master_bytes=args.master_limit_mb * MB,
                              prompt_tokens=args.prompt_tokens, master_prepared=master_prepared)
                rows.append({"setup": f"master + {args.agents} agents, {mode}", "plr": plr, **row})
                print({k: v for k, v in row.items() if k not in ("generated", "agents_memory", "udp")}, flush=True)
        bed.set_loss(0.0)
        if args.dllama:
            rows.extend(peer_rows(bed, args))
    return rows


def halo_master(model: Path, copies: list[Path], mode: str, weights: str) -> tuple[Path, Path | None]:
    """HALO mode's master: a hard link of the model with untrained predictors beside it, and (halo+prepared) its own
    prepared groups, the agents' copies prepared too. -> (the master's model, its prepared directory or None)."""
    from halo.eval.bench_churn import with_random_predictors

    master = with_random_predictors(model, WORK / f"master-{model.stem}")
    if not mode.endswith("+prepared"):
        return master, None
    prepare_copies([*copies, master], weights)
    return master, prepared_root(master)


def peer_files(args) -> tuple[Path, Path]:
    """distributed-llama's files of the GGUF's weights (written once beside it): the GGUF must be the --shape's."""
    from halo.eval.dllama_files import write_model, write_tokenizer
    from halo.eval.random_checkpoint import SHAPES
    from halo.model.loader import load_config

    cfg = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    c = load_config(args.model)
    if (c.dim, c.hidden_dim, c.n_layers, c.vocab_size) != (cfg["hidden_size"], cfg["intermediate_size"],
                                                          cfg["num_hidden_layers"], cfg["vocab_size"]):
        raise SystemExit(f"--model {args.model} is not the {args.shape} shape with {cfg['num_hidden_layers']} layers: "
                         "give the --shape (and --layers) it was written with (python -m halo.eval.random_checkpoint)")
    model = Path(args.model).with_suffix(".dllama-q40.m")
    if not model.exists():
        print(f"writing {model} (distributed-llama's file of the same blocks, a run of rows at a time)", flush=True)
        partial = model.with_suffix(".partial")
        write_model(partial, cfg, streamed=True)
        partial.rename(model)
    return model, write_tokenizer(model.with_suffix(".t"), cfg["vocab_size"])


def peer_rows(bed, args) -> list[dict]:
    """distributed-llama, root in the master's namespace and a worker in each agent's, every setting of bench_peer's,
    at no loss: ms per token as its own lines arrive (bench_peer.run_peer)."""
    from halo.eval.bench_peer import PEER_SETTINGS, PeerStalled, PeerWorkers, peer_summary, run_peer

    binary = Path(args.dllama).resolve()
    model, tokenizer = peer_files(args)
    rows, peers = [], PeerWorkers(bed, binary, args.agents)
    try:
        for setting in PEER_SETTINGS:
            peers.ready(setting)
            row = {"setup": f"{setting.name}: root + {args.agents} workers, unlimited", "plr": 0.0, "peer": True}
            try:
                row.update(peer_summary(run_peer(bed, binary, model, tokenizer, peers.addresses(setting),
                                                 setting.turbo, args.tokens, args.time_limit, stall_s=args.peer_stall)))
            except PeerStalled as e:
                row["error"] = e.short
            rows.append(row)
            print(rows[-1], flush=True)
    finally:
        peers.close()
    return rows


def one_process_limited(bed, args, model: Path, key: Path) -> dict:
    """The model in one process under an agent's memory limit: it refuses, saying what it needs (or it runs)."""
    from halo.rpi.limits import DeviceLimits

    row = {"setup": f"single process in {args.limit_mb} MB", "plr": 0.0}
    with DeviceLimits("big-single", args.limit_mb * MB) as limits:
        try:
            row.update(summarize(run_master(bed, model, key, [], "single", args.tokens, {}, args.time_limit,
                                            args.weights, prompt_tokens=args.prompt_tokens, preexec_fn=limits.join)))
        except RuntimeError as e:
            last = next((line for line in reversed(str(e).splitlines()) if line.strip()), str(e))
            row["error"] = last.split("Error: ", 1)[-1]  # (the refusal, without its exception's name)
        row["master"] = limits.usage()
    return row


def render(rows: list[dict], args) -> list[str]:
    single = rows[0]
    lines = [f"# A model no device holds: {Path(args.model).name}, master + {args.agents} agents, each in "
             f"{args.limit_mb} MB", "", f"`{command_line('halo.eval.bench_big_model', args.argv)}`. {host_line()}", "",
             f"Namespace test bed on this machine's cores (every node shares them), weights `{args.weights}`, sync "
             f"{', '.join(args.modes.split(','))}" + (
                 " (HALO: untrained predictors, every node's re-mapped MLP groups within its budget, built from its "
                 "own `halo-agent prepare`d groups in +prepared rows; over lossless links a layer's groups stay where "
                 "they are, over lossy ones those crossing the critical cut move)" if "halo" in args.modes else "") +
             f"; every agent in a memory cgroup of {args.limit_mb} MB with its own model copy, the master in one "
             f"of {args.master_limit_mb} MB; loss on every node's port, both directions. Load: the master's start "
             f"until every share is built; first token: the {single.get('prompt_tokens')}-token prompt's pass; "
             f"ms/token: median of {args.tokens} after a warm-up. The single process (unlimited: the model does not "
             "fit one such device) is the yardstick of the same run." + (
                 " `dllama`: distributed-llama (its `--net-turbo 0`; `dllama turbo`: 1), root in the master's "
                 "namespace and a worker in each agent's, on the GGUF's very Q4_0 blocks (eval/dllama_files.py), "
                 "without memory limits (its root holds the 128k x 4096 embedding in float32, 2.1 GB), at no loss."
                 if any(r.get("peer") for r in rows) else ""), "",
             "| setup | loss | load (s) | first token (s) | ms/token | vs single | agents' cgroup peak / limit (MB) | "
             "master's or the one process's (MB) | OOM kills | partials dropped | tokens = single |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("peer") and "error" not in r:  # the peer's row: its times only
            lines.append(f"| {r['setup']} | {r['plr']:.0%} | - | - | {r['ms_median']:.1f} | "
                         f"{r['ms_median'] / single['ms_median']:.2f}x | - | - | - | - | - |")
            continue
        if "error" in r or "ms_median" not in r:
            ooms = (r.get("master") or {}).get("oom_kills", 0)
            lines.append(f"| {r['setup']} | {r['plr']:.0%} | failed: {r.get('error', '?')} | | | | | | {ooms} | | |")
            continue
        agents, master = r.get("agents", []), r.get("master") or {}
        peak = max((a["max_usage_bytes"] for a in agents), default=0) / MB
        limit = f"{peak:.0f} / {args.limit_mb}" if agents else "-"
        master_use = f"{master['max_usage_bytes'] / MB:.0f} / {master['limit_bytes'] // MB}" if master else "-"
        ooms = sum(a.get("oom_kills", 0) for a in agents) + master.get("oom_kills", 0)
        same = "yes" if r["generated"] == single["generated"] else "no"
        dropped = f"{r['partials_dropped']} of {r['partials']}" if "partials" in r else "-"
        lines.append(f"| {r['setup']} | {r['plr']:.0%} | {r['load_s']:.1f} | {r['prefill_ms'] / 1e3:.1f} | "
                     f"{r['ms_median']:.1f} | {r['ms_median'] / single['ms_median']:.2f}x | {limit} | {master_use} | "
                     f"{ooms} | {dropped} | {same} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GGUF file (see above for the Llama-3.1-8B shape)")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--limit-mb", type=int, default=1600, help="each agent's memory cgroup limit")
    parser.add_argument("--master-limit-mb", type=int, default=1600, help="the master's memory cgroup limit")
    parser.add_argument("--plr", default="0,0.05", help="loss rates of the cluster rows")
    parser.add_argument("--modes", default="exact", help="sync modes of the cluster rows: exact, halo (re-mapped groups "
                        "built from the model file), halo+prepared (from `halo-agent prepare`d groups)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="the prompt's length (its pass: the first token)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--weights", default="native")
    parser.add_argument("--time-limit", type=float, default=1200.0)
    parser.add_argument("--dllama", help="distributed-llama's dllama binary: its rows too (see above)")
    parser.add_argument("--shape", default="llama-3.1-8b", help="with --dllama: the random_checkpoint --shape the GGUF "
                        "was written from (default llama-3.1-8b)")
    parser.add_argument("--layers", type=int, help="with --dllama: its --layers, if it was given one")
    parser.add_argument("--peer-stall", type=float, default=600.0, help="with --dllama: seconds without a token "
                        "before its root is stopped and the row recorded as stalled")
    parser.add_argument("--name", default="big_model")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if args.dllama and not Path(args.dllama).is_file():
        parser.error(f"--dllama {args.dllama}: no such file (build it: git clone distributed-llama; make dllama)")
    from halo.rpi.limits import available as limits_available
    from halo.rpi.testbed import available

    for ok, why in (available(), limits_available()):
        if not ok:
            print(f"skipped: {why}")
            return 0
    rows = run(args)
    write_report(args.out, args.name, {"command": command_line("halo.eval.bench_big_model", args.argv),
                                        "model": args.model, "rows": rows}, render(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
