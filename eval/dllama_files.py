"""distributed-llama's model (.m) and tokenizer (.t) files for the peer benchmark (eval/bench_peer.py).

The model is written from the same random tensors (eval/random_checkpoint.random_tensors, same seed) as
halo's benchmark GGUF, quantized the same way: distributed-llama's Q40 block is GGUF's Q4_0 block byte for
byte (an fp16 scale, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31, value =
(nibble - 8) * scale), and both take q/k rows in the interleaved rotary order. So the peer computes with every
matrix's very Q4_0 blocks that halo does, not merely the same shape; only the embedding differs in form (the
peer's file holds it unquantized, halo's GGUF in Q4_0: a row lookup a token either way).

The layout, as distributed-llama 8d624a7 reads it (src/llm.cpp; all little-endian int32 unless said):
- model: magic 0x0A00ABCD, header size in bytes (magic and itself included), then (key, value) pairs;
  then, with no names or padding: the embedding [vocab, dim] float32; per layer wq, wk, wv, wo, w1 (gate),
  w2 (down), w3 (up) in Q40 ([out, in] row-major), the attention and feed-forward RMS norm weights float32;
  the final norm float32; the LM head [vocab, dim] Q40. The loader wants the file to end exactly there.
- tokenizer: magic 0x567124, header size, (key, value) pairs, the end-of-sequence ids, then per token a
  float32 score, a uint32 length and its bytes. Ids from bos_id up are matched as literal prefixes of the
  prompt, so a vocabulary of single printable characters (plus fillers) encodes any ASCII prompt.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

MODEL_MAGIC, TOKENIZER_MAGIC = 0x0A00ABCD, 0x567124
LLAMA, SILU, Q40 = 0xABCD00, 1, 2
# model header keys
VERSION, ARCH, DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ_LEN, ACTIVATION, ROPE_THETA, WEIGHTS, NORM_EPS = \
    0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 20
NORM_EPS_CODES = {1e-5: 5, 1e-6: 6}  # the only two it reads
LAYER_ORDER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.down_proj", "mlp.up_proj", "input_layernorm", "post_attention_layernorm")


def _header(magic: int, pairs: list[tuple[int, int]]) -> bytes:
    """magic, the header's size in bytes (magic and size included), then the (key, value) pairs."""
    body = b"".join(struct.pack("<ii", k, v) for k, v in pairs)
    return struct.pack("<ii", magic, 8 + len(body)) + body


def write_model(path: str | Path, cfg: dict, seed: int = 0, streamed: bool = False) -> Path:
    """The random Llama of `cfg` (Hugging Face config keys, eval/random_checkpoint.py) as a Q40 .m file. streamed: the
    tensors of `random_checkpoint.streamed_random_tensors` (what `python -m halo.eval.random_checkpoint` writes into a
    GGUF, the Llama-3.1-8B shape's), generated, quantized and written a run of rows at a time: memory holds one
    layer's quantized blocks (the peer's order within a layer is not the stream's), not a 2.1 GB float matrix."""
    from halo.eval.random_checkpoint import llama_tensor_shapes, random_tensors, streamed_random_tensors

    path = Path(path)
    header = model_header(cfg)
    expected = len(header) + sum(
        4 * int(np.prod(s)) if len(s) == 1 or name == "model.embed_tokens.weight" else int(np.prod(s)) // 32 * 18
        for name, s in llama_tensor_shapes(cfg).items())
    tensors = streamed_random_tensors(cfg, seed) if streamed else random_tensors(cfg, seed)
    layer: dict[str, list[bytes]] = {}
    with open(path, "wb") as f:
        f.write(header)
        for name, tensor in tensors:
            pieces = tensor_bytes(name, tensor if streamed else [tensor], cfg, rotary_order=not streamed)
            if not name.startswith("model.layers."):
                for piece in pieces:  # the embedding, the final norm, the LM head: in the stream's order already
                    f.write(piece)
                continue
            layer[name.split(".", 3)[3].rsplit(".", 1)[0]] = list(pieces)
            if len(layer) == len(LAYER_ORDER):  # a whole layer: out in the peer's order
                for part in LAYER_ORDER:
                    f.writelines(layer.pop(part))
    if path.stat().st_size != expected:
        raise RuntimeError(f"{path}: {path.stat().st_size} bytes written, the peer reads {expected}")
    return path


