"""Partial-sum compression on the wire: error, speed and packets per vector for fp32, fp16 and int8.

    python -m halo.eval.bench_compression

Vectors: Gaussian and heavy-tailed (Student t, 3 degrees of freedom: the outliers real hidden
states have). Time = encode + decode of every chunk of one vector (wire.encode_values /
decode_values), median of 200. Fewer datagrams per vector means fewer packets at risk per round.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from halo.transport import wire

from halo.eval.report import command_line, run_script, write_report

NAMES = {wire.FLOAT32: "fp32", wire.FLOAT16: "fp16", wire.INT8: "int8 (64-value blocks)"}


def roundtrip(values: np.ndarray, dtype: int) -> np.ndarray:
    per = wire.values_per_chunk(dtype)
    out = np.empty_like(values)
    for i in range(wire.chunk_count(len(values), dtype)):
        chunk = values[i * per:(i + 1) * per]
        out[i * per:i * per + len(chunk)] = wire.decode_values(wire.encode_values(chunk, dtype), dtype, len(chunk))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="eval/results", help="where the results go (default eval/results)")
    parser.add_argument("--name", default="transport_compression")
    args = parser.parse_args(argv)  # (it read none: --help ran the benchmark and wrote its results)
    rng = np.random.default_rng(0)
    rows = []
    for dim in (2048, 4096):
        for dist in ("gaussian", "student-t(3)"):
            draw = rng.standard_normal if dist == "gaussian" else (lambda n: rng.standard_t(3, n))
            vectors = [draw(dim).astype(np.float32) for _ in range(50)]
            for dtype, name in NAMES.items():
                errors = [np.linalg.norm(roundtrip(v, dtype) - v) / np.linalg.norm(v) for v in vectors]
                times = []
                for v in vectors * 4:
                    t = time.perf_counter()
                    roundtrip(v, dtype)
                    times.append(time.perf_counter() - t)
                rows.append({"dim": dim, "distribution": dist, "format": name,
                             "datagrams": wire.chunk_count(dim, dtype),
                             "relative_l2_error_mean": float(np.mean(errors)),
                             "relative_l2_error_max": float(np.max(errors)),
                             "encode_decode_us": 1e6 * float(np.median(times))})
    command = command_line("halo.eval.bench_compression", argv)
    lines = ["# Partial-sum compression on the wire", "", f"Command: `{command}`. Error = ||decoded - x|| / ||x|| "
             "(mean / max over 50 vectors); time = encode + decode of one whole vector in Python/numpy.", "",
             "| D | values | format | datagrams | rel. L2 error mean / max | encode+decode µs |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dim']} | {r['distribution']} | {r['format']} | {r['datagrams']} | "
                     f"{r['relative_l2_error_mean']:.1e} / {r['relative_l2_error_max']:.1e} | {r['encode_decode_us']:.0f} |")
    write_report(args.out, args.name, {"command": command, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
