"""Single-process decode speed per weight format against the machine's memory bandwidth.

    python -m halo.eval.bench_engine [--layers 22] [--tokens 32] [--out eval/results]
    python -m halo.eval.bench_engine --model smollm2-135m-instruct [--threads 1,2]
    python -m halo.eval.bench_engine --random-gguf Q4_0          (TinyLlama-1.1B shape, 4-bit random GGUF)

Without --model: builds a TinyLlama-1.1B-shaped checkpoint with random weights (or a GGUF with
--random-gguf), then for each weight format runs a fresh process on ONE core (BLAS and onnxruntime
limited to one thread): load, prefill 8 tokens, decode N tokens greedily. Reports ms per token, weight
bytes streamed per token divided by time (effective bandwidth), that as a fraction of a STREAM-style
copy bandwidth measured in the same run on one core, and peak RSS against weight bytes + KV cache.

With --model (a path or a fetched model's name): formats native (the file's own blocks) and fp32
(dequantized), each at every --threads count, plus llama.cpp on the same file and threads when
llama-cpp-python is installed (the anchor). For a GGUF it also reports the resident weights (RSS growth
over a process that has loaded the runtime, after load and decode) against the file's tensor bytes,
and the roofline: the file's tensor bytes (what a token must read) / one core's copy bandwidth.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core, before numpy loads BLAS
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf, write_random_llama  # noqa: E402
from halo.eval.report import command_line, host, run_script, write_report  # noqa: E402
from halo.runtime.local import module_command

FORMATS = ("fp32", "int8")


def stream_copy_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5, threads: int = 1) -> float:
    """STREAM 'copy' on `threads` cores (each copying its share; numpy copies without the GIL): (bytes read + bytes
    written) / time, best of repeats."""
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(n_bytes // 8)
    b = np.zeros_like(a)
    shares = [slice(s[0], s[-1] + 1) for s in np.array_split(np.arange(len(a)), threads)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t = time.perf_counter()
            list(pool.map(lambda share: np.copyto(b[share], a[share]), shares))
            best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best


def current_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)


def warm_runtime(fmt: str) -> None:
    """Run a tiny random model (a GGUF of one 64-wide layer) in `fmt` through a prefill and a decode step, so that
    the libraries' own memory (onnxruntime, the model-file readers, the code pages decoding executes) is in the
    baseline, not counted as weights."""
    from halo.compute.transformer import Transformer
    from halo.model.loader import load_weights

    with tempfile.TemporaryDirectory(prefix="halo-warm-") as tmp:
        model = Transformer(load_weights(write_random_gguf(Path(tmp) / "tiny.gguf", TINY, "Q4_1")), fmt=fmt)
        model.forward(np.arange(3, 11))
        model.forward([3])
        del model


def run_worker(directory: str, fmt: str, n_tokens: int, context: int, threads: int = 1) -> dict:
    """Inside the per-format process: load, decode, measure. Format "native-onnxruntime" (or "int8-onnxruntime"):
    that format on MatMulNBits sessions even where halo's C kernel is built (the comparison)."""
    import halo.compute.linear
    from halo.compute.transformer import Transformer
    from halo.host.memory import peak_rss_bytes, release_freed_heap
    from halo.model.loader import load_weights

    label = fmt
    if fmt.endswith("-onnxruntime"):
        halo.compute.linear.PREFER_C_KERNEL, fmt = False, fmt.removesuffix("-onnxruntime")
    warm_runtime(fmt)
    release_freed_heap()
    baseline = current_rss_bytes()
    t = time.perf_counter()
    weights = load_weights(directory)
    model = Transformer(weights, fmt=fmt, max_seq_len=context, threads=threads)
    load_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    logits = model.forward(rng.integers(3, weights.config.vocab_size, 8))
    times = []
    for _ in range(n_tokens):
        token = int(np.argmax(logits))
        t = time.perf_counter()
        logits = model.forward([token])
        times.append(time.perf_counter() - t)
    release_freed_heap()  # what a long-running process hands back: the prefill's freed buffers are not weights
    weight_bytes = model.weight_nbytes()
    streamed = weight_bytes - model.tok_embeddings.nbytes  # the embedding table is a lookup, not streamed
    return {"format": label, "threads": threads, "load_s": load_s, "ms_per_token_median": 1e3 * float(np.median(times)),
            "ms_per_token_mean": 1e3 * float(np.mean(times)), "weight_bytes": weight_bytes,
            "file_tensor_bytes": weights.nbytes(), "streamed_bytes_per_token": streamed,
            # what a token must read of the file: every tensor but an untied embedding table (a lookup of one row)
            "token_read_bytes": weights.nbytes() - (0 if weights.config.tied_embeddings
                                                    else weights.tok_embeddings.nbytes),
            "kv_cache_bytes": model.kv_cache_nbytes(),
            "resident_growth_bytes": current_rss_bytes() - baseline, "peak_rss_bytes": peak_rss_bytes()}


