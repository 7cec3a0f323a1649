"""Accuracy under loss through the runtime: the model over N local agents, every UDP sender dropping a seeded
fraction of its datagrams, per sync mode; what a user of `halo-master generate --local-agents N` would get.

    python -m halo.eval.accuracy_runtime --model smollm2-135m-instruct --agents 4 --plr 0.01,0.02,0.05,0.1

Every configuration is compared with the lossless reference, the same weights in one process (a lossless
cluster gives its tokens: eval/results/halo_speed_smollm2.md), on the same data:
- perplexity of held-out text (the last 20 % of tinystories_valid_dev.txt), teacher-forced one token per
  forward as generation runs: decode rounds are where loss costs accuracy (a prefill's rounds have
  token-scaled deadlines and recover every lost chunk);
- top-1 agreement: the next-token argmax at every position of that text equals the reference's;
- continuation exact-match: greedy continuations of held-out prompts equal the reference's, token for token;
- chat answers identical: 50 fixed questions (eval/chat_prompts.txt) through the model's chat template, the
  greedy answer equal to the reference's (the path of `halo-master generate --chat`).
Exact mode recovers every loss: its row at the highest PLR is the check that the runtime loses nothing there.
Rows are written after every configuration (a long run that stops keeps what it measured).
Writes eval/results/accuracy_runtime_<model>.{json,md}.

On radio links instead of injected loss (--profile: the namespace bed, rpi/testbed.py, with every agent's link
emulated as rpi/links.py says: delay, jitter, loss in bursts, rate; root), the master in its namespace and the
agents in theirs, each a process of its own, as a household would run them:

    python -m halo.eval.accuracy_runtime --profile wifi-busy --agents 3 --modes halo --plr 0 --copies 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from halo.eval.bench_halo_speed import add_profile_argument, profile_sentence
from halo.eval.report import command_line, host_line, run_script, write_report

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories_valid_dev.txt"
CHAT_PROMPTS = Path(__file__).with_name("chat_prompts.txt")
RESERVED_SETTINGS = {"mode", "copies", "inject_plr", "seed", "wire_partials"}  # --settings may not give these


@dataclass
class Scored:
    """Teacher-forced scores of held-out windows: per predicted token its NLL and the argmax there."""

    nll: list[float] = field(default_factory=list)
    top1: list[int] = field(default_factory=list)
    ms: list[float] = field(default_factory=list)

    @property
    def perplexity(self) -> float:
        return float(np.exp(np.mean(self.nll)))


def held_out_tokens(tokenizer, path: str, n_tokens: int) -> list[int]:
    """The first n_tokens of the held-out 20 % of the text (the predictors trained on the other 80 %)."""
    from halo.predictors.profiler import split_text

    text = split_text(Path(path).read_text(encoding="utf-8"), 0.8)[1]
    tokens = tokenizer.encode(text[:40 * n_tokens], bos=False)[:n_tokens]
    if len(tokens) < n_tokens:
        raise SystemExit(f"{path} holds out only {len(tokens)} tokens; ask for fewer")
    return tokens


def start_token(tokenizer) -> int:
    return tokenizer.bos_id if tokenizer.bos_id is not None else 0


def held_out_windows(tokenizer, path: str, n_tokens: int, window: int = 64) -> list[list[int]]:
    """n_tokens of held-out text in windows that each start at BOS (or token 0)."""
    tokens = held_out_tokens(tokenizer, path, n_tokens)
    bos = start_token(tokenizer)
    return [[bos] + tokens[i:i + window - 1] for i in range(0, len(tokens), window - 1) if len(tokens[i:i + window - 1]) > 1]


def teacher_forced(model, windows: list[list[int]]) -> Scored:
    """One token per forward, as generation runs: the NLL of every next token and the argmax before it."""
    scored = Scored()
    for window in windows:
        model.reset()
        for t in range(len(window) - 1):
            start = time.perf_counter()
            logits = np.asarray(model.forward([window[t]]), dtype=np.float64).reshape(-1)
            scored.ms.append(1e3 * (time.perf_counter() - start))
            top = logits.max()
            scored.nll.append(float(top + np.log(np.exp(logits - top).sum()) - logits[window[t + 1]]))
            scored.top1.append(int(logits.argmax()))
    return scored


def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    model.reset()
    logits = np.asarray(model.forward(prompt)).reshape(-1)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = np.asarray(model.forward([out[-1]])).reshape(-1)
    return out


def chat_questions(limit: int, path: Path = CHAT_PROMPTS) -> list[str]:
    return [q for q in Path(path).read_text(encoding="utf-8").splitlines() if q.strip()][:limit]


def measure(model, tokenizer, data: dict, answer_tokens: int, progress: bool = False) -> dict:
    """Everything one configuration is scored on, as token ids (compared with the reference afterwards).
    progress: a bar on stderr per part (a run over radio links takes tens of minutes)."""
    from halo.generation.generate import generate
    from halo.model.chat import chat_prompt

    def steps(items, what: str):
        if not progress:
            return items
        from tqdm import tqdm

        return tqdm(items, desc=what, unit="", file=sys.stderr, mininterval=5.0)

    scored = teacher_forced(model, steps(data["windows"], "perplexity windows"))
    continuations = [greedy_tokens(model, p, data["continuation_tokens"]) for p in steps(data["prompts"], "continuations")]
    chats = [generate(model, tokenizer, chat_prompt(tokenizer, [{"role": "user", "content": q}]), answer_tokens).token_ids
             for q in steps(data["chats"], "chat answers")]
    return {"nll": scored.nll, "top1": scored.top1, "perplexity": scored.perplexity,
            "ms_per_token": float(np.median(scored.ms)), "continuations": continuations, "chats": chats}


def compared(result: dict, reference: dict) -> dict:
    """A configuration's scores against the reference's."""
    top1 = np.asarray(result["top1"]) == np.asarray(reference["top1"])
    return {"perplexity": result["perplexity"], "ppl_change": result["perplexity"] / reference["perplexity"] - 1,
            "top1_agreement": float(top1.mean()),
            "continuation_exact": float(np.mean([a == b for a, b in zip(result["continuations"], reference["continuations"])])),
            "chat_identical": (float(np.mean([a == b for a, b in zip(result["chats"], reference["chats"])]))
                               if reference["chats"] else None),
            "ms_per_token": result["ms_per_token"]}


def sync_fields(args, mode: str, inject_plr: float = 0.0) -> dict:
    """One configuration's SyncSettings fields (auto measures the links first, starting from exact's)."""
    return {"mode": "exact" if mode == "auto" else mode, "inject_plr": inject_plr, "seed": args.seed,
            "copies": args.copies, "wire_partials": "fp32" if mode in ("exact", "auto") else args.wire_partials,
            **json.loads(args.settings)}


def config_row(args, agents: int, mode: str, plr: float) -> dict:
    """What a results row says of its configuration (its scores are added to it)."""
    return {"agents": agents, "sync": mode, "plr": plr, "wire_partials": sync_fields(args, mode)["wire_partials"],
            "copies": args.copies, "settings": json.loads(args.settings), "plan": args.plan}


def run_cluster(model_path: str, weights, tokenizer, data: dict, args, agents: int, mode: str, plr: float) -> dict:
    """One configuration over freshly started local agents (a failure is a row that says why, not the end of
    the study). An agent lost mid-run ends the configuration: a re-plan would change what is measured."""
    from halo.distributed.connect import connect
    from halo.errors import HaloError
    from halo.sync import SyncSettings

    row = config_row(args, agents, mode, plr)
    start = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            model = connect(weights, stack, model_path=model_path, local_agents=agents, fmt="native",
                            sync=SyncSettings(**sync_fields(args, mode, inject_plr=plr)), auto_sync=mode == "auto",
                            predictors=args.predictors, plan=args.plan,  # (--plan was ignored on loopback)
                            context=args.context, survive=None)
            stack.callback(model.close)
            row["result"] = measure(model, tokenizer, data, args.answer_tokens)
            row["loss"] = model.sync_report()["loss"]
    except HaloError as e:
        row["error"] = str(e)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def run_on_bed(model_path: str, data: dict, args, agents: int, mode: str, plr: float) -> dict:
    """One configuration over the namespace bed with --profile links: agents in their namespaces, the master in its
    own (this module again, --bed-master SPEC), scoring the same data; plr adds independent loss on every agent's
    port on top of the profile's bursts. A failure is a row that says why."""
    from halo.errors import HaloError
    from halo.eval.bench_halo_speed import Cluster, with_testbed
    from halo.runtime.local import module_command
    from halo.transport.reliable import generate_key

    row = {**config_row(args, agents, mode, plr), "profile": args.profile}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, with_testbed(agents, args.profile, prefix="ha") as bed:
        key, spec, result = Path(tmp) / "cluster.key", Path(tmp) / "spec.json", Path(tmp) / "result.json"
        generate_key(key)
        bed.set_loss(plr)
        try:
            cluster = Cluster(bed, Path(model_path), key, agents)
        except HaloError as e:  # an agent that did not start: this configuration's row says so
            row.update(error=f"the agents did not start: {e}", seconds=round(time.perf_counter() - start, 1))
            return row
        try:
            spec.write_text(json.dumps({"model": model_path, "key": str(key), "endpoints": cluster.endpoints,
                                        "mode": mode, "plan": args.plan, "sync": sync_fields(args, mode),
                                        "predictors": args.predictors,
                                        "context": args.context, "answer_tokens": args.answer_tokens, "data": data,
                                        "result": str(result)}))
            done = bed.popen("master", module_command("halo.eval.accuracy_runtime", "--bed-master", str(spec)),
                             stdout=subprocess.PIPE, stderr=None, text=True)
            done.communicate(timeout=args.bed_timeout)
            if result.exists():
                row.update(json.loads(result.read_text()))
            else:
                row["error"] = f"the master in the bed wrote no result (exit status {done.returncode}; its log above)"
            row["dropped_frames"] = bed.drop_counters()
        except subprocess.TimeoutExpired:
            done.kill()
            done.wait()
            row["error"] = f"no result within --bed-timeout {args.bed_timeout:.0f} s"
        finally:
            cluster.close()
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def bed_master(spec_path: str) -> int:
    """Inside the bed's master namespace: the cluster over the spec's agents, as `halo-master generate --agents`
    builds it (survive=None: an agent lost mid-run ends the configuration), scored on the spec's data."""
    from halo.distributed.connect import connect
    from halo.errors import HaloError
    from halo.model.loader import load_tokenizer, load_weights
    from halo.sync import SyncSettings

    spec = json.loads(Path(spec_path).read_text())
    weights = load_weights(spec["model"])
    tokenizer = load_tokenizer(weights)
    out: dict = {}
    try:
        with contextlib.ExitStack() as stack:
            model = connect(weights, stack, model_path=spec["model"], agents=spec["endpoints"], plan=spec["plan"],
                            key=spec["key"], context=spec["context"], fmt="native", predictors=spec["predictors"],
                            auto_sync=spec["mode"] == "auto", survive=None,
                            sync=SyncSettings(**spec["sync"]))
            stack.callback(model.close)
            out["result"] = measure(model, tokenizer, spec["data"], spec["answer_tokens"], progress=True)
            report = model.sync_report()
            out.update(loss=report["loss"], sync_auto=getattr(model, "sync_auto", None))
    except HaloError as e:
        out["error"] = str(e)
    Path(spec["result"]).write_text(json.dumps(out))
    return 0 if "error" not in out else 1


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f} %"


