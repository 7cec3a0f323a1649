"""Find the format of a model path and load weights and tokenizer from it."""

from __future__ import annotations

import os
from pathlib import Path

from . import BUNDLED_MODEL, BUNDLED_TOKENIZER
from .errors import ModelFormatError
from .formats import hf, llama2c
from .tokenizer import HFTokenizer, Llama2cTokenizer, Tokenizer
from .weights import ModelWeights


def load_weights(path: str | os.PathLike | None = None) -> ModelWeights:
    """A Hugging Face directory (has config.json) or a llama2.c checkpoint file; None: the bundled model."""
    path = Path(path) if path is not None else Path(str(BUNDLED_MODEL))
    if path.is_dir():
        return hf.read_checkpoint(path)
    if path.is_file():
        return llama2c.read_checkpoint(path)
    raise ModelFormatError(path, "no such file or directory",
                           "pass a llama2.c .bin file or a Hugging Face directory with config.json")


def load_tokenizer(weights: ModelWeights, tokenizer_path: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer that belongs to the weights: tokenizer.json in a HF directory, else a llama2.c
    tokenizer.bin given explicitly, found beside the checkpoint (tok*.bin / tokenizer.bin), or bundled."""
    config, source = weights.config, Path(weights.source)
    if source.is_dir():
        path = Path(tokenizer_path) if tokenizer_path else source / "tokenizer.json"
        if not path.is_file():
            raise ModelFormatError(source, "no tokenizer.json in the model directory", "pass --tokenizer PATH")
        return HFTokenizer(path, config.vocab_size, config.bos_id, config.eos_ids)
    if tokenizer_path is None:
        candidates = sorted(source.parent.glob("tok*.bin")) + [Path(str(BUNDLED_TOKENIZER))]
        tokenizer_path = candidates[0]
    return Llama2cTokenizer(tokenizer_path, config.vocab_size, config.bos_id, config.eos_ids[0])


def load_config(path: str | os.PathLike | None = None):
    """Only the model's shape (no weights read): for planning."""
    path = Path(path) if path is not None else Path(str(BUNDLED_MODEL))
    if path.is_dir():
        return hf.read_config(path)
    if path.is_file():
        return llama2c.read_config(path)[0]
    raise ModelFormatError(path, "no such file or directory",
                           "pass a llama2.c .bin file or a Hugging Face directory with config.json")


def model_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over a model's bytes (a llama2.c file, or a HF directory's config, weights and tokenizer):
    what agents, masters and predictors compare to be sure they mean the same model."""
    import hashlib

    path = Path(path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.name == "config.json" or p.suffix == ".safetensors"
        or p.name in ("model.safetensors.index.json", "tokenizer.json"))
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def load_predictors(weights: ModelWeights, directory: str | os.PathLike | None = None, threads: int = 1):
    """The model's trained predictors: `directory`, else predictors/ beside the checkpoint (inside a HF
    directory). Checked against the model's sha256 so stale predictors are refused."""
    from .errors import ConfigError
    from .predictors.runtime import PredictorSet

    source = Path(weights.source)
    path = Path(directory) if directory else (source if source.is_dir() else source.parent) / "predictors"
    if not path.is_dir():
        raise ConfigError(f"{path}: no trained predictors for {source.name} (HALO mode ranks groups with them); "
                          f"train them: halo-train-predictors --model {source} --data TEXT --out {path}")
    return PredictorSet(path, model_fingerprint(source), threads)
