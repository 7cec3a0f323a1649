"""Accuracy under relaxed synchronization (HALO Table II / V / Fig. 7 in kind), simulated in one process.

    python -m halo.eval.accuracy_halo [--model MODEL] [--predictors DIR] [--windows 64] [--prompts 16]

The bundled stories260K by default; `--model smollm2-135m-instruct` (with predictors trained for it:
halo-train-predictors --model smollm2-135m-instruct --data TEXT --out DIR) runs the same study on a real
model. Writes eval/results/accuracy_halo_<model>.{md,json}.

Setting: NGLR (neuron-group loss ratio) = 1 - 1/n for n devices: the master holds 1/n of every
block's groups and syncs reliably; the other n-1 devices' partial sums each arrive with probability
1 - PLR (a stories260K partial sum, 64 floats, is one datagram), independently per block and token;
a lost partial sum is zero-filled. Layer 0, every broadcast and the LM head are reliable. Which groups
sit on lossy devices, per block and token, is the policy: groups are ranked and the top 1/n go to the
master (Algorithm 3 with equal ratios):
- none: nothing is lost (the reference);  random: a fresh random ranking per token;
- static: by mean norm over the training part of the text;  halo: the trained predictors (SAPs), from
  the hidden state entering the previous layer;  oracle-low: by the true norms (the best any
  predictor can do);  oracle-high: reversed (the worst).
Metrics on the held-out last 20 % of ../shared/data/tinystories_valid_dev.txt: perplexity, next-token
top-1 agreement with the lossless run, and exact match of 64-token greedy continuations.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from halo.compute.neuron_groups import GroupLayout
from halo.compute.tracing import TracingTransformer
from halo.model.loader import load_tokenizer, load_weights
from halo.predictors.profiler import split_text

from halo.eval.report import command_line, run_script, write_report

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories_valid_dev.txt"
POLICIES = ("none", "random", "static", "halo", "oracle-low", "oracle-high")


class RelaxedMerge:
    """The merge hook: ranks each block's groups by the policy, drops lossy devices' shares at random."""

    def __init__(self, policy: str, plr: float, n_devices: int, seed: int, predictors=None, static=None):
        self.policy, self.plr, self.n = policy, plr, n_devices
        self.rng = np.random.default_rng(seed)
        self.predictors, self.static = predictors, static
        self.inputs: dict[int, np.ndarray] = {}
        self.dropped = 0
        self.offered = 0

    def __call__(self, layer: int, kind: str, groups: np.ndarray, hidden_in: np.ndarray) -> np.ndarray:
        self.inputs[layer] = hidden_in
        if self.policy == "none" or layer == 0 or self.n == 1:
            return groups.sum(axis=1)
        T, G, _ = groups.shape
        order = self._ranking(layer, kind, groups)  # [T, G], most important first
        chunk = np.minimum(np.arange(G) * self.n // G, self.n - 1)  # rank -> device (0 = master)
        lost_device = self.rng.random((T, self.n)) < self.plr
        lost_device[:, 0] = False
        lost_rank = lost_device[np.arange(T)[:, None], chunk[None, :]]  # [T, G] by rank
        keep = np.ones((T, G), dtype=bool)
        np.put_along_axis(keep, order, ~lost_rank, axis=1)
        self.dropped += int((~keep).sum())
        self.offered += keep.size
        return (groups * keep[:, :, None]).sum(axis=1)

    def _ranking(self, layer: int, kind: str, groups: np.ndarray) -> np.ndarray:
        T, G, _ = groups.shape
        if self.policy == "random":
            return np.argsort(self.rng.random((T, G)), axis=1)
        if self.policy in ("oracle-low", "oracle-high"):
            norms = np.linalg.norm(groups, axis=-1)
            return np.argsort(-norms if self.policy == "oracle-low" else norms, axis=1, kind="stable")
        if self.policy == "static":
            return np.broadcast_to(np.argsort(-self.static[kind][layer], kind="stable"), (T, G))
        heads, mlp = self.predictors.rank(layer, self.inputs[layer - 1])  # halo: one layer ahead
        return np.atleast_2d(heads if kind == "attention" else mlp)


def evaluate(model: TracingTransformer, merge, windows, prompts, reference) -> dict:
    model.merge = merge
    nll, agree, count = 0.0, 0, 0
    for w, ref_logits in zip(windows, reference["logits"]):
        model.reset()
        logits = model.forward(w, all_logits=True)
        z = logits[:-1] - logits[:-1].max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(len(w) - 1), w[1:]].sum())
        agree += int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
        count += len(w) - 1
    exact, token_match = 0, 0.0
    for prompt, expected in zip(prompts, reference["continuations"]):
        got = greedy(model, prompt, len(expected), merge)
        exact += int(got == expected)
        token_match += float(np.mean(np.array(got) == np.array(expected)))
    return {"perplexity": float(np.exp(nll / count)), "top1_agreement": agree / (count + len(windows)),
            "exact_match": exact / len(prompts), "continuation_token_match": token_match / len(prompts)}


def greedy(model: TracingTransformer, prompt: list[int], n: int, merge) -> list[int]:
    model.merge = merge
    model.reset()
    logits = model.forward(prompt)
    out = []
    for _ in range(n):
        token = int(np.argmax(logits))
        out.append(token)
        logits = model.forward([token])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model file or name (default: the bundled stories260K)")
    parser.add_argument("--predictors", help="the model's trained predictors (default: predictors/ beside the model)")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--windows", type=int, default=64, help="128-token windows for perplexity/agreement")
    parser.add_argument("--prompts", type=int, default=16, help="prompts for 64-token continuations")
    parser.add_argument("--plr", default="0.01,0.02,0.05,0.1")
    parser.add_argument("--nglr", default="0.5,0.75,0.875")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    from halo.model.catalog import resolve_model
    from halo.predictors.store import load_predictors

    weights = load_weights(resolve_model(args.model) if args.model else None)
    tokenizer = load_tokenizer(weights)
    model = TracingTransformer(weights, max_seq_len=256)
    train_text, val_text = split_text(Path(args.data).read_text(), 0.8)
    val = tokenizer.encode(val_text, bos=False)
    start = [] if tokenizer.bos_id is None else [tokenizer.bos_id]  # GPT-2-style vocabularies have no BOS
    windows = [start + val[i * 127:(i + 1) * 127] for i in range(args.windows)]
    offset = args.windows * 127
    prompts = [start + val[offset + i * 200:offset + i * 200 + 32] for i in range(args.prompts)]
    predictors = load_predictors(weights, GroupLayout.for_model(weights.config), args.predictors)
    static = static_ranking(model, tokenizer, train_text)
    reference = {"logits": [], "continuations": []}
    for w in windows:
        model.reset()
        reference["logits"].append(model.forward(w, all_logits=True))
    reference["continuations"] = [greedy(model, p, 64, None) for p in prompts]
    rows = []
    base = evaluate(model, RelaxedMerge("none", 0, 1, 0), windows, prompts, reference)
    rows.append({"policy": "none", "plr": 0.0, "nglr": 0.0, **base})
    from tqdm import tqdm

    settings = [(p, float(plr), float(nglr)) for nglr in args.nglr.split(",") for plr in args.plr.split(",")
                for p in POLICIES[1:]]
    for policy, plr, nglr in tqdm(settings, desc="settings"):
        n = int(round(1 / (1 - nglr)))
        merge = RelaxedMerge(policy, plr, n, args.seed, predictors, static)
        result = evaluate(model, merge, windows, prompts, reference)
        rows.append({"policy": policy, "plr": plr, "nglr": nglr, "devices": n, **result,
                     "groups_dropped": merge.dropped / max(merge.offered, 1)})
    command = command_line("halo.eval.accuracy_halo", argv)
    lines = render(rows, command, args, base, Path(weights.source).name)
    name = Path(weights.source).name.split(".")[0]
    write_report(args.out, f"accuracy_halo_{name}", {"command": command, "model": name, "rows": rows}, lines)
    return 0


def static_ranking(model: TracingTransformer, tokenizer, train_text: str) -> dict:
    """Mean group norms per layer over (a slice of) the training text: the static baseline."""
    ids = tokenizer.encode(train_text[:60000], bos=False)
    start = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    sums = None
    for i in range(0, len(ids) - 127, 127):
        model.merge = None
        model.reset()
        model.forward(start + ids[i:i + 127])
        trace = model.trace
        part = {"attention": [t.attention_norms[1:].sum(0) for t in trace], "mlp": [t.mlp_norms[1:].sum(0) for t in trace]}
        sums = part if sums is None else {k: [a + b for a, b in zip(sums[k], part[k])] for k in sums}
    return sums


def render(rows, command, args, base, model: str) -> list[str]:
    lines = [f"# Accuracy under relaxed synchronization, {model} (simulated loss)", "",
             f"Command: `{command}`. Held-out: last 20 % of the text; {args.windows} windows of 128 tokens for "
             f"perplexity and top-1 agreement with the lossless run, {args.prompts} prompts for 64-token greedy "
             f"continuations. Lossless: perplexity {base['perplexity']:.3f}. Cells: perplexity / top-1 agreement / "
             "exact-match of continuations.", ""]
    policies = POLICIES[1:]
    lines += ["| NGLR | PLR | " + " | ".join(policies) + " | halo closes (random→oracle-low) |",
              "|---|---|" + "---|" * len(policies) + "---|"]
    keyed = {(r["policy"], r["plr"], r["nglr"]): r for r in rows}
    for nglr in sorted({r["nglr"] for r in rows if r["policy"] != "none"}):
        for plr in sorted({r["plr"] for r in rows if r["policy"] != "none"}):
            cells = []
            for p in policies:
                r = keyed[(p, plr, nglr)]
                cells.append(f"{r['perplexity']:.3f} / {r['top1_agreement']:.3f} / {r['exact_match']:.2f}")
            gap = keyed[("random", plr, nglr)]["perplexity"] - keyed[("oracle-low", plr, nglr)]["perplexity"]
            closed = (keyed[("random", plr, nglr)]["perplexity"] - keyed[("halo", plr, nglr)]["perplexity"]) / gap \
                if gap > 1e-9 else float("nan")
            lines.append(f"| {nglr:.1%} | {plr:.0%} | " + " | ".join(cells) + f" | {closed:.0%} |")
    return lines


if __name__ == "__main__":
    sys.exit(run_script(main))
