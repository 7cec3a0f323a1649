"""Bad Hugging Face directories fail with the file, the field, and expected vs found."""

import json
import struct

import numpy as np
import pytest

from halo.errors import ModelFormatError
from halo.model.formats.safetensors_file import SafetensorsFile
from halo.model.loader import load_weights


def write_safetensors(path, tensors: dict[str, tuple[str, tuple, bytes]]):
    header, blob = {}, b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob)


def write_config(directory, **overrides):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
              "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 10, "max_position_embeddings": 32}
    config.update(overrides)
    (directory / "config.json").write_text(json.dumps(config))


def test_unsupported_architecture(tmp_path):
    write_config(tmp_path, architectures=["MixtralForCausalLM"], model_type="mixtral")
    with pytest.raises(ModelFormatError, match=r"config.json: unsupported architecture \['MixtralForCausalLM'\]"):
        load_weights(tmp_path)


def test_missing_required_field(tmp_path):
    write_config(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="lacks the required field 'hidden_size'"):
        load_weights(tmp_path)


def test_unsupported_rope_scaling(tmp_path):
    write_config(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelFormatError, match="rope scaling type 'yarn' is not supported"):
        load_weights(tmp_path)


def test_missing_weights_file(tmp_path):
    write_config(tmp_path)
    with pytest.raises(ModelFormatError, match="no model.safetensors"):
        load_weights(tmp_path)


def test_wrong_shape_names_the_tensor(tmp_path):
    write_config(tmp_path)
    write_safetensors(tmp_path / "model.safetensors",
                      {"model.embed_tokens.weight": ("F32", (10, 9), np.zeros(90, np.float32).tobytes())})
    with pytest.raises(ModelFormatError, match=r"model.embed_tokens.weight: expected shape \(10, 8\), found \(10, 9\)|"
                                               r"model.layers.0.input_layernorm.weight is missing"):
        load_weights(tmp_path)


def test_truncated_safetensors(tmp_path):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"a": ("F32", (4, 4), np.zeros(16, np.float32).tobytes())})
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ModelFormatError, match=r"tensor a: data_offsets \[0, 64\) do not fit"):
        SafetensorsFile(path)


def test_garbage_header(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 5) + b"{notj" + b"\x00" * 8)
    with pytest.raises(ModelFormatError, match="header is not valid JSON"):
        SafetensorsFile(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelFormatError, match="exceeds the file"):
        SafetensorsFile(path)


def test_unsupported_dtype(tmp_path):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"a": ("I64", (2,), np.zeros(2, np.int64).tobytes())})
    with pytest.raises(ModelFormatError, match="dtype I64 is not supported"):
        SafetensorsFile(path)


def test_bf16_converts_exactly(tmp_path):
    values = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"a": ("BF16", (4,), bf16.tobytes())})
    np.testing.assert_array_equal(SafetensorsFile(path).float32("a"), values)


def tiny_directory(directory, layers_stored: int = 1, **config):
    """A loadable 1-layer directory (write_config's shape, zero weights) that stores `layers_stored` layers."""
    write_config(directory, **config)
    shapes = {"model.embed_tokens.weight": (10, 8), "model.norm.weight": (8,), "lm_head.weight": (10, 8)}
    for i in range(layers_stored):
        shapes.update({f"model.layers.{i}.{name}.weight": shape for name, shape in (
            ("input_layernorm", (8,)), ("self_attn.q_proj", (8, 8)), ("self_attn.k_proj", (4, 8)),
            ("self_attn.v_proj", (4, 8)), ("self_attn.o_proj", (8, 8)), ("post_attention_layernorm", (8,)),
            ("mlp.gate_proj", (16, 8)), ("mlp.up_proj", (16, 8)), ("mlp.down_proj", (8, 16)))})
    write_safetensors(directory / "model.safetensors",
                      {name: ("F32", shape, np.ones(shape, np.float32).tobytes()) for name, shape in shapes.items()})


def test_the_tiny_directory_is_loadable(tmp_path):
    tiny_directory(tmp_path)
    assert load_weights(tmp_path).config.n_layers == 1


def test_layers_past_num_hidden_layers_are_refused(tmp_path):
    """They were ignored: a 2-layer checkpoint with num_hidden_layers 1 ran one layer, other tokens, exit 0."""
    tiny_directory(tmp_path, layers_stored=2)
    with pytest.raises(ModelFormatError, match=r"stores layers \[1\] past num_hidden_layers=1"):
        load_weights(tmp_path)


def test_tie_word_embeddings_must_be_a_boolean(tmp_path):
    """The string "false" was read as true: the stored lm_head was silently ignored."""
    tiny_directory(tmp_path, tie_word_embeddings="false")
    with pytest.raises(ModelFormatError, match="'tie_word_embeddings' must be true or false, got 'false'"):
        load_weights(tmp_path)


@pytest.mark.parametrize("lie, said", [("retype", "a gap"), ("overlap", "overlapping")])
def test_a_safetensors_header_whose_tensors_do_not_tile_the_data_is_refused(tmp_path, lie, said):
    """A header re-typing model.norm.weight as F16 over half its bytes, or giving two tensors the same bytes, ran and
    printed garbage (safetensors' own loader refuses both)."""
    blob = np.arange(8, dtype=np.float32).tobytes()
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}
    if lie == "retype":
        header["b"] = {"dtype": "F16", "shape": [4], "data_offsets": [24, 32]}
    else:
        header["b"]["data_offsets"], blob = [0, 16], blob[:16]
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob)
    with pytest.raises(ModelFormatError, match=said):
        SafetensorsFile(path)


@pytest.mark.parametrize("name, content, said", [
    ("tokenizer_config.json", "[1, 2]", "holds a JSON list, not an object"),
    ("chat_template.jinja", b"\xff\xfe{{ x }}", "cannot read the chat template"),
])
def test_a_broken_chat_template_file_is_one_clear_error(tmp_path, name, content, said):
    """(An AttributeError / UnicodeDecodeError traceback, even without --chat.)"""
    from halo.model.tokenizer import read_hf_chat_template

    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ModelFormatError, match=said):
        read_hf_chat_template(tmp_path)


def test_a_null_optional_field_is_its_default(tmp_path):
    """"num_key_value_heads": null (as some exports write) was "lacks the required field"; transformers reads it as
    the default."""
    from halo.model.loader import load_config

    write_config(tmp_path, num_key_value_heads=None, head_dim=None)
    config = load_config(tmp_path)
    assert config.n_kv_heads == config.n_heads == 2 and config.head_dim == 4
