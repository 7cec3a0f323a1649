"""`halo-train-predictors`: profile -> train -> export -> check, with a summary table."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from halo.errors import HaloError

EPILOG = """example (the bundled model and the shared TinyStories text; first 80 % train, last 20 % validation):
  halo-train-predictors --data tinystories_valid_dev.txt --out predictors/stories260K --hidden 64 --epochs 40
"""


def train_predictors(model: str | None, data: str, out: str | Path, hidden: int = 64, epochs: int = 40, seed: int = 0,
                     max_chars: int | None = None, window: int = 256, train_fraction: float = 0.8,
                     mlp_group_size: int | None = None, progress: bool = True, keep_profile: bool = False) -> dict:
    """The whole pipeline; returns the manifest. Raises if ONNX and torch disagree by more than 1e-5."""
    from halo.predictors.export import export
    from halo.predictors.profiler import load_split, profile
    from halo.predictors.runtime import PredictorSet
    from halo.predictors.trainer import TrainSettings, torch_scores, train_layer

    out = Path(out)
    work = out / "profile"
    info = profile(model, data, work, train_fraction, window, max_chars, mlp_group_size, progress)
    meta = json.loads((work / "meta.json").read_text())
    settings = TrainSettings(hidden=hidden, epochs=epochs, seed=seed)
    predictors = []
    layers = range(1, info.n_layers)
    iterator = layers
    if progress:
        from tqdm import tqdm

        iterator = tqdm(layers, desc="training", unit="layer")
    for layer in iterator:
        predictors.append(train_layer(work, layer, info.n_heads, settings))
    export(predictors, out, meta, vars(settings))
    runtime = PredictorSet(out)
    worst = 0.0
    for p in predictors:  # parity: torch vs onnxruntime on validation inputs
        x_val, _ = load_split(work, "val", p.layer - 1)
        sample = np.asarray(x_val[:512])
        worst = max(worst, float(np.abs(runtime.scores(p.layer, sample) - torch_scores(p, sample)).max()))
    if worst > 1e-5:
        raise HaloError(f"ONNX export disagrees with torch by {worst:.2e} (> 1e-5): do not use these predictors")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["onnx_torch_max_abs_diff"] = worst
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if not keep_profile:
        shutil.rmtree(work)
    return manifest


RANKERS = ("predictor", "ridge", "static", "random")  # the MLP, a linear baseline, the mean norms, chance
METRICS = ("spearman", "recall@25%", "recall@50%", "ndcg")
SUMMARY_COLUMNS = ("layer", "block", "val loss", "Spearman", "recall@25%", "recall@50%", "NDCG")


def summary_rows(manifest: dict) -> list[list[str]]:
    """Per layer and block, each metric as "predictor / ridge / static / random" ("-" where a manifest written
    before a ranker or metric existed lacks it)."""
    rows = []
    for layer, entry in sorted(manifest["layers"].items(), key=lambda kv: int(kv[0])):
        m = entry["metrics"]
        for block in ("attention", "mlp"):
            cells = [layer, block, f"{m['val_loss']:.2e}" if block == "attention" else ""]
            for metric in METRICS:
                values = [m.get(who, {}).get(block, {}).get(metric) for who in RANKERS]
                cells.append(" / ".join("-" if v is None else f"{v:.3f}" for v in values))
            rows.append(cells)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="halo-train-predictors", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Train halo's semantic-aware predictors (one small MLP per layer) "
                                                 "that rank the next layer's attention heads and MLP groups from the "
                                                 "current hidden state, and export them to ONNX for the agents.")
    parser.add_argument("--model", help="model file or HF directory (default: bundled stories260K)")
    parser.add_argument("--data", required=True, help="calibration text (UTF-8)")
    parser.add_argument("--out", required=True, help="output directory: manifest.json + layer_*.onnx")
    parser.add_argument("--hidden", type=int, default=64, help="predictor hidden width (paper: 256 for 8B, 512 for 13B)")
    parser.add_argument("--epochs", type=int, default=40, help="at most this many epochs (early stopping)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-chars", type=int, help="use only the first N characters of --data")
    parser.add_argument("--window", type=int, default=256, help="tokens per profiling window")
    parser.add_argument("--train-fraction", type=float, default=0.8, help="first part of the text for training")
    parser.add_argument("--mlp-group-size", type=int, help="neurons per MLP group (default: as the runtime uses)")
    parser.add_argument("--keep-profile", action="store_true", help="keep the profiled activations in OUT/profile")
    args = parser.parse_args(argv)
    try:
        manifest = train_predictors(args.model, args.data, args.out, args.hidden, args.epochs, args.seed, args.max_chars,
                                    args.window, args.train_fraction, args.mlp_group_size, True, args.keep_profile)
    except HaloError as e:
        print(f"halo-train-predictors: error: {e}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"validation ({manifest['data']['tokens']['val']} tokens): {' / '.join(RANKERS)}")
    for column in SUMMARY_COLUMNS:
        table.add_column(column)
    for row in summary_rows(manifest):
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print(f"wrote {args.out} (ONNX vs torch max |diff| {manifest['onnx_torch_max_abs_diff']:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
