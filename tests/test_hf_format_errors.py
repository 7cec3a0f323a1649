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
