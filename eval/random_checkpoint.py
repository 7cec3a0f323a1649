"""Write a Llama-shaped Hugging Face checkpoint with random weights, streaming tensor by tensor.

Used by speed benchmarks: real checkpoints cannot be downloaded here, and speed does not depend on
the values. Memory stays at one tensor at a time, so a 4 GB checkpoint needs no 4 GB of RAM.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

TINYLLAMA_1_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False)
LLAMA_3_1_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    rope_theta=500000.0, tie_word_embeddings=False)
SHAPES = {"tinyllama-1.1b": TINYLLAMA_1_1B, "llama-3.1-8b": LLAMA_3_1_8B}


def llama_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    d, h, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim", d // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (q, d),
                       p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.v_proj.weight": (kv, d),
                       p + "self_attn.o_proj.weight": (d, q), p + "post_attention_layernorm.weight": (d,),
                       p + "mlp.gate_proj.weight": (h, d), p + "mlp.up_proj.weight": (h, d),
                       p + "mlp.down_proj.weight": (d, h)})
    shapes["model.norm.weight"] = (d,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, d)
    return shapes


def write_random_llama(directory: str | Path, cfg: dict, seed: int = 0, std: float = 0.02) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": 2, **cfg}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    shapes = llama_tensor_shapes(cfg)
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for shape in shapes.values():
            if len(shape) == 1:
                np.ones(shape, dtype=np.float32).tofile(f)
            else:
                for start in range(0, shape[0], 1024):  # row chunks keep memory flat
                    rows = min(1024, shape[0] - start)
                    (rng.standard_normal((rows, shape[1]), dtype=np.float32) * std).tofile(f)
    return directory


def write_random_predictors(directory: str | Path, hidden: int = 64, seed: int = 0, out: str | Path | None = None) -> Path:
    """Untrained predictors (random weights, the real ONNX format and manifest) for a random checkpoint in
    `directory` (or a model file: then give `out`): HALO mode runs on them exactly as on trained ones (speed
    benchmarks; rankings are noise). Written to out, default directory/predictors."""
    from halo.compute.neuron_groups import GroupLayout
    from halo.model.loader import load_config, model_fingerprint
    from halo.predictors.export import export
    from halo.predictors.trainer import LayerPredictor

    directory = Path(directory)
    config = load_config(directory)
    layout = GroupLayout.for_model(config)
    rng = np.random.default_rng(seed)
    outputs = layout.n_heads + layout.n_mlp_groups
    layers = [LayerPredictor(l, np.zeros(config.dim, np.float32), np.ones(config.dim, np.float32),
                             rng.standard_normal((hidden, config.dim)).astype(np.float32) / np.sqrt(config.dim),
                             np.zeros(hidden, np.float32), rng.standard_normal((outputs, hidden)).astype(np.float32),
                             np.zeros(outputs, np.float32), layout.n_heads, layout.n_mlp_groups)
              for l in range(1, config.n_layers)]
    meta = {"model": str(directory), "model_sha256": model_fingerprint(directory), "n_layers": config.n_layers,
            "dim": config.dim, "n_heads": layout.n_heads, "n_mlp_groups": layout.n_mlp_groups,
            "mlp_group_size": layout.mlp_group_size, "text": "none (random, untrained)", "train_fraction": 0.0,
            "window": 0, "max_chars": 0, "tokens": 0}
    return export(layers, Path(out) if out else directory / "predictors", meta, {"untrained": True, "seed": seed})


GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}
GGUF_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # llama.cpp's general.file_type


def gguf_tensor_name(hf_name: str) -> str:
    """model.layers.3.mlp.down_proj.weight -> blk.3.ffn_down.weight (llama.cpp's names)."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest.removesuffix('.weight')]}.weight"


def to_llama_cpp_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rotate-half W_q/W_k rows -> llama.cpp's interleaved order (what its converter writes)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: str | Path, cfg: dict, tensors, qtype: str = "Q4_0", embedding_qtype: str | None = None,
                     vocab: int | None = None) -> Path:
    """Write a Llama GGUF as llama.cpp's converter does: `tensors` yields (Hugging Face name, float32 array)
    in llama_tensor_shapes order (a generator keeps memory at one tensor); matrices are stored as `qtype`
    (F32, F16, Q4_0, Q4_1, Q8_0), the embedding as `embedding_qtype` (default: qtype), norms as F32. A
    byte-level tokenizer (256 byte tokens, <s>, </s>, one merge, filler) fills the vocabulary: llama.cpp loads the
    file too (llama-bench, its RPC backend: the same blocks side by side)."""
    import gguf
    import gguf.quants

    path = Path(path)
    vocab = vocab or cfg["vocab_size"]
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("halo random llama")
    writer.add_file_type(GGUF_FILE_TYPES[qtype])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg.get("head_dim", d // heads))
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(vocab)
    specials = ["<s>", "</s>"]
    alphabet = [chr(c) for c in sorted(_byte_alphabet())]
    # one merge ("~ ~" -> "~~") where the vocabulary has room: llama.cpp refuses a BPE vocabulary without merges,
    # and GGUF drops an empty array
    merged = ["~~"] if vocab > len(specials) + len(alphabet) else []
    tokens = specials + alphabet + merged
    tokens += [f"<filler_{i}>" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (vocab - 2))
    writer.add_token_merges([" ".join(m) for m in merged])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    shapes = llama_tensor_shapes(cfg)

    def stored(name: str, shape: tuple[int, ...]) -> str:
        if len(shape) == 1:
            return "F32"
        return embedding_qtype or qtype if name == "model.embed_tokens.weight" else qtype

    for name, shape in shapes.items():
        kind = gguf.GGMLQuantizationType[stored(name, shape)]
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        elements = int(np.prod(shape))
        byte_shape = (*shape[:-1], shape[-1] // block * type_size)
        writer.add_tensor_info(gguf_tensor_name(name), byte_shape if block > 1 else shape,
                               np.dtype(np.uint8) if block > 1 else np.dtype(np.float16 if kind.name == "F16" else np.float32),
                               elements // block * type_size, raw_dtype=kind if block > 1 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, array in tensors:
        if isinstance(array, RowChunks):  # written a run of rows at a time: memory stays at one run
            kind = gguf.GGMLQuantizationType[stored(name, array.shape)]
            writer.write_tensor_data(_Streamed(array, kind))
            continue
        array = np.asarray(array, dtype=np.float32)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            array = to_llama_cpp_rope(array, heads if "q_proj" in name else kv_heads)
        kind = gguf.GGMLQuantizationType[stored(name, array.shape)]
        if kind.name in ("F32", "F16"):
            writer.write_tensor_data(array.astype(np.float16 if kind.name == "F16" else np.float32))
        else:
            writer.write_tensor_data(gguf.quants.quantize(array, kind))
    writer.close()
    return path


class RowChunks:
    """A random matrix generated a run of rows at a time (a 128k x 4096 LM head is 2.1 GB as float32)."""

    ROWS = 1024

    def __init__(self, shape: tuple[int, ...], rng: np.random.Generator, std: float):
        self.shape, self.rng, self.std = shape, rng, std

    def __iter__(self):
        if len(self.shape) == 1:
            yield np.ones(self.shape, np.float32)
            return
        for start in range(0, self.shape[0], self.ROWS):
            rows = min(self.ROWS, self.shape[0] - start)
            yield self.rng.standard_normal((rows, *self.shape[1:]), dtype=np.float32) * self.std


class _Streamed:
    """What gguf's writer needs of a tensor (nbytes, tofile) for RowChunks quantized run by run: quantized blocks
    lie row after row, so runs of rows written in turn are the whole tensor's bytes."""

    def __init__(self, chunks: RowChunks, kind):
        import gguf

        self.chunks, self.kind = chunks, kind
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        self.nbytes = int(np.prod(chunks.shape)) // block * type_size

    def tofile(self, fout) -> None:
        import gguf.quants

        for rows in self.chunks:
            data = rows if self.kind.name == "F32" else rows.astype(np.float16) if self.kind.name == "F16" \
                else gguf.quants.quantize(rows, self.kind)
            data.tofile(fout)


def streamed_random_tensors(cfg: dict, seed: int = 0, std: float = 0.02):
    """(name, RowChunks) for every tensor of a random Llama: write_llama_gguf writes them a run of rows at a time.
    Random rows need no rotary reordering (the file's rows are the weights)."""
    rng = np.random.default_rng(seed)
    for name, shape in llama_tensor_shapes(cfg).items():
        yield name, RowChunks(shape, rng, std)


def random_tensors(cfg: dict, seed: int = 0, std: float = 0.02):
    """(name, float32 array) for every tensor of a random Llama in llama_tensor_shapes order."""
    rng = np.random.default_rng(seed)
    for name, shape in llama_tensor_shapes(cfg).items():
        yield name, (np.ones(shape, np.float32) if len(shape) == 1
                     else rng.standard_normal(shape, dtype=np.float32) * std)


def write_random_gguf(path: str | Path, cfg: dict, qtype: str = "Q4_0", seed: int = 0, streamed: bool = False) -> Path:
    """A random Llama-shaped GGUF (e.g. TinyLlama-1.1B in Q4_0) for speed benchmarks of the 4-bit kernels.
    streamed: generated and written a run of rows at a time (the Llama-3.1-8B shape in < 1 GB of memory)."""
    tensors = streamed_random_tensors(cfg, seed) if streamed else random_tensors(cfg, seed)
    return write_llama_gguf(path, cfg, tensors, qtype)


def main(argv: list[str] | None = None) -> int:
    """python -m halo.eval.random_checkpoint --shape llama-3.1-8b --qtype Q4_0 --out PATH"""
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Write a random Llama-shaped GGUF, a run of rows at a time.")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--qtype", choices=tuple(GGUF_FILE_TYPES), default="Q4_0")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cfg = dict(SHAPES[args.shape])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    t = time.perf_counter()
    path = write_random_gguf(args.out, cfg, args.qtype, streamed=True)
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s")
    return 0



def _byte_alphabet() -> set[int]:
    """GPT-2's printable stand-ins for the 256 byte values (the byte-level BPE alphabet)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    codes, extra = set(printable), 0
    for b in range(256):
        if b not in printable:
            codes.add(256 + extra)
            extra += 1
    return codes


if __name__ == "__main__":
    from halo.eval.report import run_script

    sys.exit(run_script(main))