def run_llama_cpp_worker(path: str, n_tokens: int, context: int, threads: int) -> dict:
    """llama.cpp (llama-cpp-python) on the same file: the same 8-token prefill and greedy decode, timed per token."""
    import llama_cpp

    from halo.host.memory import peak_rss_bytes

    baseline = current_rss_bytes()
    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=context, n_threads=threads, n_threads_batch=threads,
                          n_batch=64, verbose=False)
    load_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    llm.eval(rng.integers(3, llm.n_vocab(), 8).tolist())
    times = []
    for _ in range(n_tokens):
        token = int(np.argmax(llm.eval_logits[-1]))
        t = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - t)
    return {"format": "llama.cpp", "threads": threads, "load_s": load_s,
            "ms_per_token_median": 1e3 * float(np.median(times)), "ms_per_token_mean": 1e3 * float(np.mean(times)),
            "llama_cpp_python": llama_cpp.__version__, "resident_growth_bytes": current_rss_bytes() - baseline,
            "peak_rss_bytes": peak_rss_bytes()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model file/directory or a fetched model's name (e.g. smollm2-135m-instruct); "
                        "default: a random TinyLlama-shaped checkpoint")
    parser.add_argument("--random-gguf", metavar="QTYPE", help="benchmark a random TinyLlama-shaped GGUF in QTYPE "
                        "(Q4_0, Q4_1, Q8_0) instead of the fp32 checkpoint")
    parser.add_argument("--layers", type=int, default=22, help="decoder layers of the random model (TinyLlama has 22)")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps to time")
    parser.add_argument("--context", type=int, default=2048, help="KV-cache length allocated")
    parser.add_argument("--formats", help="weight formats (default: fp32,int8; with --model or --random-gguf: "
                        "native,fp32); native-onnxruntime / int8-onnxruntime: on MatMulNBits where halo's C kernel "
                        "is built")
    parser.add_argument("--threads", default="1", help="comma-separated thread counts (default 1; e.g. 1,2)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp anchor even if installed")
    parser.add_argument("--repeats", type=int, default=1, help="run every configuration this many times, interleaved "
                        "(a shared machine drifts), and report the run with the median time")
    parser.add_argument("--checkpoint", help="reuse this checkpoint directory instead of writing one")
    parser.add_argument("--out", default="eval/results", help="where the JSON and markdown go")
    parser.add_argument("--worker", nargs=2, metavar=("DIR", "FORMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        threads = int(args.threads)
        if args.worker[1] == "llama.cpp":
            row = run_llama_cpp_worker(args.worker[0], args.tokens, args.context, threads)
        else:
            row = run_worker(args.worker[0], args.worker[1], args.tokens, args.context, threads)
        print(json.dumps(row))
        return 0

    from halo.model.loader import load_config, model_path

    cfg = dict(TINYLLAMA_1_1B, num_hidden_layers=args.layers)
    tmp = None
    if args.model:
        model = str(model_path(args.model))
        description = f"{args.model} ({Path(model).name})"
    elif args.checkpoint:
        model, description = args.checkpoint, f"checkpoint {args.checkpoint}"
    else:
        tmp = tempfile.TemporaryDirectory(prefix="halo-bench-")
        if args.random_gguf:
            model = str(Path(tmp.name) / f"tinyllama-random.{args.random_gguf}.gguf")
            print(f"writing a random TinyLlama-shaped {args.random_gguf} GGUF ({args.layers} layers) to {model} ...",
                  flush=True)
            write_random_gguf(model, cfg, args.random_gguf)
            description = f"TinyLlama-1.1B shape, random weights, GGUF {args.random_gguf}"
        else:
            model = tmp.name
            print(f"writing a random TinyLlama-shaped checkpoint ({args.layers} layers) to {model} ...", flush=True)
            write_random_llama(model, cfg)
            description = "TinyLlama-1.1B shape, random weights"
    config = load_config(model)
    formats = (args.formats or ("native,fp32" if args.model or args.random_gguf else ",".join(FORMATS))).split(",")
    thread_counts = [int(t) for t in args.threads.split(",")]
    runs = [(fmt, t) for t in thread_counts for fmt in formats]
    if model.endswith(".gguf") and not args.no_llama_cpp:
        if importlib.util.find_spec("llama_cpp"):
            runs += [("llama.cpp", t) for t in thread_counts]
        else:
            print("llama.cpp anchor: not measured (llama-cpp-python is not installed)", flush=True)
    copy_samples = [stream_copy_bandwidth()]
    cores_samples = {t: [stream_copy_bandwidth(threads=t)] for t in thread_counts if t > 1}  # N threads: N cores' copy
    repeats: dict[tuple, list[dict]] = {run: [] for run in runs}
    anchor_note = None  # why llama.cpp was not measured, if it refused the file
    for _ in range(max(1, args.repeats)):  # interleaved: every configuration sees the same drift
        for fmt, threads in [run for run in runs if run in repeats]:
            env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
            out = subprocess.run([*module_command("halo.eval.bench_engine"), "--worker", model, fmt, "--tokens",
                                  str(args.tokens), "--context", str(args.context), "--threads", str(threads)],
                                 capture_output=True, text=True, env=env)
            if out.returncode and fmt == "llama.cpp":  # the anchor, not the subject: say so and go on
                reason = (out.stderr.strip().splitlines() or ["no message"])[-1]
                anchor_note = f"llama.cpp: not measured ({reason})"
                print(anchor_note, flush=True)
                for run in [run for run in repeats if run[0] == "llama.cpp"]:
                    del repeats[run]
                continue
            if out.returncode:
                raise SystemExit(f"{fmt} x{threads} failed:\n{out.stderr[-2000:]}")
            repeats[(fmt, threads)].append(json.loads(out.stdout.strip().splitlines()[-1]))
            copy_samples.append(stream_copy_bandwidth())
            if threads in cores_samples:
                cores_samples[threads].append(stream_copy_bandwidth(threads=threads))
            print(f"{fmt} x{threads}: {repeats[(fmt, threads)][-1]['ms_per_token_median']:.1f} ms/token", flush=True)
    rows = []
    for samples in repeats.values():
        ordered = sorted(samples, key=lambda r: r["ms_per_token_median"])
        rows.append({**ordered[(len(ordered) - 1) // 2],
                     "ms_per_token_repeats": [r["ms_per_token_median"] for r in samples]})
    # the machine's bandwidth drifts (shared VM): take the best copy seen, which makes fractions conservative
    copy_bw = max(copy_samples)
    print(f"STREAM copy, one core: {', '.join(f'{c / 1e9:.2f}' for c in copy_samples)} GB/s; using the best", flush=True)
    cores_bw = {1: copy_bw, **{t: max(samples) for t, samples in cores_samples.items()}}
    for row in rows:
        if "weight_bytes" in row:
            row["effective_gb_s"] = row["streamed_bytes_per_token"] / (row["ms_per_token_median"] / 1e3) / 1e9
            row["roofline_fraction"] = row["effective_gb_s"] * 1e9 / copy_bw
            row["peak_rss_over_weights_plus_kv"] = row["peak_rss_bytes"] / (row["weight_bytes"] + row["kv_cache_bytes"])
    file_bytes = next((r["file_tensor_bytes"] for r in rows if "file_tensor_bytes" in r), None)
    read_bytes = next((r["token_read_bytes"] for r in rows if "token_read_bytes" in r), None)
    if file_bytes and model.endswith(".gguf"):
        roofline_ms = read_bytes / copy_bw * 1e3  # a token reads these bytes once
        anchor = {r["threads"]: r["ms_per_token_median"] for r in rows if r["format"] == "llama.cpp"}
        for row in rows:
            row["file_roofline_ms"] = roofline_ms
            row["file_roofline_fraction"] = roofline_ms / row["ms_per_token_median"]
            # against the copy bandwidth of as many cores as the row's threads (2 cores here copy ~1.3x one)
            row["file_roofline_fraction_its_cores"] = read_bytes / cores_bw[row["threads"]] / (
                row["ms_per_token_median"] / 1e3)
            row["resident_over_file_bytes"] = row["resident_growth_bytes"] / file_bytes
            if row["threads"] in anchor:
                row["over_llama_cpp"] = row["ms_per_token_median"] / anchor[row["threads"]]
    result = {"benchmark": "single-process decode", "model": description, "config": dataclasses.asdict(config),
              "context": args.context, "decode_tokens": args.tokens, "stream_copy_gb_s": copy_bw / 1e9,
              "stream_copy_samples_gb_s": [c / 1e9 for c in copy_samples],
              "stream_copy_gb_s_by_cores": {t: bw / 1e9 for t, bw in cores_bw.items()},
              "machine": host(),
              "command": command_line("halo.eval.bench_engine", argv), "results": rows}
    if anchor_note:
        result["llama_cpp"] = anchor_note
    if args.model or args.random_gguf:
        stem = "engine_decode_" + Path(args.model or f"tinyllama-{args.random_gguf}").name.replace(".", "_")
        lines = gguf_table(result, rows, copy_bw, file_bytes, read_bytes)
    else:
        stem = "engine_decode"
        lines = fp32_table(result, rows, copy_bw, args, copy_samples)
    write_report(args.out, stem, result, lines)
    for line in lines:
        if line.startswith("|"):
            print(line)
    if tmp:
        tmp.cleanup()
    return 0


def fp32_table(result, rows, copy_bw, args, copy_samples) -> list[str]:
    lines = [f"# Single-process decode, one core ({result['model']}, {args.layers} layers)", "",
             f"Command: `{result['command']}`. Host: {result['machine']['cpu']}, {result['machine']['cores']} cores. STREAM copy (read + write bytes) on one core, measured before and after "
             f"each format in the same run, best of {len(copy_samples)}: **{copy_bw / 1e9:.2f} GB/s**. "
             f"Decode: median of {args.tokens} steps after an 8-token prefill.", "",
             "| format | ms/token (median) | weight bytes streamed/token | effective GB/s | % of copy BW | "
             "peak RSS | weights + KV | peak / (weights + KV) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['ms_per_token_median']:.1f} | {r['streamed_bytes_per_token'] / 1e9:.3f} GB | "
                     f"{r['effective_gb_s']:.2f} | {100 * r['roofline_fraction']:.0f} % | {r['peak_rss_bytes'] / 1e9:.2f} GB | "
                     f"{(r['weight_bytes'] + r['kv_cache_bytes']) / 1e9:.2f} GB | {r['peak_rss_over_weights_plus_kv']:.2f} |")
    lines += ["", "Weight bytes streamed per token: every projection matrix and the LM head in the format's own "
              "size (int8: codes + one float32 scale per 128 inputs); the embedding table is a row lookup and "
              "not counted. Effective GB/s = those bytes / median decode time. Peak RSS is the worker "
              "process's VmHWM, compared with the weight bytes (embedding table included, in fp32) plus the "
              f"KV cache allocated for {args.context} tokens."]
    return lines


def gguf_table(result, rows, copy_bw, file_bytes, read_bytes) -> list[str]:
    mb = 1e6
    lines = [f"# Single-process decode: {result['model']}", "",
             f"Command: `{result['command']}`. Host: {result['machine']['cpu']}, {result['machine']['cores']} cores. Decode: median of {result['decode_tokens']} greedy steps after an "
             f"8-token prefill, context {result['context']}. STREAM copy on one core, best of "
             f"{len(result['stream_copy_samples_gb_s'])} samples taken between the runs: **{copy_bw / 1e9:.2f} GB/s**"
             + "".join(f"; on {t} cores: {bw:.2f} GB/s" for t, bw in result["stream_copy_gb_s_by_cores"].items() if t > 1)
             + "."]
    if file_bytes:
        reads = ("all of them once (the tied LM head reads the embedding matrix)" if read_bytes == file_bytes else
                 f"{read_bytes / mb:.1f} MB of them once (all but the embedding table, a row lookup)")
        lines.append(f"The file's tensor bytes: **{file_bytes / mb:.1f} MB**; a token reads {reads}, so the one-core "
                     f"roofline is {read_bytes / copy_bw * 1e3:.2f} ms/token.")
    if "llama_cpp" in result:
        lines.append(result["llama_cpp"] + ".")
    lines += ["", "| engine / weights | threads | ms/token (median) | each run | x llama.cpp | roofline fraction | "
              "of its cores' | kernel weight bytes | resident growth | resident / file bytes | peak RSS | load s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        each = ", ".join(f"{ms:.1f}" for ms in r.get("ms_per_token_repeats", [r["ms_per_token_median"]]))
        over = f"{r['over_llama_cpp']:.2f}" if "over_llama_cpp" in r else "–"
        roof = f"{100 * r['file_roofline_fraction']:.0f} %" if "file_roofline_fraction" in r else "–"
        cores = f"{100 * r['file_roofline_fraction_its_cores']:.0f} %" if "file_roofline_fraction" in r else "–"
        kernel = f"{r['weight_bytes'] / mb:.1f} MB" if "weight_bytes" in r else "–"
        ratio = f"{r['resident_over_file_bytes']:.2f}" if "resident_over_file_bytes" in r else "–"
        lines.append(f"| {'halo ' + r['format'] if r['format'] != 'llama.cpp' else 'llama.cpp'} | {r['threads']} | "
                     f"{r['ms_per_token_median']:.1f} | {each} | {over} | {roof} | {cores} | {kernel} | "
                     f"{r['resident_growth_bytes'] / mb:.1f} MB | {ratio} | {r['peak_rss_bytes'] / mb:.0f} MB | "
                     f"{r['load_s']:.1f} |")
    lines += ["", "With --repeats, every configuration ran that many times interleaved (each run: its median over the "
              "decode steps); the row is the run with the median time, x llama.cpp compares those. "
              "Roofline fraction = (the bytes a token reads / one-core copy bandwidth) / measured time (for 2 threads "
              "still against one core's bandwidth); of its cores': against the copy bandwidth of as many cores as "
              "threads. Kernel weight bytes: what halo hands its kernels (native: "
              "4/8-bit codes + their scales (+ Q4_1 offsets; float16 where the file's are, in halo's C kernel), "
              "plus the embedding blocks for lookups (read from the file mapping, a row at a time); fp32: "
              "dequantized float32). Resident growth: RSS after load and decode (freed heap handed back) minus "
              "RSS of the same process after a tiny random model of the same format ran a prefill and a decode step "
              "(libraries and the code pages decoding runs are in the baseline; counted: weights, kernel packing, "
              "the file header, KV pages touched, buffers); llama.cpp: minus "
              "the interpreter's RSS before loading (its weights are a file mapping, counted once touched)."]
    return lines


if __name__ == "__main__":
    sys.exit(run_script(main))
