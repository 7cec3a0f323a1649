"""Small GGUF files for tests, written as llama.cpp's converter writes them (test helper)."""

from __future__ import annotations

from pathlib import Path

from halo.eval.random_checkpoint import gguf_tensor_name, llama_tensor_shapes, random_tensors, write_llama_gguf

# head_dim 32 and MLP groups of 32 (the default for intermediate 256): every neuron group is whole blocks
TINY = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True)


def tiny_gguf(path: Path, qtype: str = "Q4_0", seed: int = 0, **overrides) -> Path:
    cfg = dict(TINY, **overrides)
    return write_llama_gguf(path, cfg, random_tensors(cfg, seed, std=0.1), qtype)


def gguf_from_hf(path: Path, reference, qtype: str = "F32") -> Path:
    """The weights of a transformers LlamaForCausalLM written as a GGUF file."""
    c = reference.config
    cfg = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
               num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
               vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
               rope_theta=getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"],
               tie_word_embeddings=c.tie_word_embeddings)
    state = {k: v.detach().float().numpy() for k, v in reference.state_dict().items()}
    return write_llama_gguf(path, cfg, ((name, state[name]) for name in llama_tensor_shapes(cfg)), qtype)


def raw_gguf(path: Path, types: dict[str, str] | None = None, arch: str = "llama", tokenizer=True,
             skip: tuple[str, ...] = (), vocab_size: int | None = None, block_count: int | bool | None = None) -> Path:
    """A TINY-shaped GGUF of zero weights with chosen tensor types (GGUF names -> type; quantized tensors are
    zero blocks, any type), another architecture, no tokenizer, or tensors left out. `tokenizer` may be a
    function(writer) that writes the tokenizer metadata; block_count: the metadata's (a bool: stored as one) over
    TINY's layers."""
    import gguf
    import numpy as np

    types = types or {}
    writer = gguf.GGUFWriter(str(path), arch)
    t = dict(TINY, vocab_size=vocab_size or TINY["vocab_size"])
    if isinstance(block_count, bool):
        writer.add_bool(f"{arch}.block_count", block_count)
    else:
        writer.add_block_count(t["num_hidden_layers"] if block_count is None else block_count)
    writer.add_context_length(t["max_position_embeddings"])
    writer.add_embedding_length(t["hidden_size"])
    writer.add_feed_forward_length(t["intermediate_size"])
    writer.add_head_count(t["num_attention_heads"])
    writer.add_head_count_kv(t["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(t["rms_norm_eps"])
    if callable(tokenizer):
        tokenizer(writer)
    elif tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([chr(0x100 + i) for i in range(t["vocab_size"])])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
    for hf_name, shape in llama_tensor_shapes(t).items():
        name = gguf_tensor_name(hf_name)
        if name in skip:
            continue
        kind = gguf.GGMLQuantizationType[types.get(name, "F32")]
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        if kind.name == "F32":
            writer.add_tensor(name, np.ones(shape, np.float32) if len(shape) == 1 else np.zeros(shape, np.float32))
        else:
            raw = np.zeros((*shape[:-1], shape[-1] // block * type_size), np.uint8)
            writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
