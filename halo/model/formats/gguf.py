"""GGUF files (llama.cpp, Ollama, LM Studio): Llama-architecture models, memory-mapped and validated.

Layout (little-endian): magic "GGUF", version (2 or 3), tensor count, metadata count; metadata as
key, value type, value; tensor infos as name, dimensions (fastest first), ggml type, offset; then the
tensor data from the next `general.alignment` boundary. Type names, block geometry and value types
come from the `gguf` package (llama.cpp's own Python library). Its `GGUFReader` is not used to open
files: it builds a numpy view per metadata element, which takes 7-23 s for the 98k tokenizer strings
of SmolLM2 on a 2-core machine, against 0.3 s for the parser below.

Weights stay in the file's format: F32 tensors are zero-copy views, F16/BF16 convert to float32,
block types become `QuantizedMatrix` views (halo/model/quant.py). llama.cpp stores W_q and W_k rows of
every head in the interleaved rotary order; they are re-ordered (lazily: a row selection) to the
rotate-half order halo and Hugging Face use, as transformers does when it loads a GGUF.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from halo.errors import ConfigError, ModelFormatError
from halo.model.config import ModelConfig
from halo.model.formats import layers_past
from halo.model.formats.llama2c import interleaved_to_half_rope, permute_heads
from halo.model.quant import KERNEL_CODECS, QuantizedMatrix, codec_for
from halo.model.weights import LayerWeights, ModelWeights

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
FLOAT_TYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
# metadata value types (GGUFValueType) -> struct format; 8 = string, 9 = array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
SPECIAL_TOKEN_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                      "tokenizer.ggml.eom_token_id")
MAX_ARRAY_NESTING = 16  # arrays of arrays: real files nest at most once (e.g. per-layer lists)
LAYER_TENSORS = {  # halo's name -> GGUF's, with the shape as a function of the config
    "attn_norm": ("attn_norm", lambda c: (c.dim,)), "wq": ("attn_q", lambda c: (c.q_dim, c.dim)),
    "wk": ("attn_k", lambda c: (c.kv_dim, c.dim)), "wv": ("attn_v", lambda c: (c.kv_dim, c.dim)),
    "wo": ("attn_output", lambda c: (c.dim, c.q_dim)), "mlp_norm": ("ffn_norm", lambda c: (c.dim,)),
    "w_gate": ("ffn_gate", lambda c: (c.hidden_dim, c.dim)), "w_up": ("ffn_up", lambda c: (c.hidden_dim, c.dim)),
    "w_down": ("ffn_down", lambda c: (c.dim, c.hidden_dim)),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first): GGUF's dimensions reversed
    type_name: str
    offset: int  # from the start of the file
    nbytes: int


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace")  # a vocabulary piece may hold a partial character


class StringArray(Sequence):
    """An array of strings in the header (a vocabulary, its merges), decoded when read: held as Python strings,
    SmolLM2's 98k of them cost ~10 MB for as long as the model is loaded, though only the tokenizer reads them,
    once. `GGUFFile.get(key, list)` decodes them all."""

    def __init__(self, buffer, starts: np.ndarray):
        """starts: where each string's bytes begin, and one more: the next string's start, 8 length bytes later."""
        self._buffer, self._starts = buffer, starts

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices count from the end; out of range: IndexError
        return _text(bytes(self._buffer[int(self._starts[i]):int(self._starts[i + 1]) - 8]))

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


class GGUFFile:
    """A parsed GGUF header over a read-only memory map of the file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(self.path, "no such GGUF file")
        self.size = os.path.getsize(self.path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)
        self._buffer = memoryview(self._map) if self.size else b""
        self._at = 0
        magic = self._bytes(4, "the magic number")
        if magic != MAGIC:
            raise ModelFormatError(self.path, f"not a GGUF file: it starts with {magic!r}, not {MAGIC!r}",
                                   "pass a .gguf model, a llama2.c .bin checkpoint or a Hugging Face directory")
        self.version = self._scalar("I", "the version")
        if self.version not in SUPPORTED_VERSIONS:
            raise ModelFormatError(self.path, f"GGUF version {self.version} is not supported (halo reads versions "
                                   f"{', '.join(map(str, SUPPORTED_VERSIONS))})", "convert it with a current llama.cpp")
        n_tensors = self._scalar("Q", "the tensor count")
        n_metadata = self._scalar("Q", "the metadata count")
        if n_tensors > self.size or n_metadata > self.size:
            raise ModelFormatError(self.path, f"header counts ({n_tensors} tensors, {n_metadata} metadata entries) "
                                   f"cannot fit in {self.size} bytes: corrupted header")
        self.metadata: dict[str, object] = {}
        for _ in range(n_metadata):
            key = self._string("a metadata key")
            self.metadata[key] = self._value(self._scalar("I", f"the type of {key}"), key)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFormatError(self.path, f"general.alignment={alignment!r} is not a power of two")
        self.data_start = -(-self._at // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_name, offset, nbytes in infos:
            start = self.data_start + offset
            if start + nbytes > self.size:
                raise ModelFormatError(self.path, f"truncated: tensor {name} ({type_name}, {nbytes} bytes at byte "
                                       f"{start}) ends past the end of the file ({self.size} bytes)",
                                       "re-download the file")
            if name in self.tensors:
                raise ModelFormatError(self.path, f"tensor {name} appears twice")
            self.tensors[name] = TensorInfo(name, shape, type_name, start, nbytes)

    # --- header parsing -------------------------------------------------------------------------
    def _skip(self, n: int, what: str) -> int:
        """Step over n bytes of the header; returns where they start."""
        if self._at + n > self.size:
            raise ModelFormatError(self.path, f"truncated: the header ends inside {what} (byte {self._at} of "
                                   f"{self.size})", "re-download the file")
        self._at += n
        return self._at - n

    def _bytes(self, n: int, what: str) -> bytes:
        start = self._skip(n, what)
        return bytes(self._buffer[start:start + n])

    def _scalar(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self._bytes(size, what))[0]

    def _string(self, what: str) -> str:
        return _text(self._bytes(self._scalar("Q", what), what))

    def _string_array(self, count: int, key: str) -> "StringArray":
        if count > (self.size - self._at) // 8:  # each string has at least its 8-byte length
            raise ModelFormatError(self.path, f"truncated: metadata {key} claims {count} strings, more than the "
                                   f"{self.size - self._at} bytes left can hold", "re-download the file")
        starts = np.empty(count + 1, np.int64)  # string i is bytes starts[i] .. starts[i + 1] - 8 (a length comes between)
        for i in range(count):
            starts[i] = self._skip(self._scalar("Q", key), key)
        starts[count] = self._at + 8
        return StringArray(self._buffer, starts)

    def _value(self, kind: int, key: str, depth: int = 0):
        if depth > MAX_ARRAY_NESTING:
            raise ModelFormatError(self.path, f"metadata {key}: arrays nested more than {MAX_ARRAY_NESTING} deep "
                                   "(corrupted header?)")
        if kind in SCALARS:
            return self._scalar(SCALARS[kind], key)
        if kind == STRING:
            return self._string(key)
        if kind == ARRAY:
            item, count = self._scalar("I", key), self._scalar("Q", key)
            if item == STRING:
                return self._string_array(count, key)
            if item in SCALARS:
                dtype = np.dtype("<" + SCALARS[item])
                raw = self._bytes(count * dtype.itemsize, key)
                return np.frombuffer(raw, dtype=dtype)
            if item == ARRAY:
                return [self._value(ARRAY, key, depth + 1) for _ in range(count)]
        raise ModelFormatError(self.path, f"metadata {key}: unknown value type {kind} (corrupted header?)")

    def _tensor_info(self):
        import gguf

        name = self._string("a tensor name")
        n_dims = self._scalar("I", f"tensor {name}")
        if not 0 < n_dims <= 4:
            raise ModelFormatError(self.path, f"tensor {name}: {n_dims} dimensions (corrupted header?)")
        dims = [self._scalar("Q", f"tensor {name}") for _ in range(n_dims)]
        type_id = self._scalar("I", f"tensor {name}")
        offset = self._scalar("Q", f"tensor {name}")
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelFormatError(self.path, f"tensor {name}: unknown ggml type {type_id}",
                                   "the file may need a newer halo or be corrupted") from None
        if dims[0] % block:
            raise ModelFormatError(self.path, f"tensor {name}: its rows ({dims[0]} values) are not whole "
                                   f"{qtype.name} blocks of {block}")
        nbytes = math.prod(dims) // block * type_size  # Python ints: corrupted dimensions cannot overflow
        return name, tuple(reversed(dims)), qtype.name, offset, nbytes

    # --- access ---------------------------------------------------------------------------------
    def get(self, key: str, kind=int, default=None, required: bool = True):
        """A metadata value, checked to be of `kind` (missing: default, or an error when required)."""
        value = self.metadata.get(key, default)
        if value is None:
            if required:
                raise ModelFormatError(self.path, f"metadata key {key} is missing")
            return None
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return int(value)
        if kind is list and isinstance(value, StringArray):
            return list(value)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:  # (True is an int to Python)
            raise ModelFormatError(self.path, f"metadata {key}={value!r} is not a {kind.__name__}")
        return value

    def tensor(self, name: str, shape: tuple[int, ...]):
        """A tensor as float32 (F32: a view of the file; F16/BF16: converted) or as a QuantizedMatrix (blocks)."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(self.path, f"tensor {name} is missing")
        if info.shape != shape:
            raise ModelFormatError(self.path, f"tensor {name}: expected shape {shape}, found {info.shape}")
        raw = self._map[info.offset:info.offset + info.nbytes]
        if info.type_name in FLOAT_TYPES:
            stored = raw.view(FLOAT_TYPES[info.type_name]).reshape(shape)
            if info.type_name == "BF16":
                return (np.array(stored, dtype=np.uint32) << 16).view(np.float32)
            return stored if info.type_name == "F32" else np.array(stored, dtype=np.float32)
        if len(shape) != 2:
            raise ModelFormatError(self.path, f"tensor {name}: a {info.type_name} vector; halo expects F32 norms")
        codec = codec_for(info.type_name)
        return QuantizedMatrix(codec, raw.reshape(shape[0], shape[1] // codec.block, codec.type_size), name=name)


def read_config(path: str | os.PathLike, file: GGUFFile | None = None) -> ModelConfig:
    file = file or GGUFFile(path)
    arch = file.get("general.architecture", str)
    if arch != "llama":
        raise ModelFormatError(file.path, f"unsupported architecture {arch!r}",
                               "halo runs Llama-architecture GGUF files (general.architecture = llama)")
    dim = file.get("llama.embedding_length")
    heads = file.get("llama.attention.head_count")
    head_dim = file.get("llama.attention.key_length", default=dim // heads if heads else 0)
    rotary = file.get("llama.rope.dimension_count", default=head_dim)
    if rotary != head_dim:
        raise ModelFormatError(file.path, f"llama.rope.dimension_count={rotary} but the heads are {head_dim} wide: "
                               "partial rotary embeddings are not supported")
    scaling = file.get("llama.rope.scaling.type", str, default="none")
    if scaling not in ("none", "") or "rope_freqs.weight" in file.tensors:
        raise ModelFormatError(file.path, f"rope scaling ({scaling if scaling != 'none' else 'rope_freqs.weight'}) "
                               "is not supported in GGUF files yet", "use the Hugging Face directory of the model")
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelFormatError(file.path, "tensor token_embd.weight is missing")
    vocab = file.get("llama.vocab_size", default=embedding.shape[0])
    special = {key: file.get(key, default=None, required=False) for key in SPECIAL_TOKEN_KEYS}
    for key, token in special.items():  # a BOS outside the embedding would fail only once generation starts
        if token is not None and not 0 <= token < vocab:
            raise ModelFormatError(file.path, f"{key}={token} is outside the vocabulary (0..{vocab - 1})")
    try:
        return _model_config(file, dim, heads, head_dim, vocab, special)
    except ConfigError as e:  # shapes the metadata states but a model cannot have (e.g. heads not a multiple of kv)
        raise ModelFormatError(file.path, str(e)) from None


def _model_config(file: GGUFFile, dim: int, heads: int, head_dim: int, vocab: int, special: dict) -> ModelConfig:
    eos = [special[key] for key in SPECIAL_TOKEN_KEYS[1:]]
    return ModelConfig(
        dim=dim, hidden_dim=file.get("llama.feed_forward_length"), n_layers=file.get("llama.block_count"),
        n_heads=heads, n_kv_heads=file.get("llama.attention.head_count_kv", default=heads), vocab_size=vocab,
        max_seq_len=file.get("llama.context_length", default=2048), head_dim=head_dim,
        norm_eps=file.get("llama.attention.layer_norm_rms_epsilon", float, 1e-5),
        rope_theta=file.get("llama.rope.freq_base", float, 10000.0),
        tied_embeddings="output.weight" not in file.tensors,
        bos_id=special["tokenizer.ggml.bos_token_id"],
        eos_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
    )


def read_checkpoint(path: str | os.PathLike) -> ModelWeights:
    file = GGUFFile(path)
    c = read_config(path, file)
    _check_tensor_types(file)

    def layer(i: int) -> LayerWeights:
        tensors = {name: file.tensor(f"blk.{i}.{gguf_name}.weight", shape(c))
                   for name, (gguf_name, shape) in LAYER_TENSORS.items()}
        tensors["wq"] = rotate_half(tensors["wq"], c.n_heads, c.head_dim)
        tensors["wk"] = rotate_half(tensors["wk"], c.n_kv_heads, c.head_dim)
        return LayerWeights(**tensors)

    embeddings = file.tensor("token_embd.weight", (c.vocab_size, c.dim))
    head = embeddings if c.tied_embeddings else file.tensor("output.weight", (c.vocab_size, c.dim))
    if past := layers_past(file.tensors, "blk.", c.n_layers):
        raise ModelFormatError(file.path, f"it stores layers {past[:4]} past llama.block_count={c.n_layers}: the metadata"
                               " and the tensors disagree (a damaged or mis-converted file)")
    final_norm = file.tensor("output_norm.weight", (c.dim,))
    if not np.isfinite(final_norm).all():
        raise ModelFormatError(file.path, "output_norm.weight holds NaN/inf: the file is corrupted")
    weights = ModelWeights(config=c, tok_embeddings=embeddings, layers=[layer(i) for i in range(c.n_layers)],
                           final_norm=final_norm, lm_head=head, source=str(file.path), extra={"gguf_file": file})
    weights.validate()
    return weights


def _check_tensor_types(file: GGUFFile) -> None:
    """Every tensor must be a type halo can compute with: floats, kernel blocks (halo/model/quant.py), or a block
    type the gguf package dequantizes (for the fp32/int8 formats); anything else is named."""
    import gguf.quants

    usable = set(FLOAT_TYPES) | set(KERNEL_CODECS)
    for info in file.tensors.values():
        if info.type_name in usable:
            continue
        try:
            gguf.quants.dequantize(np.zeros(codec_for(info.type_name).type_size, np.uint8),
                                   gguf.GGMLQuantizationType[info.type_name])
            usable.add(info.type_name)
        except (NotImplementedError, KeyError, ValueError, TypeError):
            raise ModelFormatError(file.path, f"unsupported type {info.type_name} in tensor {info.name}",
                                   "halo reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and the block types the "
                                   "gguf package dequantizes; re-quantize the file to one of those") from None


def rotate_half(w, n_heads: int, head_dim: int):
    """W_q/W_k from llama.cpp's interleaved rotary order (pairs of adjacent rows per head) to rotate-half
    order; for blocks this is a lazy row selection (rows are whole quantized rows)."""
    perm = interleaved_to_half_rope(head_dim)
    if isinstance(w, QuantizedMatrix):
        return w.take_rows((np.arange(n_heads)[:, None] * head_dim + perm[None, :]).ravel())
    return permute_heads(w, n_heads, perm)


