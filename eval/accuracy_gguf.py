"""A GGUF model's 4-bit kernels against its dequantized fp32 weights: perplexity and next-token agreement.

    python -m halo.eval.accuracy_gguf [--model smollm2-135m-instruct] [--window 512] [--max-windows 0]

Text: the held-out last 20 % of ../shared/data/tinystories_valid_dev.txt (cut at the paragraph boundary
nearest 80 %, as every halo accuracy run), tokenized whole (no BOS: SmolLM2's tokenizer adds none) and cut
into consecutive windows of --window tokens. Each window runs through the same model file twice in one
process: --weights fp32 (the blocks dequantized: the exact reference, equal to transformers' gguf_file=
load within 1e-4, tests/test_smollm2.py) and --weights native (the file's Q4_1/Q8_0 blocks times int8
activations in two terms, computed by halo's C kernel where the package has it, else by MatMulNBits).
Reports perplexity of each (every token after a window's first), the relative difference (goal: within 1 %),
greedy next-token agreement, and the max and mean absolute logit difference, over all windows and over the
first window alone (the 512-token held-out text).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from halo.compute.transformer import Transformer
from halo.model.loader import load_tokenizer, load_weights
from halo.predictors.profiler import split_text

from halo.eval.report import command_line, run_script, write_report

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories_valid_dev.txt"


def window_stats(logits: np.ndarray, window: list[int]) -> float:
    """Summed negative log-likelihood of window[1:] under logits[:-1]."""
    z = logits[:-1].astype(np.float64)
    z -= z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -float(logp[np.arange(len(window) - 1), window[1:]].sum())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF file or a fetched model's name")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--window", type=int, default=512, help="tokens per window")
    parser.add_argument("--max-windows", type=int, default=0, help="stop after this many windows (0: all)")
    parser.add_argument("--single-pass", action="store_true",
                        help="ablation: the activations quantized to int8 in one term, not two")
    parser.add_argument("--matmulnbits", action="store_true",
                        help="native blocks on onnxruntime's MatMulNBits even where halo's C kernel is built")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    import halo.compute.linear

    halo.compute.linear.NATIVE_SPLIT_ACTIVATIONS = not args.single_pass
    halo.compute.linear.PREFER_C_KERNEL = not args.matmulnbits
    kernel = (("halo._nbits (halo's C kernel)" if halo.compute.linear.projection_kernel() == "halo._nbits" else "MatMulNBits")
              + " on the file's own blocks with int8 activations "
              + ("in one term (what --single-pass ablates)" if args.single_pass else
                 "in two terms (halo/compute/linear.py KernelSpec)"))
    variant = "4-bit Q4_1 + Q8_0 head" + (", one int8 pass (ablation)" if args.single_pass else "") + \
        (", MatMulNBits" if args.matmulnbits else "")
    weights = load_weights(args.model)
    tokenizer = load_tokenizer(weights)
    _, held_out = split_text(Path(args.data).read_text(), 0.8)
    tokens = tokenizer.encode(held_out, bos=False)
    windows = [tokens[i:i + args.window] for i in range(0, len(tokens) - args.window + 1, args.window)]
    windows = windows[:args.max_windows] if args.max_windows else windows
    models = {fmt: Transformer(weights, fmt, max_seq_len=args.window) for fmt in ("fp32", "native")}
    nll = {fmt: 0.0 for fmt in models}
    seconds = {fmt: 0.0 for fmt in models}
    agree, count, max_diff, sum_diff, first = 0, 0, 0.0, 0.0, None
    for i, window in enumerate(tqdm(windows, desc="windows")):
        logits = {}
        for fmt, model in models.items():
            model.reset()
            t = time.perf_counter()
            logits[fmt] = model.forward(window, all_logits=True)
            seconds[fmt] += time.perf_counter() - t
            nll[fmt] += window_stats(logits[fmt], window)
        diff = np.abs(logits["native"] - logits["fp32"])
        same = logits["native"].argmax(-1) == logits["fp32"].argmax(-1)
        agree, count = agree + int(same.sum()), count + len(window)
        max_diff, sum_diff = max(max_diff, float(diff.max())), sum_diff + float(diff.sum(dtype=np.float64))
        if i == 0:
            first = {"tokens": len(window), "agreement": float(same.mean()), "max_abs_logit_diff": float(diff.max()),
                     "mean_abs_logit_diff": float(diff.mean())}
    predicted = len(windows) * (args.window - 1)
    ppl = {fmt: float(np.exp(nll[fmt] / predicted)) for fmt in models}
    result = {
        "command": command_line("halo.eval.accuracy_gguf", argv), "model": args.model, "file": weights.source,
        "data": f"{Path(args.data).name}, last 20 %", "window": args.window, "windows": len(windows),
        "predicted_tokens": predicted, "perplexity": ppl,
        "perplexity_relative_diff": ppl["native"] / ppl["fp32"] - 1,
        "agreement": agree / count, "max_abs_logit_diff": max_diff,
        "mean_abs_logit_diff": sum_diff / (count * weights.config.vocab_size), "first_window": first,
        "prefill_s_per_window": {fmt: seconds[fmt] / len(windows) for fmt in models},
    }
    lines = [f"# {args.model}: 4-bit kernels vs dequantized fp32", "",
             f"Command: `{result['command']}`. Text: {result['data']} ({len(tokens)} tokens), {len(windows)} windows "
             f"of {args.window} tokens, {predicted} predicted tokens. Both formats run the same file "
             f"({Path(weights.source).name}) in one process; fp32 equals transformers' dequantized load within 1e-4.",
             "", f"| metric | fp32 (dequantized) | native ({variant}) |", "|---|---|---|",
             f"| perplexity | {ppl['fp32']:.4f} | {ppl['native']:.4f} ({100 * result['perplexity_relative_diff']:+.3f} %) |",
             f"| greedy next-token agreement, all windows | – | {100 * result['agreement']:.2f} % |",
             f"| greedy agreement, first {first['tokens']} tokens | – | {100 * first['agreement']:.2f} % |",
             f"| max / mean abs logit difference, all windows | – | {max_diff:.4f} / {result['mean_abs_logit_diff']:.5f} |",
             f"| max / mean abs logit difference, first window | – | {first['max_abs_logit_diff']:.4f} / "
             f"{first['mean_abs_logit_diff']:.5f} |",
             f"| prefill s per window (machine shared, indicative) | {seconds['fp32'] / len(windows):.1f} | "
             f"{seconds['native'] / len(windows):.1f} |", "",
             f"native = {kernel}; goals: perplexity within 1 %, agreement >= 99 %."]
    stem = (f"accuracy_gguf_{Path(weights.source).stem.replace('.', '_')}"
            + ("_single_pass" if args.single_pass else "") + ("_matmulnbits" if args.matmulnbits else ""))
    result["split_activations"] = not args.single_pass
    result["kernel"] = kernel
    write_report(args.out, stem, result, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
