"""The attention decode step over a long KV cache: halo/_nbits.c attention_step, one token through every layer's
heads (what the single process and a master holding the heads run a token), at a few cache lengths.

    python -m halo.eval.bench_attention_step [--model tinyllama-q4] [--positions 40,200,1000,2000]
                                             [--baseline OTHER_BUILD.so] [--runs 3]

With --baseline (another build of halo._nbits, e.g. one made from an earlier commit), both builds run the very same
shards, cache and input, interleaved in one process, and the table gives their times side by side and the largest
difference of their outputs. The cache holds random keys and values (attention's cost depends on its length, not
its contents). One thread. Writes eval/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import sys
import time

import numpy as np

from halo.eval.bench_churn import add_model_argument, model_file
from halo.eval.report import command_line, run_script, write_report


def load_build(path: str):
    """A build of halo._nbits from its file, beside the one imported (each dlopen'ed on its own)."""
    loader = importlib.machinery.ExtensionFileLoader("halo._nbits", path)
    spec = importlib.util.spec_from_file_location("halo._nbits", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def bench(args) -> dict:
    import halo.compute.neuron_groups as neuron_groups
    from halo.compute.neuron_groups import AttentionShard, GroupLayout
    from halo.model.loader import load_weights
    from halo.model.ops import Rotary

    builds = {"this build": neuron_groups._nbits}
    if args.baseline:
        builds["baseline"] = load_build(args.baseline)
    path = model_file(args.model)
    weights = load_weights(path)
    config, context = weights.config, max(args.positions) + 1
    layout = GroupLayout.for_model(config)
    shards = [AttentionShard(layer, layout, range(layout.n_heads), context, fmt="native") for layer in weights.layers]
    if not shards[0].fused:
        raise SystemExit("halo._nbits is not built here (or this CPU has no vector path): no decode step to time")
    rng = np.random.default_rng(0)
    for shard in shards:
        shard.cache_k[:] = rng.standard_normal(shard.cache_k.shape)
        shard.cache_v[:] = rng.standard_normal(shard.cache_v.shape)
    rotary, x = Rotary(config, context), rng.standard_normal((1, config.dim)).astype(np.float32)

    def token(build, pos: int) -> tuple[float, np.ndarray]:
        neuron_groups._nbits = build
        t = time.perf_counter()
        for shard, layer in zip(shards, weights.layers):
            y = shard.step(x, layer.attn_norm, config.norm_eps, pos, rotary)
        return 1e3 * (time.perf_counter() - t), y

    rows = []
    try:
        for pos in args.positions:
            times, outputs = {name: [] for name in builds}, {}
            for _ in range(args.runs):
                for name, build in builds.items():
                    token(build, pos)  # warm
                    ms = [token(build, pos) for _ in range(args.repeats)]
                    times[name].append(float(np.median([m for m, _ in ms])))
                    outputs[name] = ms[-1][1]
            row = {"position": pos, **{f"{name} ms": times[name] for name in builds}}
            if "baseline" in builds:
                row["max_abs_diff"] = float(np.abs(outputs["this build"] - outputs["baseline"]).max())
                row["max_abs_output"] = float(np.abs(outputs["baseline"]).max())
            rows.append(row)
            print(row, flush=True)
    finally:
        neuron_groups._nbits = builds["this build"]
    return {"command": command_line("halo.eval.bench_attention_step", args.argv), "model": str(path),
            "layers": len(shards), "heads": layout.n_heads, "kv_heads": config.n_kv_heads, "runs": args.runs,
            "builds": list(builds), "rows": rows}


def render(result: dict) -> list[str]:
    builds = result["builds"]
    lines = [f"# The attention decode step over a long KV cache ({result['model'].rsplit('/', 1)[-1]})", "",
             f"Command: `{result['command']}`. One token through all {result['layers']} layers' attention "
             f"({result['heads']} query heads over {result['kv_heads']} KV heads), one thread; the median of "
             f"{result['runs']} interleaved runs (every run in parentheses).", "",
             "| token position | " + " | ".join(f"{b} ms" for b in builds)
             + (" | baseline / this build | largest output difference |" if len(builds) > 1 else " |"),
             "|---" * (len(builds) + 1 + 2 * (len(builds) > 1)) + "|"]
    for row in result["rows"]:
        cells = [f"{np.median(row[f'{b} ms']):.2f} ({', '.join(f'{v:.2f}' for v in row[f'{b} ms'])})" for b in builds]
        if len(builds) > 1:
            ratio = np.median(row["baseline ms"]) / np.median(row["this build ms"])
            cells += [f"{ratio:.2f}x", f"{row['max_abs_diff']:.1e} (outputs up to {row['max_abs_output']:.2f})"]
        lines.append(f"| {row['position']} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser)
    parser.add_argument("--positions", type=lambda s: [int(p) for p in s.split(",")], default=[40, 200, 1000, 2000],
                        help="cache lengths, comma-separated")
    parser.add_argument("--baseline", help="another build of halo._nbits (a .so file) to time beside this one")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="tokens timed per run (their median)")
    parser.add_argument("--name", default="attention_step")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if not args.positions or min(args.positions) < 0 or args.runs < 1 or args.repeats < 1:
        raise SystemExit("--positions: cache lengths >= 0; --runs and --repeats: 1 or more")
    result = bench(args)
    write_report(args.out, args.name, result, render(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
