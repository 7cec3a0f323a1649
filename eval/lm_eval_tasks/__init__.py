"""halo's offline lm-eval tasks: TinyStories perplexity and cloze (bundled data), and ARC-Easy,
ARC-Challenge and GSM8K templates that read a local JSONL file (no hub access)."""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