def data_fingerprint(data: dict, context: int) -> str:
    """What a reference was measured on, token for token (windows, prompts, chat questions, lengths, context)."""
    import hashlib

    return hashlib.sha256(json.dumps([data, context], sort_keys=True).encode()).hexdigest()


def previous_run(path: Path, model: str, data: dict, chat_prompts: str, context: int) -> dict | None:
    """--append: the earlier run's results when they scored the same model on the same data, token for token (its
    reference is reused and its rows kept); None when there is none to extend. (Lengths alone were compared: other
    text of the same length gave a lossless row -54 % perplexity and 16 % top-1 agreement.)"""
    if not path.exists():
        return None
    out = json.loads(path.read_text())
    same = (out["model"] == model and out.get("data_sha256") == data_fingerprint(data, context)
            and out.get("chat_prompts", chat_prompts) == chat_prompts)
    if not same:
        raise SystemExit(f"--append: {path} scored other data, another model or another context (or was written "
                         "before runs recorded what they scored); use the same settings, or another --name")
    out.setdefault("commands", [out.pop("command")] if "command" in out else [])
    return out


def render(data: dict) -> list[str]:
    ref = data["reference"]
    commands = "; ".join(f"`{c}`" for c in data["commands"])
    profiles = sorted({r["profile"] for r in data["rows"] if r.get("profile")})
    where = ("Master + N local agents on loopback; every UDP sender drops PLR of its datagrams (seeded, `--inject-plr`)."
             if not profiles else
             "Master + N agents in the namespace test bed, each a process in its own namespace"
             + "".join(profile_sentence(p) for p in profiles) + "; PLR: independent loss on every agent's port on top "
             "(nftables), the plan and copies as each row says.")
    title = "injected loss" if not profiles else "radio links (" + ", ".join(profiles) + ")"
    lines = [f"# Accuracy under {title} through the runtime: {data['model']}", "",
             f"Commands (each appends its rows): {commands}. {data.get('host', '')}", "",
             f"{where} Chat questions: {data.get('chat_prompts', CHAT_PROMPTS.name)}. "
             f"Reference: the same weights in one process, perplexity {ref['perplexity']:.3f} over "
             f"{len(ref['nll'])} held-out tokens (teacher-forced, one token per forward), "
             f"{len(ref['continuations'])} held-out prompts for {data['continuation_tokens']}-token greedy "
             f"continuations, {len(ref['chats'])} chat questions answered greedily up to {data['answer_tokens']} tokens. "
             "Partials dropped: agents' partial sums with a zero-filled chunk, by cause (loss: its recovery missed the "
             "deadline / late: nothing lost, it came after the late deadline).", "",
             "| agents | sync | PLR | perplexity | vs lossless | top-1 agreement | continuation exact-match | "
             "chat answers identical | partials dropped (loss / late) of | ms/token (median) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        wire_format = "" if row.get("wire_partials", "fp32") == "fp32" else f", {row['wire_partials']} partials"
        extras = "".join(f", {label}" for label in (f"{row['copies']} copies" if row.get("copies") else "",
                                                    *(f"{k} {v}" for k, v in row.get("settings", {}).items()),
                                                    f"plan {row['plan']}" if row.get("plan") else "",
                                                    f"picked {row['sync_auto'].get('mode')}"
                                                    if row.get("sync_auto") else "") if label)
        link = f"{row['profile']} + " if row.get("profile") else ""
        head = f"| {row['agents']} | {row['sync']}{wire_format}{extras} | {link}{100 * row['plr']:g} % |"
        if "error" in row:
            lines.append(f"{head} failed: {row['error'][:200]} | | | | | | |")
            continue
        c, loss = row["compared"], row["loss"]
        lines.append(f"{head} {c['perplexity']:.3f} | {100 * c['ppl_change']:+.2f} % | {100 * c['top1_agreement']:.1f} % | "
                     f"{100 * c['continuation_exact']:.0f} % | {percent(c['chat_identical'])} | "
                     f"{loss['dropped_for_loss']} / {loss['dropped_late']} of {loss['partials']} | {c['ms_per_token']:.0f} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model file or name (default: %(default)s)")
    parser.add_argument("--predictors", help="the model's trained predictors (default: predictors/ beside the model)")
    parser.add_argument("--agents", default="4", help="local agent counts, comma-separated (default: %(default)s)")
    parser.add_argument("--modes", default="lossy,halo", help="lossy sync modes to score at every PLR (default: %(default)s)")
    parser.add_argument("--plr", default="0.01,0.02,0.05,0.1", help="injected loss rates (default: %(default)s)")
    parser.add_argument("--wire-partials", choices=("fp32", "fp16"), default="fp32",
                        help="agents' partial sums on the wire in lossy/halo modes (default: %(default)s)")
    parser.add_argument("--name", help="results file stem (default: accuracy_runtime_<model>)")
    parser.add_argument("--append", action="store_true",
                        help="add rows to the results file of an earlier run on the same data (its reference reused)")
    parser.add_argument("--exact-check", action="store_true", help="also run exact mode at the highest PLR")
    parser.add_argument("--data", default=str(DATA), help="text whose last 20 %% is held out (default: %(default)s)")
    parser.add_argument("--ppl-tokens", type=int, default=256, help="held-out tokens scored (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts for greedy continuations (default: %(default)s)")
    parser.add_argument("--continuation-tokens", type=int, default=16)
    parser.add_argument("--chats", type=int, default=50, help="chat questions (at most 50; 0 for a base model)")
    parser.add_argument("--chat-prompts", default=str(CHAT_PROMPTS), help="the questions, one a line (default: the "
                        "project's 50; eval/chat_prompts_heldout.txt: 50 written 2026-11-28 and never tuned on)")
    parser.add_argument("--answer-tokens", type=int, default=16, help="greedy answer length per question (default: %(default)s)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="eval/results")
    add_profile_argument(parser)
    parser.add_argument("--plan", default=None, help="how the cluster shares the model (halo-master --plan; default: "
                        "halo-master's own with local agents, 'even-mlp-only' with --profile: every agent takes MLP "
                        "groups of every layer, where a measured plan over slow links may leave them nothing)")
    parser.add_argument("--copies", type=int, default=0, help="every vector sent this many times on a lossy link "
                        "(halo-master --copies; default: not set, one)")
    parser.add_argument("--settings", default="{}", help="more SyncSettings fields as JSON for every cluster run, e.g. "
                        "'{\"critical_fraction\": 0.5, \"loss_deviations\": 6}' (halo/sync/modes.py)")
    parser.add_argument("--bed-timeout", type=float, default=7200.0, help="--profile: seconds one configuration may "
                        "take (default: %(default)s)")
    parser.add_argument("--bed-master", help=argparse.SUPPRESS)  # internal: the master inside the bed
    args = parser.parse_args(argv)
    if args.bed_master:
        return bed_master(args.bed_master)
    from halo.errors import ConfigError
    from halo.sync import SyncSettings

    try:
        settings = json.loads(args.settings)
        given = sorted(set(settings) & RESERVED_SETTINGS)
        if given:
            raise ConfigError(f"{', '.join(given)} come from their own options (--modes, --copies, --plr, --seed, "
                              "--wire-partials)")
        SyncSettings(**settings)  # a bad field stops here, not after the reference
    except (ValueError, TypeError, ConfigError) as e:
        raise SystemExit(f"--settings: {e}")
    if args.profile:
        from halo.rpi.testbed import available

        ok, why = available()
        if not ok:
            raise SystemExit(f"--profile needs the namespace test bed, which cannot run here: {why}")
        args.plan = args.plan or "even-mlp-only"
    from halo.compute.transformer import Transformer
    from halo.model.catalog import resolve_model
    from halo.model.loader import load_tokenizer, load_weights

    model_path = str(resolve_model(args.model))
    weights = load_weights(model_path)
    tokenizer = load_tokenizer(weights)
    windows = held_out_windows(tokenizer, args.data, args.ppl_tokens)
    after = held_out_tokens(tokenizer, args.data, args.ppl_tokens + 100 * args.prompts)[args.ppl_tokens:]
    prompts = [[start_token(tokenizer)] + after[100 * i:100 * i + 23] for i in range(args.prompts)]
    data = {"windows": windows, "prompts": prompts, "continuation_tokens": args.continuation_tokens,
            "chats": chat_questions(args.chats, args.chat_prompts) if tokenizer.chat_template is not None else [],
            "answer_tokens": args.answer_tokens}
    stem = args.name or f"accuracy_runtime_{Path(model_path).name.split('.')[0]}"
    out = (previous_run(Path(args.out) / f"{stem}.json", Path(model_path).name, data, Path(args.chat_prompts).name,
                        args.context) if args.append else None)
    if out is None:
        print(f"reference: {Path(model_path).name} in one process", file=sys.stderr, flush=True)
        reference = measure(Transformer(weights, fmt="native", max_seq_len=args.context), tokenizer, data, args.answer_tokens)
        out = {"commands": [], "model": Path(model_path).name, "continuation_tokens": args.continuation_tokens,
               "answer_tokens": args.answer_tokens, "chat_prompts": Path(args.chat_prompts).name,
               "data_sha256": data_fingerprint(data, args.context), "reference": reference, "rows": []}
    reference = out["reference"]
    out["commands"].append(command_line("halo.eval.accuracy_runtime", argv))
    plrs = [float(p) for p in args.plr.split(",")]
    configs = [(n, mode, plr) for n in (int(a) for a in args.agents.split(",")) for mode in args.modes.split(",")
               for plr in plrs]
    if args.exact_check:
        configs += [(n, "exact", max(plrs)) for n in (int(a) for a in args.agents.split(","))]
    out.setdefault("host", host_line())  # where the first rows were measured (--append keeps it)
    for n, mode, plr in configs:
        row = (run_on_bed(model_path, data, args, n, mode, plr) if args.profile else
               run_cluster(model_path, weights, tokenizer, data, args, n, mode, plr))
        if "result" in row:
            row["compared"] = compared(row["result"], reference)
        out["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "result"}), file=sys.stderr, flush=True)
        write_report(args.out, stem, out, render(out))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
