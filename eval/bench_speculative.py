"""Speculative decoding over a cluster: tokens/s with and without it, on a copy-heavy task and on chat prompts.

    python -m halo.eval.bench_speculative [--plr 0.02] [--agents 3] [--drafts 8] [--copy 20] [--chat 50]

SmolLM2-135M-Instruct (`halo-master fetch smollm2-135m-instruct`), master + N agents in the namespace test bed
(rpi/testbed.py: nftables loss on every agent link, both ways), exact sync. Per prompt, interleaved: plain decoding,
prompt lookup (`--speculate K`) and a draft model (`--draft`: a random model of a much smaller shape with the same
vocabulary, whose drafts are noise: what drafting costs where it never helps). Greedy, each answer under the model's
chat template. Prompt sets: eval/copy_prompts.json (rewrite / summarize / edit a given passage: written by
`copy_prompts()` from the end of the TinyStories validation text, dated, never tuned on) and eval/chat_prompts.txt
(the project's 50 chat prompts). Speed: each set's output tokens over its decode seconds (the prompt's prefill
excluded, as in every ms/token of the project). Writes eval/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from halo.eval.bench_halo_speed import Cluster, add_profile_argument, with_testbed
from halo.eval.report import command_line, cpu_model, run_script, write_report
from halo.runtime.local import module_command

HERE = Path(__file__).resolve().parent
COPY_PROMPTS = HERE / "copy_prompts.json"
CHAT_PROMPTS = HERE / "chat_prompts.txt"
DRAFT_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=2048, vocab_size=49152, rms_norm_eps=1e-5,
                   rope_theta=100000.0, tie_word_embeddings=True)
INSTRUCTIONS = ("Rewrite the following story in the past tense.", "Fix any spelling or grammar mistakes in this text and "
                "give it back.", "Summarize this story in a few sentences.", "Repeat this passage, then say what "
                "its lesson is.", "Rewrite this story for a younger child, keeping its sentences.")
VARIANTS = ("plain", "lookup", "draft")


def copy_prompts(text_path: Path, n: int = 20) -> list[dict]:
    """n copy-heavy prompts: passages of 300-700 characters from the end of the text, an instruction each in turn."""
    paragraphs = [p.strip() for p in text_path.read_text().split("\n\n")]
    passages = [p for p in reversed(paragraphs) if 300 <= len(p) <= 700][:n]
    return [{"instruction": INSTRUCTIONS[i % len(INSTRUCTIONS)], "passage": p} for i, p in enumerate(passages)]


def load_prompts(copy: int, chat: int) -> dict[str, list[str]]:
    data = json.loads(COPY_PROMPTS.read_text())
    copies = [f"{p['instruction']}\n\n{p['passage']}" for p in data["prompts"][:copy]]
    chats = [line.strip() for line in CHAT_PROMPTS.read_text().splitlines() if line.strip()][:chat]
    return {"copy": copies, "chat": chats}


# ---- the master, inside its namespace ------------------------------------------------------------------
def master(args) -> None:
    from halo.compute.linear import resolve_format
    from halo.compute.transformer import Transformer
    from halo.distributed import cluster_model
    from halo.generation.generate import generate
    from halo.generation.speculative import DraftModel, SpeculationSettings
    from halo.model.chat import chat_prompt
    from halo.model.loader import load_tokenizer, load_weights
    from halo.sync import SyncSettings
    from halo.transport.reliable import load_key

    weights = load_weights(args.model)
    tokenizer = load_tokenizer(weights)
    model = cluster_model(weights, args.endpoints.split(","), load_key(args.key), plan=args.plan, context=1024,
                          timeout_s=60.0, hello_timeout_s=600.0, sync=SyncSettings(mode="exact"),
                          fmt=resolve_format("native", weights))
    draft = load_weights(args.draft)
    drafter = DraftModel(Transformer(draft, fmt=resolve_format("native", draft), max_seq_len=1024),
                         weights.config.vocab_size)
    settings = {"plain": (SpeculationSettings(), None), "lookup": (SpeculationSettings(max_drafts=args.drafts), None),
                "draft": (SpeculationSettings(max_drafts=args.drafts), drafter)}
    variants = args.variants.split(",")
    try:
        for task, prompts in load_prompts(args.copy, args.chat).items():
            tokens = args.copy_tokens if task == "copy" else args.chat_tokens
            for i, text in enumerate(prompts):
                prompt = chat_prompt(tokenizer, [{"role": "user", "content": text}])
                for variant in variants:
                    spec, draft = settings[variant]
                    result = generate(model, tokenizer, prompt, tokens, speculation=spec, drafter=draft)
                    row = {"task": task, "prompt": i, "variant": variant, "tokens": result.token_ids,
                           "decode_s": sum(result.decode_ms) / 1e3, "prefill_ms": result.prefill_ms,
                           "rounds_per_pass": model.rounds_per_pass,
                           "speculation": result.speculation.to_json() if result.speculation else None}
                    print("ROW " + json.dumps(row), flush=True)
    finally:
        model.close()


def run_master(bed, argv: list[str], timeout: float) -> list[dict]:
    p = bed.popen("master", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rows = []
    for line in p.stdout:
        if line.startswith("ROW "):
            rows.append(json.loads(line[4:]))
            r = rows[-1]
            print(f"{r['task']} {r['prompt']:>2} {r['variant']:>6}: {len(r['tokens'])} tokens, "
                  f"{r['decode_s']:.2f} s", flush=True)
    err = p.stderr.read()
    if p.wait(timeout=timeout) != 0:
        raise RuntimeError(f"the master failed: {err[-3000:]}")
    return rows


def run(args) -> None:
    from halo.eval.random_checkpoint import write_random_gguf
    from halo.model.catalog import resolve_model
    from halo.transport.reliable import generate_key

    model = Path(args.model) if args.model else resolve_model("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory() as tmp:
        key, draft = Path(tmp) / "cluster.key", Path(tmp) / "draft-random-Q8_0.gguf"
        generate_key(key)
        write_random_gguf(draft, DRAFT_SHAPE, "Q8_0")
        with with_testbed(args.agents, args.profile) as bed:
            bed.set_loss(args.plr)
            cluster = Cluster(bed, model, key, args.agents)
            try:
                argv = [*module_command("halo.eval.bench_speculative"), "master", "--model", str(model),
                        "--key", str(key), "--endpoints", ",".join(cluster.endpoints), "--plan", args.plan,
                        "--draft", str(draft), "--drafts", str(args.drafts), "--variants", args.variants,
                        "--copy", str(args.copy), "--chat", str(args.chat), "--copy-tokens", str(args.copy_tokens),
                        "--chat-tokens", str(args.chat_tokens)]
                t0 = time.monotonic()
                rows = run_master(bed, argv, timeout=7200)
                wall = time.monotonic() - t0
                dropped = bed.drop_counters()
            finally:
                cluster.close()
    summary = summarize(rows, args.variants.split(","))
    data = {"command": command_line("halo.eval.bench_speculative", args.argv), "host": cpu_model(),
            "model": str(model), "plan": args.plan, "plr": args.plr, "profile": args.profile, "agents": args.agents, "drafts": args.drafts,
            "draft_shape": DRAFT_SHAPE, "wall_s": wall, "dropped_frames": dropped, "summary": summary, "rows": rows}
    write_report(args.out, args.name, data, render(data))


def summarize(rows: list[dict], variants: list[str]) -> dict:
    """Per task and variant: output tokens / decode seconds, answers identical to plain decoding's, drafting figures."""
    out = {}
    for task in sorted({r["task"] for r in rows}):
        plain = {r["prompt"]: r["tokens"] for r in rows if r["task"] == task and r["variant"] == "plain"}
        for variant in variants:
            mine = [r for r in rows if r["task"] == task and r["variant"] == variant]
            if not mine:
                continue
            tokens = sum(len(r["tokens"]) for r in mine)
            decode = sum(r["decode_s"] for r in mine)
            spec = [r["speculation"] for r in mine if r["speculation"]]
            drafted, accepted = sum(s["drafted"] for s in spec), sum(s["accepted"] for s in spec)
            passes = sum(s["passes"] for s in spec)
            made = sum(len(r["tokens"]) - 1 for r in mine if r["speculation"])  # tokens after each prompt's first
            out[f"{task}/{variant}"] = {
                "prompts": len(mine), "tokens": tokens, "decode_s": round(decode, 3),
                "tokens_per_s": round(tokens / decode, 2) if decode else None,
                "identical": sum(r["tokens"] == plain.get(r["prompt"]) for r in mine),
                "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                "tokens_per_pass": round(made / passes, 3) if passes else 1.0,
                "rounds_per_token": round(mine[0]["rounds_per_pass"] * passes / made, 2) if passes and made
                else mine[0]["rounds_per_pass"]}
    return out


