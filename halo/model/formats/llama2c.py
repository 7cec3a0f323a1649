"""llama2.c files: the legacy (version 0) float32 checkpoint and the tokenizer.bin format.

Checkpoint layout (little-endian): seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
vocab_size, seq_len; a negative vocab_size means the classifier is stored separately), then
float32 arrays: token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, two RoPE
tables (seq_len * head_size / 2 each, ignored here), and the classifier when not shared.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from halo.errors import ConfigError, ModelFormatError
from halo.model.config import ModelConfig
from halo.model.weights import LayerWeights, ModelWeights

HEADER = struct.Struct("<7i")
EXPORT_MAGIC = 0x616B3432  # "ak42": llama2.c's versioned export (v1/v2), not the legacy format
MAX_DIM = 1 << 20


def read_config(path: Path) -> tuple[ModelConfig, int]:
    """Read and check the header; returns the config and the classifier-is-separate flag."""
    size = os.path.getsize(path)
    if size < HEADER.size:
        raise ModelFormatError(path, f"truncated: {size} bytes is shorter than the {HEADER.size}-byte llama2.c header")
    with open(path, "rb") as f:
        fields = HEADER.unpack(f.read(HEADER.size))
    if fields[0] == EXPORT_MAGIC:
        raise ModelFormatError(path, "this is a llama2.c versioned export (magic 'ak42')",
                               "export it with llama2.c's legacy format: export.py --version 0")
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = fields
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "|vocab_size|", "seq_len")
    for name, value in zip(names, (dim, hidden, n_layers, n_heads, n_kv, abs(vocab), seq_len)):
        if not 0 < value <= MAX_DIM:
            raise ModelFormatError(path, f"header field {name}={value} is out of range (1..{MAX_DIM}); "
                                   "not a llama2.c checkpoint or a corrupted header")
    if dim % n_heads:
        raise ModelFormatError(path, f"header: dim={dim} is not divisible by n_heads={n_heads}")
    if n_heads % n_kv:
        raise ModelFormatError(path, f"header: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv}")
    try:
        # a story ends at EOS (2) or, as llama2.c's run.c stops, at the BOS (1) that begins the next: TinyStories
        # models write one after each story (stories260K's greedy text starts a second story at token 345)
        config = ModelConfig(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
                             vocab_size=abs(vocab), max_seq_len=seq_len, tied_embeddings=vocab > 0, eos_ids=(2, 1))
    except ConfigError as e:
        raise ModelFormatError(path, f"header: {e}") from None
    return config, vocab < 0


def read_checkpoint(path: str | os.PathLike) -> ModelWeights:
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(path, "no such model file", "pass --model PATH to a llama2.c .bin or a Hugging Face directory")
    config, separate_head = read_config(path)
    c = config
    hd, L = c.head_dim, c.n_layers
    shapes = [
        ("tok_embeddings", (c.vocab_size, c.dim)),
        ("rms_att", (L, c.dim)),
        ("wq", (L, c.q_dim, c.dim)),
        ("wk", (L, c.kv_dim, c.dim)),
        ("wv", (L, c.kv_dim, c.dim)),
        ("wo", (L, c.dim, c.q_dim)),
        ("rms_ffn", (L, c.dim)),
        ("w1", (L, c.hidden_dim, c.dim)),
        ("w2", (L, c.dim, c.hidden_dim)),
        ("w3", (L, c.hidden_dim, c.dim)),
        ("rms_final", (c.dim,)),
        ("freq_cis", (c.max_seq_len * hd,)),  # cos and sin tables, skipped
    ]
    if separate_head:
        shapes.append(("wcls", (c.vocab_size, c.dim)))
    n_floats = sum(int(np.prod(s)) for _, s in shapes)
    expected = HEADER.size + 4 * n_floats
    size = os.path.getsize(path)
    if size < expected:
        raise ModelFormatError(path, f"truncated: the header describes {expected} bytes of weights, the file has {size}",
                               "re-download or re-export the checkpoint")
    if size > expected:
        raise ModelFormatError(path, f"{size - expected} unexpected trailing bytes after {expected} bytes of weights",
                               "the header does not match the data; is this a llama2.c legacy checkpoint?")
    flat = np.memmap(path, dtype="<f4", mode="r", offset=HEADER.size, shape=(n_floats,))
    tensors, offset = {}, 0
    for name, shape in shapes:
        count = int(np.prod(shape))
        tensors[name] = flat[offset:offset + count].reshape(shape)
        offset += count
    if not np.isfinite(tensors["rms_final"]).all():
        raise ModelFormatError(path, "rms_final holds NaN/inf: the file is corrupted")

    perm = interleaved_to_half_rope(hd)
    layers = []
    for i in range(L):
        layers.append(LayerWeights(
            attn_norm=tensors["rms_att"][i],
            wq=permute_heads(tensors["wq"][i], c.n_heads, perm),
            wk=permute_heads(tensors["wk"][i], c.n_kv_heads, perm),
            wv=tensors["wv"][i],
            wo=tensors["wo"][i],
            mlp_norm=tensors["rms_ffn"][i],
            w_gate=tensors["w1"][i],
            w_up=tensors["w3"][i],
            w_down=tensors["w2"][i],
        ))
    head = tensors["wcls"] if separate_head else tensors["tok_embeddings"]
    weights = ModelWeights(config=c, tok_embeddings=tensors["tok_embeddings"], layers=layers,
                           final_norm=tensors["rms_final"], lm_head=head, source=str(path))
    weights.validate()
    return weights


def interleaved_to_half_rope(head_dim: int) -> np.ndarray:
    """Row order that turns llama2.c's adjacent-pair rotary layout into the rotate-half layout."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def permute_heads(w: np.ndarray, n_heads: int, perm: np.ndarray) -> np.ndarray:
    """Reorder the rows of every head of a q/k projection; q.k is unchanged as both move alike."""
    head_dim = len(perm)
    return np.ascontiguousarray(w.reshape(n_heads, head_dim, -1)[:, perm, :].reshape(n_heads * head_dim, -1))


def read_tokenizer(path: str | os.PathLike, vocab_size: int) -> tuple[list[bytes], np.ndarray]:
    """Read tokenizer.bin: int32 max_token_length, then per token float32 score, int32 length, bytes."""
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(path, "no such tokenizer file", "pass --tokenizer PATH to the model's tokenizer.bin")
    data = path.read_bytes()
    if len(data) < 4:
        raise ModelFormatError(path, "truncated: shorter than the 4-byte tokenizer header")
    (max_len,) = struct.unpack_from("<i", data, 0)
    if not 0 < max_len <= 4096:
        raise ModelFormatError(path, f"max_token_length={max_len} is out of range: not a llama2.c tokenizer file")
    pieces, scores, offset = [], [], 4
    while offset < len(data):
        if offset + 8 > len(data):
            raise ModelFormatError(path, f"truncated inside the entry of token {len(pieces)} (byte {offset})")
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if not 0 <= length <= max_len or offset + length > len(data):
            raise ModelFormatError(path, f"token {len(pieces)}: length {length} at byte {offset - 4} is invalid "
                                   f"(max_token_length {max_len}, {len(data) - offset} bytes left)")
        pieces.append(data[offset:offset + length])
        scores.append(score)
        offset += length
    if len(pieces) != vocab_size:
        raise ModelFormatError(path, f"tokenizer has {len(pieces)} tokens but the model's vocabulary is {vocab_size}",
                               "use the tokenizer the model was trained with")
    return pieces, np.asarray(scores, dtype=np.float32)