def model_header(cfg: dict) -> bytes:
    """The .m header of `cfg`, refusing what the peer's format cannot say."""
    eps = NORM_EPS_CODES.get(cfg["rms_norm_eps"])
    if eps is None:
        raise ValueError(f"distributed-llama reads rms_norm_eps 1e-5 or 1e-6, not {cfg['rms_norm_eps']}")
    if cfg.get("tie_word_embeddings"):
        raise ValueError("write an untied model: the peer's file always carries its own LM head")
    heads, kv_heads, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    if cfg.get("head_dim", cfg["hidden_size"] // heads) * heads != cfg["hidden_size"]:
        raise ValueError("this writer takes head_dim = hidden_size / num_attention_heads (the peer's default)")
    if cfg["rope_theta"] != int(cfg["rope_theta"]):
        raise ValueError(f"the peer's file holds rope_theta as an integer, not {cfg['rope_theta']}")
    return _header(MODEL_MAGIC, [(VERSION, 0), (ARCH, LLAMA), (DIM, cfg["hidden_size"]),
                                 (HIDDEN, cfg["intermediate_size"]), (LAYERS, layers), (HEADS, heads),
                                 (KV_HEADS, kv_heads), (VOCAB, cfg["vocab_size"]),
                                 (SEQ_LEN, cfg["max_position_embeddings"]), (ACTIVATION, SILU),
                                 (ROPE_THETA, int(cfg["rope_theta"])), (WEIGHTS, Q40), (NORM_EPS, eps)])


def tensor_bytes(name: str, runs, cfg: dict, rotary_order: bool):
    """A tensor's bytes in the peer's file, a run of rows at a time: the embedding and the norms float32, every other
    matrix Q40 (GGUF's Q4_0). rotary_order: q/k rows of Hugging Face order into the interleaved one first (whole
    tensors only; a streamed random tensor's rows are already the file's, as in its GGUF)."""
    import gguf.quants

    from halo.eval.random_checkpoint import to_llama_cpp_rope

    for rows in runs:
        if name in ("model.embed_tokens.weight", "model.norm.weight") or name.endswith("layernorm.weight"):
            yield np.ascontiguousarray(rows, "<f4").tobytes()
            continue
        if rotary_order and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            rows = to_llama_cpp_rope(rows, heads)
        yield gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q4_0).tobytes()


def write_tokenizer(path: str | Path, vocab: int) -> Path:
    """<unk>, <s> (bos, 1), </s> (eos, 2), the printable ASCII characters, then fillers <i> up to `vocab` tokens.
    The peer takes the ids below bos as its regular vocabulary and matches the rest as literal prefixes, so with bos
    at 1 every prompt character must be one of these tokens."""
    tokens = [b"<unk>", b"<s>", b"</s>"] + [bytes([c]) for c in range(0x20, 0x7F)]
    if vocab < len(tokens):
        raise ValueError(f"a vocabulary of {vocab} tokens cannot hold the {len(tokens)} this tokenizer needs")
    tokens += [f"<{i}>".encode() for i in range(len(tokens), vocab)]
    with open(path, "wb") as f:
        # version 1, vocab size, longest token, bos id, one eos id, add bos to the prompt
        f.write(_header(TOKENIZER_MAGIC, [(0, 1), (1, vocab), (2, max(map(len, tokens))), (3, 1), (9, 1), (10, 1)]))
        f.write(struct.pack("<i", 2))  # the one end-of-sequence id
        f.write(b"".join(struct.pack("<fI", 0.0, len(t)) + t for t in tokens))
    return Path(path)