def render(data: dict) -> list[str]:
    s = data["summary"]
    lines = [f"# Speculative decoding over master + {data['agents']} agents (SmolLM2-135M-Instruct, exact sync)", "",
             f"Command: `{data['command']}`. Host: {data['host']}, 2 cores shared by the master and the agents, each "
             f"in its own network namespace; {100 * data['plr']:g} % of every agent link's frames dropped both ways "
             f"(nftables){'' if not data.get('profile') else ', every agent link emulated as ' + data['profile'] + ' (rpi/links.py)'}; plan `{data['plan']}`; greedy, up to {data['drafts']} drafted tokens a pass (adapting). "
             "Per prompt the variants ran one after the other. tokens/s: the set's output tokens over its decode "
             "seconds (prefill excluded). Identical: answers token for token those of plain decoding. The draft model "
             "has random weights (hidden 128, 2 layers, SmolLM2's vocabulary): its drafts are noise, so its row is "
             "what drafting costs where it never helps.", "",
             "| task | variant | prompts | tokens | tokens/s | vs plain | identical to plain | acceptance | "
             "tokens a pass | sync rounds a token |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in s.items():
        task, variant = key.split("/")
        base = s.get(f"{task}/plain")
        ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and base["tokens_per_s"] else "-"
        rate = "-" if row["acceptance_rate"] is None else f"{100 * row['acceptance_rate']:.0f} %"
        lines.append(f"| {task} | {variant} | {row['prompts']} | {row['tokens']} | {row['tokens_per_s']} | {ratio} | "
                     f"{row['identical']}/{row['prompts']} | {rate} | {row['tokens_per_pass']} | "
                     f"{row['rounds_per_token']} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m halo.eval.bench_speculative", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    m = sub.add_parser("master", help="(internal) the master inside the test bed")
    for name in ("--model", "--key", "--endpoints", "--plan", "--draft", "--variants"):
        m.add_argument(name, required=True)
    for name, default in (("--drafts", 4), ("--copy", 20), ("--chat", 50), ("--copy-tokens", 160),
                          ("--chat-tokens", 96)):
        m.add_argument(name, type=int, default=default)
    parser.add_argument("--model", help="default: the fetched smollm2-135m-instruct")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--plr", type=float, default=0.02, help="loss on every agent link, both ways (default 0.02)")
    add_profile_argument(parser)
    parser.add_argument("--plan", default="even-mlp-only", help="the cluster's plan (default even-mlp-only: every agent in every round)")
    parser.add_argument("--drafts", type=int, default=8, help="--speculate K (default 8)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--copy", type=int, default=20, help="copy-heavy prompts (default all 20)")
    parser.add_argument("--chat", type=int, default=50, help="chat prompts (default all 50)")
    parser.add_argument("--copy-tokens", type=int, default=160)
    parser.add_argument("--chat-tokens", type=int, default=96)
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--name", default="speculative_smollm2_bed")
    parser.add_argument("--write-copy-prompts", action="store_true",
                        help="write eval/copy_prompts.json from ../shared/data/tinystories_valid_dev.txt and stop")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command == "master":
        master(args)
    elif args.write_copy_prompts:
        source = HERE.parent.parent / "shared" / "data" / "tinystories_valid_dev.txt"
        COPY_PROMPTS.write_text(json.dumps({"written": time.strftime("%Y-%m-%d"), "source": source.name,
                                            "prompts": copy_prompts(source)}, indent=1) + "\n")
        print(f"wrote {COPY_PROMPTS}")
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
