"""How far ahead halo's C kernel should ask the memory for weights: a sweep of the prefetch distance, per GGUF format.

    python -m halo.eval.bench_kernel_prefetch [--megabytes 520] [--repeats 3] [--model tinyllama-q4] [--runs 3]

Streams ~--megabytes of random TinyLlama MLP-sized matrices (11,264 x 2,048, a token's gate+up: one decode step
each, one thread) through `_nbits.matmul` at each distance and reports the bytes read per second, with the distance
the kernel picks for this CPU by itself (halo/_nbits.c `prefetch_distance`) and a STREAM-style copy on one core for
scale; then decodes --model in one process (one thread, greedy, bench_halo_speed's prompt and warm-up) at the old
fixed distance and at the CPU's own, --runs times each, interleaved. A distance is in units: one block of a 16-row
tile (its codes, scales and offsets; Q4_0 with float16 scales: 288 bytes). Why: one fixed distance (32 units, ~9 KB)
ran an AMD EPYC host at 78 % of its copy bandwidth and an Intel Xeon host at ~35-40 %; a token of a compact model is
one such stream, so this distance sets single-device speed. Results differ by CPU; run it on the machine in
question (the JSON records its CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from halo.compute.linear import _nbits, pack
from halo.eval.bench_churn import add_model_argument, model_file
from halo.eval.bench_engine import stream_copy_bandwidth
from halo.eval.report import command_line, cpu_model, run_script, write_report

ROWS, COLUMNS, BLOCK = 11264, 2048, 32  # TinyLlama's gate and up rows, its hidden size; GGUF's blocks of 32
FORMATS = {"Q4_0": (4, False), "Q4_1": (4, True), "Q8_0": (8, False)}  # bits, offsets (float16 scales, as GGUF's)
DISTANCES = (1, 2, 3, 4, 6, 8, 16, 32, 64)  # units ahead
FIXED = 32  # the one distance every CPU had before, and still the choice off Intel


def matrices(bits: int, offsets: bool, megabytes: float, rng) -> list[tuple]:
    """Distinct copies of one random packed matrix, together ~megabytes (at least one; a few hundred MB: each read from
    memory, not cache)."""
    codes = rng.integers(0, 256, (ROWS, COLUMNS // BLOCK, BLOCK * bits // 8), dtype=np.uint8)
    scales = rng.random((ROWS, COLUMNS // BLOCK)).astype(np.float16)
    packed = pack(codes, scales, rng.random(scales.shape).astype(np.float16) if offsets else None)
    count = max(1, int(megabytes * 1e6 // packed.nbytes))
    return [(packed.copy(), ROWS, bits, BLOCK, True, offsets, 1) for _ in range(count)]


@contextmanager
def prefetch_at(units: int):
    """The kernel's prefetch distance set to `units` inside the block, what it was after."""
    before = _nbits.prefetch_units()
    _nbits.prefetch_units(units)
    try:
        yield
    finally:
        _nbits.prefetch_units(before)


