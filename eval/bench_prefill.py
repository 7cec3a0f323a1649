"""Prompt processing in one process: how long a prompt of each length takes before the first new token.

    python -m halo.eval.bench_prefill [--model smollm2-135m-instruct] [--lengths 256,1024,2000] [--runs 3]
                                      [--baseline-python OTHER/bin/python]

Each run is a fresh worker process (--threads BLAS threads) that loads the model and runs one forward pass over the
first N tokens of real text for each length N (the prompt's logits; its K/V cached, as generation starts): a trained
model's attention on real text (peaked: many vanishing probabilities) costs what random weights do not show. With
--baseline-python (an interpreter whose `halo` is another version, e.g. a virtual environment holding an earlier
commit), both run interleaved in one benchmark, and the table puts them side by side. Writes
eval/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from halo.eval.accuracy_gguf import DATA
from halo.eval.bench_churn import add_model_argument, model_file
from halo.eval.report import command_line, run_script, write_report


# A worker: seconds per prompt length in one process (a model loaded once, every prompt the first n tokens of the
# same token ids, from position 0). Run as a program of its own (python -c), so a baseline interpreter needs only its
# own halo, not this benchmark.
WORKER = """
import json, sys, time
import numpy as np
from halo.compute.transformer import Transformer
from halo.model.loader import load_weights

model, lengths, ids = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], np.load(sys.argv[3])
transformer = Transformer(load_weights(model), fmt="native")  # halo-master's default context (2,048 at most)
transformer.forward(ids[:4], 0)  # warm
seconds = {}
for n in lengths:
    t = time.perf_counter()
    transformer.forward(ids[:n], 0)
    seconds[str(n)] = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "halo": __import__("halo").__file__}))
"""


def prompt_ids(model: str, text: str | None, n: int) -> np.ndarray:
    """The first n token ids of the text file (the model's tokenizer), or n random ids without one."""
    from halo.model.loader import load_tokenizer, load_weights

    weights = load_weights(model)
    if not text:
        return np.random.default_rng(0).integers(3, weights.config.vocab_size, n)
    ids = np.asarray(load_tokenizer(weights).encode(Path(text).read_text()), dtype=np.int64)
    if len(ids) < n:
        raise SystemExit(f"{text} holds {len(ids)} tokens, fewer than the longest prompt ({n})")
    return ids[:n]


def run_worker(python: str, model: str, lengths: list[int], ids: Path, threads: int, timeout_s: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    argv = [python, "-c", WORKER, model, ",".join(map(str, lengths)), str(ids)]
    # run beside the prompt file, not here: from a checkout's root `import halo` would find the checkout's own halo/
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ids.parent)
    if done.returncode != 0:
        raise SystemExit(f"the worker under {python} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(result: dict) -> list[str]:
    setups = result["setups"]
    lines = [f"# Prompt processing in one process ({result['model'].rsplit('/', 1)[-1]})", "",
             f"Command: `{result['command']}`. {result['threads']} BLAS thread(s); a fresh process a run, one forward "
             f"pass from position 0 over the first N tokens of {result['text'] or 'random token ids'} for each length "
             f"N; the median of {result['runs']} interleaved runs (every run in parentheses). Each setup's halo: "
             + ", ".join(f"{name} `{where}`" for name, where in result["halo"].items()) + "."
             + (" **Both ran the same halo: this compares nothing.**" if len(set(result["halo"].values())) < len(setups)
                else ""), "",
             "| prompt tokens | " + " | ".join(f"{s} s" for s in setups) + " | "
             + " | ".join(f"{s} ms a token" for s in setups) + (" | baseline / this |" if len(setups) > 1 else " |"),
             "|---" * (1 + 2 * len(setups) + (len(setups) > 1)) + "|"]
    for n in result["lengths"]:
        times = {s: [run[str(n)] for run in result["runs_by_setup"][s]] for s in setups}
        median = {s: float(np.median(v)) for s, v in times.items()}
        cells = [f"{median[s]:.2f} ({', '.join(f'{v:.2f}' for v in times[s])})" for s in setups]
        cells += [f"{1e3 * median[s] / n:.1f}" for s in setups]
        if len(setups) > 1:
            cells.append(f"{median['baseline'] / median['this']:.2f}x")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser, "smollm2-135m-instruct", ": a trained model, its attention is what real prompts meet")
    parser.add_argument("--text", default=str(DATA) if DATA.is_file() else "",
                        help="the prompts' text: its first N tokens (default: the held-out TinyStories text; '': random "
                             "token ids)")
    parser.add_argument("--lengths", type=lambda s: [int(n) for n in s.split(",")], default=[256, 1024, 2000],
                        help="prompt lengths, comma-separated")
    parser.add_argument("--baseline-python", help="an interpreter whose halo is the version to compare against")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="BLAS threads of a worker (numpy's products: a prompt's attention scores)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a worker may take")
    parser.add_argument("--name", default="prefill")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    if not args.lengths or min(args.lengths) < 1 or args.runs < 1 or args.threads < 1:
        raise SystemExit("--lengths: prompt lengths of 1 or more; --runs and --threads: 1 or more")
    model = str(Path(model_file(args.model)).resolve())  # absolute: the workers run elsewhere
    setups = {"this": sys.executable}
    if args.baseline_python:
        setups["baseline"] = shutil.which(args.baseline_python) or str(Path(args.baseline_python).resolve())
    runs, halo = {name: [] for name in setups}, {}
    with tempfile.TemporaryDirectory(prefix="halo-prefill-") as work:
        ids = Path(work) / "prompt.npy"
        np.save(ids, prompt_ids(model, args.text, max(args.lengths)))
        for run in range(args.runs):
            for name, python in setups.items():
                report = run_worker(python, model, args.lengths, ids, args.threads, args.timeout)
                runs[name].append(report["seconds"])
                halo[name] = str(Path(report["halo"]).parent)  # which halo the interpreter ran
                print(f"run {run + 1}/{args.runs} {name} (halo in {halo[name]}): {report['seconds']}", flush=True)
    result = {"command": command_line("halo.eval.bench_prefill", argv if argv is not None else sys.argv[1:]),
              "model": model, "lengths": args.lengths, "runs": args.runs, "threads": args.threads, "text": args.text,
              "setups": list(setups), "halo": halo, "pythons": setups, "runs_by_setup": runs}
    write_report(args.out, args.name, result, render(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
