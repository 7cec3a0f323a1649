"""Write a Llama-shaped Hugging Face checkpoint with random weights, streaming tensor by tensor.

Used by speed benchmarks: real checkpoints cannot be downloaded here, and speed does not depend on
the values. Memory stays at one tensor at a time, so a 4 GB checkpoint needs no 4 GB of RAM.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

TINYLLAMA_1_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False)


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


def write_random_predictors(directory: str | Path, hidden: int = 64, seed: int = 0) -> Path:
    """Untrained predictors (random weights, the real ONNX format and manifest) for a random checkpoint in
    `directory`: HALO mode runs on them exactly as on trained ones (speed benchmarks; rankings are noise)."""
    from halo.loader import load_config, model_fingerprint
    from halo.neuron_groups import GroupLayout
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
    return export(layers, directory / "predictors", meta, {"untrained": True, "seed": seed})
