"""Datasets for halo's offline tasks, read from files (paths relative to this package, or given by
the user through lm-eval's --metadata) instead of the Hugging Face hub."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; for the ARC/GSM8K templates pass its path with "
                                "--metadata '{\"data_path\": \"/path/to/test.jsonl\"}'")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
    return rows


def _dataset(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def tinystories_ppl(**_):
    return _dataset(_rows(DATA / "tinystories_ppl.jsonl"))


def tinystories_cloze(**_):
    return _dataset(_rows(DATA / "tinystories_cloze.jsonl"))


def arc(data_path: str | None = None, **_):
    """ARC in either public JSONL format: the hub's {question, choices: {text, label}, answerKey} or the
    original {question: {stem, choices: [{text, label}]}, answerKey}."""
    if not data_path:
        raise ValueError("the ARC templates read a local file: --metadata '{\"data_path\": \"ARC-Easy-Test.jsonl\"}'")
    rows = []
    for r in _rows(Path(data_path).expanduser()):
        q = r["question"]
        if isinstance(q, dict):
            text, choices = q["stem"], q["choices"]
            labels, texts = [c["label"] for c in choices], [c["text"] for c in choices]
        else:
            text, labels, texts = q, list(r["choices"]["label"]), list(r["choices"]["text"])
        if r["answerKey"] not in labels:
            raise ValueError(f"{data_path}: answerKey {r['answerKey']!r} of {r.get('id')} is not among {labels}")
        rows.append({"id": r.get("id", ""), "question": text, "choices": texts, "label": labels.index(r["answerKey"])})
    return _dataset(rows)


def gsm8k(data_path: str | None = None, **_):
    """GSM8K's public JSONL: {question, answer} with the final answer after '#### '."""
    if not data_path:
        raise ValueError("the GSM8K template reads a local file: --metadata '{\"data_path\": \"gsm8k_test.jsonl\"}'")
    rows = _rows(Path(data_path).expanduser())
    for r in rows:
        if "question" not in r or "####" not in r.get("answer", ""):
            raise ValueError(f"{data_path}: GSM8K rows need 'question' and an 'answer' ending in '#### N'")
    return _dataset([{"question": r["question"], "answer": r["answer"]} for r in rows])
