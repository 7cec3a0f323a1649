"""`halo-master`: the coordinator's command line."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import HaloError
from .linear import FORMATS

EPILOG_GENERATE = """examples:
  halo-master generate --prompt "Once upon a time"              bundled stories260K model
  halo-master generate --prompt "" --temperature 0 --json         the known answer, as JSON
  halo-master generate --model ./Llama-3.2-1B --weights int8 --prompt "Hi"   a Hugging Face directory
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halo-master", description="Coordinate halo: run generation, plan clusters.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser("generate", help="generate text from a prompt", epilog=EPILOG_GENERATE,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Generate a continuation of --prompt. Without --model, runs the bundled "
                                   "stories260K model (a tiny Llama trained on children's stories).")
    g.add_argument("--prompt", default="", help='text to continue; "" starts from BOS (default: "")')
    g.add_argument("--model", help="llama2.c .bin checkpoint or Hugging Face directory (default: bundled stories260K)")
    g.add_argument("--tokenizer", help="tokenizer file (default: tokenizer.json in the HF directory, or tok*.bin "
                                       "beside a llama2.c checkpoint)")
    g.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="stop after N new tokens (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy, deterministic (default); higher = more varied")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="sample only among the K likeliest tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1.0: off)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    g.add_argument("--weights", choices=FORMATS, default="fp32",
                   help="weight format in memory: fp32 (exact) or int8 (per-block, ~3.5x smaller, faster)")
    g.add_argument("--context", type=int, default=None, metavar="N",
                   help="KV-cache length in tokens (default: the model's, at most 2048)")
    g.add_argument("--threads", type=int, default=1, help="compute threads for int8 kernels (default 1)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, timings) instead of streaming")
    g.set_defaults(func=cmd_generate)
    return parser


def cmd_generate(args) -> int:
    from .generate import generate
    from .loader import load_tokenizer, load_weights
    from .model import Transformer
    from .sampling import SamplingSettings

    sampling = SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed)
    weights = load_weights(args.model)
    tokenizer = load_tokenizer(weights, args.tokenizer)
    model = Transformer(weights, fmt=args.weights, max_seq_len=args.context, threads=args.threads)
    if args.json:
        result = generate(model, tokenizer, args.prompt, args.max_new_tokens, sampling)
        out = result.to_json()
        out["model"] = weights.source
        out["weights"] = args.weights
        print(json.dumps(out))
        return 0

    from rich.console import Console

    err = Console(stderr=True)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = generate(model, tokenizer, args.prompt, args.max_new_tokens, sampling, on_text=show)
    sys.stdout.write("\n")
    err.print(f"[dim]{len(result.token_ids)} tokens ({result.stop_reason}) · prefill {result.prefill_ms:.1f} ms "
              f"· {result.ms_per_token:.2f} ms/token · {args.weights} weights[/dim]")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HaloError as e:
        print(f"halo-master: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("halo-master: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
