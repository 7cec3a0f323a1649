"""Train a model's semantic-aware predictors and report how they rank.

    python -m halo.eval.bench_predictors [--model MODEL] [--hidden 64] [--epochs 40] [--seed 0]
    python -m halo.eval.bench_predictors --model smollm2-135m-instruct --hidden 128 --max-chars 400000

Data: ../shared/data/tinystories_valid_dev.txt (or --data), first 80 % for training, last 20 % for
validation (cut at a paragraph boundary). Writes the predictors to predictors/ beside the model (for the
bundled model: halo/assets/stories260K/predictors, shipped with halo, used by HALO mode) and the per-layer metric
table, the predictors' size next to the model's, and their per-token latency next to the model's
own decode step, to eval/results/predictors_<model>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from halo import BUNDLED_MODEL

from halo.eval.report import command_line, run_script, write_report

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories_valid_dev.txt"


def overhead(model_path: Path, predictor_dir: Path, repeats: int = 200) -> dict:
    """Predictor bytes vs model bytes; one token's predictions (all layers) vs one decode step."""
    from halo.compute.transformer import Transformer
    from halo.generation.generate import generate
    from halo.model.loader import load_tokenizer, load_weights
    from halo.predictors.runtime import PredictorSet

    weights = load_weights(model_path)
    model = Transformer(weights, "native", max_seq_len=256)
    result = generate(model, load_tokenizer(weights), "Once upon a time", 100)
    decode_ms = float(np.median(result.decode_ms))
    predictors = PredictorSet(predictor_dir)
    hidden = np.random.default_rng(0).standard_normal(weights.config.dim).astype(np.float32)
    for layer in predictors.layers:
        predictors.rank(layer, hidden)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for layer in predictors.layers:
            predictors.rank(layer, hidden)
        times.append(time.perf_counter() - t)
    predict_ms = 1e3 * float(np.median(times))
    return {"model_weight_bytes": weights.nbytes(), "predictor_bytes": predictors.nbytes,
            "memory_fraction": predictors.nbytes / weights.nbytes(), "decode_ms_per_token": decode_ms,
            "predict_ms_per_token_all_layers": predict_ms, "latency_fraction": predict_ms / decode_ms,
            "predict_ms_per_layer": predict_ms / len(predictors.layers),
            "decode_ms_per_layer": decode_ms / weights.config.n_layers}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model file or name (default: the bundled stories260K)")
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--max-chars", type=int, help="use only the first N characters of --data")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--predictors", help="where the trained predictors go (default: predictors/ beside the model)")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    from halo.predictors.cli import SUMMARY_COLUMNS, summary_rows, train_predictors

    from halo.model.catalog import resolve_model

    model_path = resolve_model(args.model) if args.model else Path(str(BUNDLED_MODEL))
    predictors = Path(args.predictors) if args.predictors else model_path.parent / "predictors"
    t = time.perf_counter()
    manifest = train_predictors(str(model_path), args.data, predictors, args.hidden, args.epochs, args.seed, args.max_chars)
    train_s = time.perf_counter() - t
    cost = overhead(model_path, predictors)
    name = model_path.name.split(".")[0]
    command = command_line("halo.eval.bench_predictors", argv)
    result = {"command": command, "train_seconds": train_s, "overhead": cost, "manifest": manifest}
    tokens = manifest["data"]["tokens"]
    lines = [f"# Semantic-aware predictors on {name}", "",
             f"Command: `{command}` ({train_s:.0f} s on this machine). Data: {Path(args.data).name}, first "
             f"{manifest['data']['train_fraction']:.0%} of the text for training ({tokens['train']} tokens), the rest "
             f"for validation ({tokens['val']} tokens). Predictor for layer l reads the hidden state entering layer l-1; "
             f"MLP groups of {manifest['mlp_group_size']} neurons ({manifest['n_mlp_groups']} per layer), "
             f"{manifest['n_heads']} heads; hidden width {args.hidden}. Layer 0 has no predictor (always synchronized "
             "reliably). Each cell: **predictor** / ridge regression on the same input (scikit-learn) / static ranking "
             "(mean norm over the training tokens) / random.", "",
             "| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    for row in summary_rows(manifest):
        cells = [row[0], row[1], row[2]] + [" / ".join([f"**{c.split(' / ')[0]}**", *c.split(" / ")[1:]]) for c in row[3:]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| overhead | value |", "|---|---|",
              f"| predictor bytes (all layers) | {cost['predictor_bytes']:,} |",
              f"| model weight bytes (as stored) | {cost['model_weight_bytes']:,} |",
              f"| memory: predictors / model | {cost['memory_fraction']:.1%} |",
              f"| one token, all predictors (onnxruntime, 1 thread) | {cost['predict_ms_per_token_all_layers']:.3f} ms |",
              f"| one decode step of the model (single process) | {cost['decode_ms_per_token']:.3f} ms |",
              f"| latency: predictors / decode step | {cost['latency_fraction']:.1%} |",
              f"| per layer: one prediction vs one layer's compute | {cost['predict_ms_per_layer']:.3f} ms vs "
              f"{cost['decode_ms_per_layer']:.3f} ms |",
              "", f"ONNX vs torch, max |difference| on validation inputs: {manifest['onnx_torch_max_abs_diff']:.1e}."]
    write_report(args.out, f"predictors_{name}", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
