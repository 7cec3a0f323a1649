"""`halo-train-predictors`: profile -> train -> export -> check, with a summary table."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from halo.arguments import integer
from halo.errors import ConfigError, HaloError, interrupted, sigterm_as_interrupt

EPILOG = """examples (a text's first 80 % trains, the last 20 % validates):
  halo-train-predictors --data ../shared/data/tinystories_valid_dev.txt --out models/predictors   the bundled model
  halo-train-predictors --model models/my-model.gguf --data my-text.txt --out models/my-model-predictors
  (halo-master and halo-agent look in predictors/ beside the model file, or where --predictors says)
"""


def train_predictors(model: str | None, data: str, out: str | Path, hidden: int = 64, epochs: int = 40, seed: int = 0,
                     max_chars: int | None = None, window: int = 256, train_fraction: float = 0.8,
                     mlp_group_size: int | None = None, progress: bool = True, keep_profile: bool = False) -> dict:
    """The whole pipeline; returns the manifest. Raises if ONNX and torch disagree by more than 1e-5."""
    for package in ("torch", "sklearn"):  # before minutes of profiling (without them it ended in a traceback)
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"training needs {package}, which is not installed: pip install 'halo-edge[train]'")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a directory")
    out.mkdir(parents=True, exist_ok=True)
    work = out / "profile"  # kept there (--keep-profile); else a scratch directory of its own, removed whatever happens
    if keep_profile and work.exists() and any(work.iterdir()):
        raise ConfigError(f"{work} exists and is not empty: --keep-profile writes the profile there (move it, or give "
                          "another --out)")
    work = work if keep_profile else Path(tempfile.mkdtemp(dir=out, prefix=".profile-"))
    try:
        return _train(model, data, out, work, hidden, epochs, seed, max_chars, window, train_fraction, mlp_group_size,
                      progress)
    finally:
        if not keep_profile:
            shutil.rmtree(work, ignore_errors=True)  # (up to 5.7 GB for SmolLM2 and the full text)


def _train(model, data, out: Path, work: Path, hidden, epochs, seed, max_chars, window, train_fraction, mlp_group_size,
           progress) -> dict:
    from halo.predictors.export import export
    from halo.predictors.profiler import load_split, profile
    from halo.predictors.runtime import PredictorSet
    from halo.predictors.trainer import TrainSettings, torch_scores, train_layer

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
    # the manifest is what makes OUT loadable: none from here until the export has passed its check (one written
    # before the check stayed when it failed or was interrupted, and halo-master used the predictors it refused)
    (out / "manifest.json").unlink(missing_ok=True)
    try:
        export(predictors, out, meta, vars(settings))
        runtime = PredictorSet(out)
        worst = 0.0
        for p in predictors:  # parity: torch vs onnxruntime on validation inputs
            x_val, _ = load_split(work, "val", p.layer - 1)
            sample = np.asarray(x_val[:512])
            worst = max(worst, float(np.abs(runtime.scores(p.layer, sample) - torch_scores(p, sample)).max()))
        if worst > 1e-5:
            raise HaloError(f"ONNX export disagrees with torch by {worst:.2e} (> 1e-5): do not use these predictors")
    except BaseException:
        (out / "manifest.json").unlink(missing_ok=True)
        raise
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["onnx_torch_max_abs_diff"] = worst
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
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
    parser.add_argument("--hidden", type=integer(1, 1 << 16), default=64,
                        help="predictor hidden width (paper: 256 for 8B, 512 for 13B)")
    parser.add_argument("--epochs", type=integer(1, 1 << 20), default=40,
                        help="at most this many epochs (early stopping)")
    parser.add_argument("--seed", type=integer(0, 2 ** 32 - 1), default=0)
    parser.add_argument("--max-chars", type=integer(1), help="use only the first N characters of --data")
    parser.add_argument("--window", type=integer(9, 1 << 20), default=256,
                        help="tokens per profiling window (at least 9; at most the model's context)")
    parser.add_argument("--train-fraction", type=float, default=0.8, help="first part of the text for training")
    parser.add_argument("--mlp-group-size", type=integer(1, 1 << 20), help="neurons per MLP group (default: the "
                        "runtime's for this model; halo-master groups by it, and refuses predictors of another size)")
    parser.add_argument("--keep-profile", action="store_true", help="keep the profiled activations in OUT/profile")
    args = parser.parse_args(argv)
    try:
        with sigterm_as_interrupt():
            manifest = train_predictors(args.model, args.data, args.out, args.hidden, args.epochs, args.seed,
                                        args.max_chars, args.window, args.train_fraction, args.mlp_group_size, True,
                                        args.keep_profile)
    except (HaloError, OSError, UnicodeDecodeError) as e:  # (an unreadable or non-UTF-8 --data, an unwritable --out)
        print(f"halo-train-predictors: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # the profile is removed on the way out
        return interrupted("halo-train-predictors", e)
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
