"""Build the offline TinyStories tasks' data from the held-out part of the validation text.

    python -m halo.eval.build_tinystories_tasks [--data ../shared/data/tinystories_valid_dev.txt]

Held-out = the text after the paragraph boundary at 80 % of the characters (the predictors trained on
the first 80 %, `halo.predictors.profiler.split_text`). Deterministic (seed 0); writes
eval/lm_eval_tasks/data/:
- tinystories_ppl.jsonl: {"text"}: paragraphs of at least 150 characters (the perplexity task);
- tinystories_cloze.jsonl: {"context", "choices", "label"}: a paragraph without its last word; the
  choices are that word and three other paragraph-final words of the held-out text (what a tiny story
  model can be judged on: the word that closes a story sentence).
TinyStories is CDLA-Sharing-1.0; the derived files keep that license (see data/README.md).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

from halo.predictors.profiler import split_text

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories_valid_dev.txt"
OUT = Path(__file__).resolve().parent / "lm_eval_tasks" / "data"
LAST_WORD = re.compile(r"^(?P<context>.*\S)\s+(?P<word>[A-Za-z]+)(?P<tail>[.!?\"']*)$", re.S)


def build(text: str, ppl_docs: int = 64, cloze_items: int = 200, seed: int = 0) -> tuple[list, list]:
    _, held = split_text(text, 0.8)
    paragraphs = [" ".join(p.split()) for p in held.split("\n\n") if p.strip()]
    ppl = [{"text": p} for p in paragraphs if len(p) >= 150][:ppl_docs]
    parts = [m for m in map(LAST_WORD.match, paragraphs) if m and len(m["context"]) >= 80]
    pool = sorted({m["word"].lower() for m in parts})
    rng = np.random.default_rng(seed)
    cloze = []
    for m in parts[:cloze_items]:
        word = m["word"]
        others = [w for w in pool if w != word.lower()]
        distractors = [others[i] for i in rng.choice(len(others), size=3, replace=False)]
        choices = [word] + distractors
        order = rng.permutation(4)
        cloze.append({"context": m["context"], "choices": [" " + choices[i] for i in order],
                      "label": int(np.flatnonzero(order == 0)[0])})
    return ppl, cloze


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    ppl, cloze = build(Path(args.data).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("tinystories_ppl.jsonl", ppl), ("tinystories_cloze.jsonl", cloze)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {out / name}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    from halo.eval.report import run_script

    sys.exit(run_script(main))
