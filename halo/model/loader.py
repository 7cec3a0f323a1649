"""Find the format of a model path (or a named model: halo/model/catalog.py) and load weights and tokenizer from it."""

from __future__ import annotations

import os
from pathlib import Path

from halo import BUNDLED_MODEL, BUNDLED_TOKENIZER
from halo.errors import ModelFormatError
from halo.model.catalog import resolve_model
from halo.model.digests import cached_digest
from halo.model.formats import gguf, hf, llama2c
from halo.model.tokenizer import HFTokenizer, Llama2cTokenizer, Tokenizer, gguf_tokenizer
from halo.model.weights import ModelWeights

NOT_FOUND_FIX = ("pass a GGUF file, a llama2.c .bin file, a Hugging Face directory with config.json, or a model "
                 "name (halo-master fetch --list)")


def model_path(path: str | os.PathLike | None) -> Path:
    """The file or directory a --model value means: a path, a named model's cached file, or the bundled model."""
    return resolve_model(path) if path is not None else Path(str(BUNDLED_MODEL))


def is_gguf(path: Path) -> bool:
    """GGUF by its magic number (or its suffix, so that a damaged .gguf gets the GGUF reader's diagnosis)."""
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == gguf.MAGIC


def load_weights(path: str | os.PathLike | None = None) -> ModelWeights:
    """A GGUF file, a Hugging Face directory (has config.json), a llama2.c checkpoint file or a model name;
    None: the bundled model."""
    path = model_path(path)
    if path.is_dir():
        return hf.read_checkpoint(path)
    if path.is_file():
        return gguf.read_checkpoint(path) if is_gguf(path) else llama2c.read_checkpoint(path)
    raise not_a_model(path)


def load_tokenizer(weights: ModelWeights, tokenizer_path: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer that belongs to the weights: a GGUF file's metadata, tokenizer.json in a HF directory
    (or any tokenizer.json given), else a llama2.c tokenizer.bin given explicitly, found beside the
    checkpoint (tok*.bin / tokenizer.bin), or bundled."""
    config, source = weights.config, Path(weights.source)
    if source.is_file() and is_gguf(source) and not tokenizer_path:  # its metadata holds the tokenizer
        return gguf_tokenizer(weights.extra.get("gguf_file") or gguf.GGUFFile(source), config)
    if tokenizer_path and Path(tokenizer_path).suffix == ".json":
        return HFTokenizer(tokenizer_path, config.vocab_size, config.bos_id, config.eos_ids)
    if source.is_dir():
        path = Path(tokenizer_path) if tokenizer_path else source / "tokenizer.json"
        if not path.is_file():
            raise ModelFormatError(source, "no tokenizer.json in the model directory", "pass --tokenizer PATH")
        return HFTokenizer(path, config.vocab_size, config.bos_id, config.eos_ids)
    if tokenizer_path is None:
        candidates = sorted(source.parent.glob("tok*.bin")) + [Path(str(BUNDLED_TOKENIZER))]
        tokenizer_path = candidates[0]
    return Llama2cTokenizer(tokenizer_path, config.vocab_size, config.bos_id, config.eos_ids)


def load_config(path: str | os.PathLike | None = None):
    """Only the model's shape (no weights read): for planning."""
    path = model_path(path)
    if path.is_dir():
        return hf.read_config(path)
    if path.is_file():
        return gguf.read_config(path) if is_gguf(path) else llama2c.read_config(path)[0]
    raise not_a_model(path)


def not_a_model(path: Path) -> ModelFormatError:
    """What is at a --model path that is neither a file nor a directory (a FIFO or /dev/null read as missing)."""
    return ModelFormatError(path, "not a regular file or directory (a device, a pipe, a socket)" if path.exists()
                            else "no such file or directory", NOT_FOUND_FIX)


def model_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over a model's bytes (a llama2.c file, or a HF directory's config, weights and tokenizer):
    what agents, masters and predictors compare to be sure they mean the same model.

    Hashing reads the whole model (a 1.1B model in float32: ~4.4 GB, seconds), and masters compute it at
    every hello (a re-plan says hello again), agents at every start: so the digest is kept per file
    identity (cached_digest)."""
    import hashlib

    path = model_path(path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.name == "config.json" or p.suffix == ".safetensors"
        or p.name in ("model.safetensors.index.json", "tokenizer.json"))

    def digest() -> str:
        whole = hashlib.sha256()
        for file in files:
            whole.update(os.fsencode(file.name))  # (a name that is not UTF-8 is still bytes)
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    whole.update(block)
        return whole.hexdigest()

    return cached_digest(files, "", digest)
