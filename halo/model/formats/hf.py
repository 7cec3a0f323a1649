"""Hugging Face Llama-family directories: config.json, model.safetensors (or sharded), tokenizer.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

from halo.arguments import check_integer, check_number
from halo.errors import ConfigError, ModelFormatError
from halo.model.config import Llama3RopeScaling, ModelConfig
from halo.model.formats import layers_past
from halo.model.formats.safetensors_file import SafetensorsFile
from halo.model.weights import LayerWeights, ModelWeights

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM"}


def _field(config: dict, path: Path, name: str, kind=int, default=None):
    """A positive integer (kind=int) or positive finite number (kind=float) field of config.json (null: the
    default, as transformers reads it)."""
    value = config.get(name)
    value = default if value is None else value
    if value is None:
        raise ModelFormatError(path, f"config.json lacks the required field '{name}'")
    try:
        return check_integer(value, "", 1) if kind is int else check_number(value, "", 0, low_open=True)
    except ConfigError as e:
        raise ModelFormatError(path, f"config.json field '{name}'={value!r:.80}: {e}") from None


def _flag(config: dict, path: Path, name: str) -> bool:
    """A true/false field (the string "false" was read as true); null: false, the default."""
    value = config.get(name)
    value = False if value is None else value
    if not isinstance(value, bool):
        raise ModelFormatError(path, f"config.json field '{name}' must be true or false, got {value!r:.40}")
    return value


def _token_id(value, path: Path, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelFormatError(path, f"config.json field '{name}' must hold non-negative token ids, got {value!r:.80}")
    return value


def read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelFormatError(directory, "no config.json: not a Hugging Face model directory")
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ModelFormatError(path, f"cannot read it: {e}") from e
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting beyond the stack
        raise ModelFormatError(path, f"not valid JSON: {type(e).__name__}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelFormatError(path, "config.json must hold a JSON object")
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ModelFormatError(path, f"'architectures' must be a list of names, got {architectures!r:.80}")
    architectures = set(architectures)
    if raw.get("model_type") != "llama" and not architectures & SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(path, f"unsupported architecture {sorted(architectures) or raw.get('model_type')!r:.80}",
                               "halo runs Llama-family models (LlamaForCausalLM)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ModelFormatError(path, f"{flag}=true is not supported (Llama models have no biases)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelFormatError(path, f"hidden_act={raw['hidden_act']!r:.80} is not supported; halo implements SwiGLU (silu)")

    # transformers 5 writes rope_parameters; 4.x writes rope_theta + rope_scaling.
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling")
    if not isinstance(rope, dict) or not isinstance(scaling or {}, dict):
        raise ModelFormatError(path, "rope_parameters and rope_scaling must be JSON objects")
    rope_theta = _field({"rope_theta": rope.get("rope_theta", raw.get("rope_theta", 10000.0))}, path, "rope_theta", float)
    scaling = scaling or (rope if rope.get("rope_type", "default") != "default" else None)
    rope_scaling = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if name not in scaling:
                    raise ModelFormatError(path, f"rope_scaling of type llama3 lacks '{name}'")
            rope_scaling = Llama3RopeScaling(*(_field(scaling, path, name, float) for name in
                                               ("factor", "low_freq_factor", "high_freq_factor")),
                                             _field(scaling, path, "original_max_position_embeddings"))
        elif kind != "default":
            raise ModelFormatError(path, f"rope scaling type {kind!r:.80} is not supported",
                                   "halo supports default and llama3")

    heads = _field(raw, path, "num_attention_heads")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    eos_ids = tuple(_token_id(e, path, "eos_token_id") for e in eos_ids)
    bos = raw.get("bos_token_id")
    hidden = _field(raw, path, "hidden_size")
    try:
        return ModelConfig(
            dim=hidden,
            hidden_dim=_field(raw, path, "intermediate_size"),
            n_layers=_field(raw, path, "num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=_field(raw, path, "num_key_value_heads", default=heads),
            vocab_size=_field(raw, path, "vocab_size"),
            max_seq_len=_field(raw, path, "max_position_embeddings", default=2048),
            head_dim=_field(raw, path, "head_dim", default=hidden // heads),
            norm_eps=_field(raw, path, "rms_norm_eps", float, 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tied_embeddings=_flag(raw, path, "tie_word_embeddings"),
            bos_id=None if bos is None else _token_id(bos, path, "bos_token_id"),
            eos_ids=eos_ids,
        )
    except ConfigError as e:
        raise ModelFormatError(path, str(e)) from None


class TensorIndex:
    """Which file holds which tensor, for single and sharded checkpoints."""

    def __init__(self, directory: Path):
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (KeyError, TypeError, ValueError, RecursionError, OSError) as e:
                raise ModelFormatError(index, f"malformed shard index: {type(e).__name__}: {e}") from e
            if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
                raise ModelFormatError(index, "weight_map must map tensor names to shard file names")
            for name, shard in weight_map.items():
                if Path(shard).name != shard or shard in ("", ".", ".."):
                    raise ModelFormatError(index, f"shard {shard!r:.80} of {name} is not a file name in the model "
                                           "directory (paths are refused: a model must not read files elsewhere)")
                if shard not in self.files:
                    self.files[shard] = SafetensorsFile(directory / shard)
                self.where[name] = shard
        elif single.is_file():
            self.files["model.safetensors"] = SafetensorsFile(single)
            self.where = {name: "model.safetensors" for name in self.files["model.safetensors"].names()}
        else:
            raise ModelFormatError(directory, "no model.safetensors or model.safetensors.index.json",
                                   "halo reads safetensors checkpoints; convert .bin/.pth files first")
        self.directory = directory

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def float32(self, name: str, shape: tuple[int, ...]):
        if name not in self.where:
            raise ModelFormatError(self.directory, f"tensor {name} is missing from the checkpoint")
        file = self.files[self.where[name]]
        if name not in file.entries:
            raise ModelFormatError(file.path, f"the shard index places {name} here, but the file lacks it")
        array = file.float32(name)
        if tuple(array.shape) != shape:
            raise ModelFormatError(file.path, f"tensor {name}: expected shape {shape}, found {tuple(array.shape)}")
        return array


def read_checkpoint(directory: str | os.PathLike) -> ModelWeights:
    directory = Path(directory)
    c = read_config(directory)
    index = TensorIndex(directory)
    shapes = {
        "input_layernorm": (c.dim,), "self_attn.q_proj": (c.q_dim, c.dim), "self_attn.k_proj": (c.kv_dim, c.dim),
        "self_attn.v_proj": (c.kv_dim, c.dim), "self_attn.o_proj": (c.dim, c.q_dim),
        "post_attention_layernorm": (c.dim,), "mlp.gate_proj": (c.hidden_dim, c.dim),
        "mlp.up_proj": (c.hidden_dim, c.dim), "mlp.down_proj": (c.dim, c.hidden_dim),
    }

    def layer_tensor(i: int, name: str):
        return index.float32(f"model.layers.{i}.{name}.weight", shapes[name])

    layers = [LayerWeights(
        attn_norm=layer_tensor(i, "input_layernorm"), wq=layer_tensor(i, "self_attn.q_proj"),
        wk=layer_tensor(i, "self_attn.k_proj"), wv=layer_tensor(i, "self_attn.v_proj"),
        wo=layer_tensor(i, "self_attn.o_proj"), mlp_norm=layer_tensor(i, "post_attention_layernorm"),
        w_gate=layer_tensor(i, "mlp.gate_proj"), w_up=layer_tensor(i, "mlp.up_proj"),
        w_down=layer_tensor(i, "mlp.down_proj"),
    ) for i in range(c.n_layers)]
    if past := layers_past(index.where, "model.layers.", c.n_layers):
        raise ModelFormatError(directory, f"it stores layers {past[:4]} past num_hidden_layers={c.n_layers}: config.json"
                               " and the weights disagree")
    embeddings = index.float32("model.embed_tokens.weight", (c.vocab_size, c.dim))
    if c.tied_embeddings or "lm_head.weight" not in index:
        if not c.tied_embeddings:
            raise ModelFormatError(directory, "lm_head.weight is missing and tie_word_embeddings is false")
        head = embeddings
    else:
        head = index.float32("lm_head.weight", (c.vocab_size, c.dim))
    weights = ModelWeights(config=c, tok_embeddings=embeddings, layers=layers,
                           final_norm=index.float32("model.norm.weight", (c.dim,)), lm_head=head,
                           source=str(directory))
    weights.validate()
    return weights