def stream_rate(weights: list[tuple], repeats: int) -> float:
    """Bytes read per second, best of `repeats` passes over every matrix (at the distance now set: each call takes
    it)."""
    x = np.random.default_rng(1).standard_normal((1, COLUMNS)).astype(np.float32)
    out = np.empty((1, ROWS), np.float32)
    total = sum(w[0].nbytes for w in weights)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            _nbits.matmul(w, x, out, 1)
        best = min(best, time.perf_counter() - t)
    return total / best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m halo.eval.bench_kernel_prefetch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=520, help="weights streamed per pass (default: 520)")
    parser.add_argument("--repeats", type=int, default=3, help="passes per distance, the best kept (default: 3)")
    parser.add_argument("--copy-megabytes", type=float, default=1024, help="the STREAM copy's array (default: 1024)")
    add_model_argument(parser, why="; decoded at the old and the chosen distance")
    parser.add_argument("--runs", type=int, default=3, help="decodes at each of the two distances (default: 3)")
    parser.add_argument("--tokens", type=int, default=24, help="timed tokens a decode (default: 24)")
    parser.add_argument("--name", default="kernel_prefetch")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    if _nbits is None or _nbits.paths()[-1] == "scalar":
        raise SystemExit("needs halo's C kernel with a vector path (the package was built without a C compiler, or "
                         "this CPU has neither AVX2 nor AVX-512 VNNI)")
    chosen = _nbits.prefetch_units()
    rng = np.random.default_rng(0)
    rows = []
    for name, (bits, offsets) in FORMATS.items():
        weights = matrices(bits, offsets, args.megabytes, rng)
        unit = weights[0][0].shape[2]
        for units in sorted({*DISTANCES, chosen}):
            with prefetch_at(units):
                rate = stream_rate(weights, args.repeats)
            rows.append({"format": name, "unit_bytes": unit, "ahead_units": units, "ahead_bytes": units * unit,
                         "default": units == chosen, "gb_per_s": round(rate / 1e9, 2)})
            print(rows[-1], flush=True)
        del weights
    copy = stream_copy_bandwidth(int(args.copy_megabytes * (1 << 20)))
    decodes = decode_at(model_file(args.model), [FIXED, chosen], args.runs, args.tokens)
    data = {"command": command_line("halo.eval.bench_kernel_prefetch", argv), "cpu": cpu_model(),
            "path": _nbits.paths()[-1], "default_units": chosen, "copy_gb_per_s_one_core": round(copy / 1e9, 2),
            "rows": rows, "model": str(model_file(args.model)), "decode": decodes}
    lines = [f"# C kernel prefetch distance ({data['cpu']}, {data['path']})", "",
             f"Command: `{data['command']}`. One thread streams random MLP-sized matrices ({ROWS} x {COLUMNS}, "
             f"float16 scales as GGUF's) through `_nbits.matmul`, one decode step each, ~{args.megabytes:.0f} MB a "
             f"pass, best of {args.repeats}; GB/s of weights read at each distance (in units: a 16-row tile's block, "
             f"its codes, scales and offsets; the bytes ahead in parentheses). This CPU's own choice: **{chosen} "
             f"units**. "
             f"STREAM copy on one core: {copy / 1e9:.1f} GB/s (read + write).", "",
             "| units ahead | " + " | ".join(f"{f} GB/s" for f in FORMATS) + " |",
             "|---|" + "---|" * len(FORMATS)]
    for units in sorted({r["ahead_units"] for r in rows}):
        cells = [next(f"{r['gb_per_s']:.1f} ({r['ahead_bytes']} B)" for r in rows
                      if r["format"] == f and r["ahead_units"] == units) for f in FORMATS]
        lines.append(f"| {units}{' (default)' if units == chosen else ''} | " + " | ".join(cells) + " |")
    fixed, own = (median_run(decodes, d) for d in (FIXED, chosen))
    lines += ["", f"## One process decoding {model_file(args.model).name} (one thread)", "",
              "| units ahead | ms per token (median run) | every run |", "|---|---|---|"]
    for distance in dict.fromkeys([FIXED, chosen]):
        runs = [r["ms_per_token"] for r in decodes if r["ahead_units"] == distance]
        lines.append(f"| {distance}{' (default)' if distance == chosen else ''} | {median_run(decodes, distance):.1f} | "
                     + ", ".join(f"{ms:.1f}" for ms in runs) + " |")
    lines += ["", f"The CPU's own distance against the fixed one: {fixed / own:.2f}x as fast a token."]
    write_report(args.out, args.name, data, lines)


def decode_at(model: Path, distances: list[int], runs: int, tokens: int) -> list[dict]:
    """Mean ms per token of greedy decodes at each distance, `runs` rounds of them interleaved; every decode must give
    the first one's tokens (the distance is a hint to the memory, never a different result)."""
    from halo.compute.transformer import Transformer
    from halo.eval.bench_halo_speed import decode, resolved_format
    from halo.model.loader import load_weights

    weights = load_weights(model)
    results, first = [], None
    for run in range(runs):
        for distance in dict.fromkeys(distances):
            with prefetch_at(distance):
                out = decode(Transformer(weights, fmt=resolved_format("native", weights), max_seq_len=256), tokens, 600)
            first = first or out["tokens"]
            if out["tokens"] != first:
                raise SystemExit(f"the decode {distance} units ahead gave other tokens: a kernel bug")
            results.append({"ahead_units": distance, "run": run,
                            "ms_per_token": round(float(np.mean(out["ms_per_token"])), 2)})
            print(results[-1], flush=True)
    return results


def median_run(decodes: list[dict], distance: int) -> float:
    return float(np.median([r["ms_per_token"] for r in decodes if r["ahead_units"] == distance]))


if __name__ == "__main__":
    sys.exit(run_script(main))
