"""Inputs the fuzzing campaign (python -m halo.eval.fuzz) found to escape a parser with something other than its
domain error. Each one, written out readably; the raw crashing files are replayed from eval/fuzz/corpus/*/crash-*."""

import json
import struct

import numpy as np
import pytest

from halo import BUNDLED_TOKENIZER
from halo.errors import ConfigError, ModelFormatError
from halo.eval.fuzz.targets import FIXTURES
from halo.model.formats import gguf, hf, llama2c
from halo.model.formats.safetensors_file import SafetensorsFile
from halo.model.tokenizer import HFTokenizer, Llama2cTokenizer, TokenIdError
from halo.scheduler import plan_io
from halo.scheduler.profiles import load_cluster
from halo.transport.reliable import PROTOCOL, PROTOCOL_VERSION, MessageError, decode


# ---- control messages (transport/reliable.py decode) ---------------------------------------------------------
PREAMBLE = PROTOCOL + bytes([PROTOCOL_VERSION])


def header(**fields) -> bytes:
    return json.dumps({"kind": "x", "fields": {}, "arrays": [], **fields}).encode()


@pytest.mark.parametrize("frames, message", [
    ([PREAMBLE, b"[" * 100_000], "nested deeper than 32 levels"),  # was RecursionError
    ([PREAMBLE, header(fields={"a": json.loads("[" * 40 + "]" * 40)})], "nested deeper than 32 levels"),
    ([PREAMBLE, header(arrays=[[["float32"], [1]]]), b"\0" * 4], "is not allowed"),  # was TypeError: unhashable
    ([PREAMBLE, b'{"kind": "x", "fields": {}, "arrays": [["float32", [1e400]]]}', b""], "is not allowed"),  # OverflowError
    ([PREAMBLE, header(arrays=[["uint8", [1.5]]]), b"\0"], "is not allowed"),  # was silently truncated to 1
    ([PREAMBLE, header(arrays=[["uint8", [1] * 40]]), b"\0"], "is not allowed"),  # was ValueError from reshape
    ([PREAMBLE, header(arrays=[["uint8", [2**40, 2**40]]]), b""], "is not allowed"),
])
def test_control_decode_refuses(frames, message):
    with pytest.raises(MessageError, match=message):
        decode(frames)


# ---- tokenizers ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizers():
    return [Llama2cTokenizer(str(BUNDLED_TOKENIZER), 512), HFTokenizer(FIXTURES / "tokenizer.json", 320, 0, (1,))]


def test_encode_takes_text_that_is_not_valid_unicode(tokenizers):
    """A str with lone surrogates (argv or a file read with errors="surrogateescape") raised UnicodeEncodeError in
    the llama2.c encoder and TypeError in tokenizers; now the surrogate is encoded as U+FFFD."""
    text = b"caf\xc3\xa9 \xff!".decode("utf-8", errors="surrogateescape")
    for tokenizer in tokenizers:
        assert tokenizer.decode(tokenizer.encode(text, bos=False)) == "caf\u00e9 \ufffd!"


@pytest.mark.parametrize("bad", [-1, 320, 2**32, 2**70])
def test_hf_decode_refuses_ids_outside_the_vocabulary(tokenizers, bad):
    """tokenizers raised OverflowError for negative and huge ids (and dropped ids past its vocabulary)."""
    with pytest.raises(TokenIdError, match=f"token id {bad} is outside the vocabulary"):
        tokenizers[1].decode([5, bad])
    assert tokenizers[1].decode([5, 319]) == tokenizers[1].decode([5])  # model rows the tokenizer lacks: ""


def test_a_tokenizer_json_that_panics_the_tokenizers_library(tmp_path):
    """A malformed merges table makes tokenizers panic in Rust (pyo3 PanicException, not an Exception)."""
    path = tmp_path / "tokenizer.json"
    path.write_bytes((FIXTURES.parent / "hf_tokenizer" / "crash-rust-panic").read_bytes())
    with pytest.raises(ModelFormatError, match="cannot parse tokenizer.json: PanicException"):
        HFTokenizer(path, 1000, 0, (1,))


def test_a_tokenizer_json_with_ids_beyond_the_model(tmp_path):
    """Found by the campaign (corpus/hf_tokenizer/crash-token-id-beyond-the-vocabulary-size): a vocabulary of few
    tokens but an id past the model's embedding passed the token-count check; encode then produced that id (the
    model would index past its embedding). Now refused when the tokenizer is read."""
    document = json.loads((FIXTURES / "tokenizer.json").read_text())
    document["model"]["vocab"]["a"] = 79888888
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ModelFormatError, match="tokenizer has token id 79888888 but the model's embedding has only 1000"):
        HFTokenizer(path, 1000, 0, (1,))


# ---- model headers ------------------------------------------------------------------------------------------
def test_llama2c_header_with_an_odd_head_dim(tmp_path):
    """dim 6 / 2 heads: ModelConfig raised ConfigError out of the model reader."""
    path = tmp_path / "model.bin"
    path.write_bytes(struct.pack("<7i", 6, 6, 1, 2, 1, 5, 3) + bytes(4096))
    with pytest.raises(ModelFormatError, match="head_dim=3 must be even"):
        llama2c.read_checkpoint(path)


def write_config(tmp_path, **overrides):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10}
    config.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_size": 6}, "head_dim=3 must be even"),  # was ConfigError
    ({"num_attention_heads": 0}, "'num_attention_heads'=0: must be >= 1"),  # was ZeroDivisionError
    ({"hidden_size": 1e400}, "'hidden_size'=inf: must be an integer"),  # was OverflowError
    ({"hidden_size": 8.7}, "'hidden_size'=8.7: must be an integer"),  # was silently 8
    ({"architectures": [{}]}, "'architectures' must be a list of names"),  # was TypeError: unhashable
    ({"rope_theta": "fast"}, "'rope_theta'='fast': must be a finite number"),  # was ValueError
    ({"rope_scaling": ["llama3"]}, "rope_parameters and rope_scaling must be JSON objects"),  # was AttributeError
    ({"rope_scaling": {"rope_type": "llama3", "factor": "x", "low_freq_factor": 1, "high_freq_factor": 4,
                       "original_max_position_embeddings": 8}}, "'factor'='x'"),  # was ValueError
    ({"eos_token_id": ["</s>"]}, "'eos_token_id' must hold non-negative token ids"),
])
def test_hf_config_values(tmp_path, overrides, message):
    with pytest.raises(ModelFormatError, match=message):
        hf.read_config(write_config(tmp_path, **overrides))


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "must hold a JSON object"),  # was AttributeError
    ("[" * 100_000, "not valid JSON: RecursionError"),
])
def test_hf_config_documents(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelFormatError, match=message):
        hf.read_config(tmp_path)


@pytest.mark.parametrize("weight_map, message", [
    ({"a": {"x": 1}}, "weight_map must map tensor names to shard file names"),  # was TypeError: unhashable
    (["model-1.safetensors"], "weight_map must map"),  # was AttributeError
    ({"a": "../model-1.safetensors"}, "is not a file name in the model directory"),  # read outside the model
    ({"a": "/etc/passwd"}, "is not a file name in the model directory"),
    ({"a": "m" * 300 + ".safetensors"}, "cannot read it: File name too long"),  # was OSError
])
def test_hf_shard_index(tmp_path, weight_map, message):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelFormatError, match=message):
        hf.TensorIndex(tmp_path)


def safetensors_file(tmp_path, entry: dict, data: bytes = b"") -> SafetensorsFile:
    raw = json.dumps({"t": entry}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return SafetensorsFile(path)


@pytest.mark.parametrize("entry, message", [
    ({"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}, "do not fit shape"),  # int64 product wrapped to 0
    ({"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}, "must be non-negative integers"),  # reshape error later
    ({"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}, "must be non-negative integers"),  # was TypeError
    ({"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8]}, "must be non-negative integers"),
    ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, "dtype \\['F32'\\] is not supported"),  # unhashable
])
def test_safetensors_header_entries(tmp_path, entry, message):
    with pytest.raises(ModelFormatError, match=message):
        safetensors_file(tmp_path, entry, bytes(8))


def test_safetensors_header_nested_beyond_the_stack(tmp_path):
    raw = b"[" * 100_000
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ModelFormatError, match="header is not valid JSON: RecursionError"):
        SafetensorsFile(path)


# ---- cluster and plan files ---------------------------------------------------------------------------------
DEVICE = "[[device]]\nname = \"a\"\nmemory_mb = 100\ncompute_gflops = 1\n"


@pytest.mark.parametrize("text, message", [
    (b"[[device]]\nname = \"\xa4\"\n", "cannot read the cluster file"),  # was UnicodeDecodeError
    ("device = 3\n", "'device' must be \\[\\[device\\]\\] tables"),  # was TypeError
    ("device = [\"a\"]\n", "'device' must be \\[\\[device\\]\\] tables"),  # was AttributeError
    ("cluster = 3\n" + DEVICE, "'cluster' must be a \\[cluster\\] table"),  # was AttributeError
    ("[cluster]\ncontext = inf\n" + DEVICE, "context must be an integer, got inf"),  # was OverflowError
    ("[cluster]\ncontext = \"big\"\n" + DEVICE, "context must be an integer"),  # was ValueError
    (DEVICE.replace("100", "nan"), "memory_mb must be a finite number, got nan"),  # was accepted: NaN budget
    (DEVICE + "master = \"false\"\n", "master must be true or false"),  # was bool("false") == True
    (DEVICE + "address = \"10.0.0.2:70000\"\n", "port '70000' is not a number from 1 to 65535"),  # was port 4464
    (DEVICE + "address = \"not_an_address\"\n", "is not HOST:PORT"),
    ("a = " + "[" * 600 + "]" * 600 + "\n" + DEVICE, "nested too deeply"),  # was RecursionError inside tomllib
])
def test_cluster_files(tmp_path, text, message):
    path = tmp_path / "cluster.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=message):
        load_cluster(path)


@pytest.fixture(scope="module")
def plans():
    return {name: json.loads((FIXTURES.parent / "plan" / f"seed-{name}").read_text()) for name in ("tp", "pipeline")}


@pytest.mark.parametrize("mode, change, message", [
    ("tp", lambda d: d.update(participants={"laptop": 1}), "participants must be a list of device names"),  # TypeError
    ("tp", lambda d: d.update(participants=[["laptop"]]), "participants must be a list of device names"),
    ("tp", lambda d: d["counts"].update(attention=[[1.5] * 5, [6.5] * 5]), "counts.attention must hold integers"),
    ("tp", lambda d: d["counts"].update(attention=[[10**30] * 5, [0] * 5]), "counts.attention must hold integers"),
    ("tp", lambda d: d.update(priority=[1]), "priority must map block kinds"),  # was AttributeError
    ("tp", lambda d: d["priority"].update(mlp=[[[0, 1]], [0]]), "priority.mlp is not a regular array"),  # ValueError
    ("tp", lambda d: d["cluster"].update(context=1e400), "cluster.context must be an integer"),  # was OverflowError
    ("tp", lambda d: d["model"].update(blocks=[]), "malformed model or cluster section"),  # was AttributeError
    ("tp", lambda d: d["cluster"]["devices"][0].update(memory_bytes=float("nan")), "must be a finite number"),
    ("pipeline", lambda d: d.update(units=5), "units must be a list of names"),  # was TypeError
    ("pipeline", lambda d: d.update(stages=5), "stages must be a list"),  # was TypeError
    ("pipeline", lambda d: d["stages"][0].update(worker=["laptop"]), "unknown worker"),  # was TypeError: unhashable
    ("pipeline", lambda d: d["stages"][0].update(stop=1e400), "stage 0 is malformed"),  # was OverflowError
    ("pipeline", lambda d: d.update(cost_ms="fast"), "cost_ms must be a number or null"),  # was TypeError
])
def test_plan_files(tmp_path, plans, mode, change, message):
    document = json.loads(json.dumps(plans[mode]))
    change(document)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match=message):
        plan_io.load(path)


def test_plan_file_nested_beyond_the_stack(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("[" * 100_000)
    with pytest.raises(ConfigError, match="not valid JSON"):
        plan_io.load(path)


# ---- GGUF (halo/model/formats/gguf.py) ----------------------------------------------------------------------------
def gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_file(tmp_path, metadata: list[bytes], tensors: list[bytes] = (), data: bytes = b""):
    """GGUF v3 bytes by hand: header, metadata entries, tensor infos, then `data` at the 32-byte boundary."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)) + b"".join(metadata) + b"".join(tensors)
    path = tmp_path / "model.gguf"
    path.write_bytes(head + b"\0" * (-len(head) % 32) + data)
    return path


def u32(key: str, value: int) -> bytes:
    return gguf_string(key) + struct.pack("<II", 4, value)


def f32_tensor(name: str, *dims: int) -> bytes:
    return gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", 0, 0)


def test_gguf_metadata_arrays_nested_beyond_the_stack(tmp_path):
    """An array of arrays of ... 2000 deep raised RecursionError."""
    entry = gguf_string("x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 2000 + struct.pack("<IQ", 4, 0)
    with pytest.raises(ModelFormatError, match="arrays nested more than 16 deep"):
        gguf.GGUFFile(gguf_file(tmp_path, [entry]))


def test_gguf_string_array_longer_than_the_file(tmp_path):
    """Found by the campaign's short run in CI: a string array whose count cannot fit in the bytes left made numpy's
    "array is too big" ValueError escape (the strings' index is allocated before they are read)."""
    entry = gguf_string("tokenizer.ggml.tokens") + struct.pack("<I", 9) + struct.pack("<IQ", 8, 2**61)
    with pytest.raises(ModelFormatError, match="claims 2305843009213693952 strings"):
        gguf.GGUFFile(gguf_file(tmp_path, [entry]))


def test_gguf_tensor_dimensions_beyond_64_bits(tmp_path):
    """Dimensions whose product needs more than 64 bits wrapped around in numpy's int64 product: the tensor's size
    read as 0 bytes and the file was taken."""
    with pytest.raises(ModelFormatError, match="ends past the end of the file"):
        gguf.GGUFFile(gguf_file(tmp_path, [], [f32_tensor("t", 2**63, 4)]))


def test_gguf_heads_not_a_multiple_of_kv_heads(tmp_path):
    """Found by the campaign (corpus/gguf/crash-heads-not-multiple-of-kv-heads): ModelConfig's ConfigError escaped
    the GGUF reader instead of ModelFormatError."""
    metadata = [gguf_string("general.architecture") + struct.pack("<I", 8) + gguf_string("llama"),
                u32("llama.embedding_length", 8), u32("llama.attention.head_count", 2),
                u32("llama.attention.head_count_kv", 3), u32("llama.feed_forward_length", 16), u32("llama.block_count", 1)]
    path = gguf_file(tmp_path, metadata, [f32_tensor("token_embd.weight", 8, 4)], bytes(128))
    with pytest.raises(ModelFormatError, match="n_heads=2 is not a multiple of n_kv_heads=3"):
        gguf.read_config(path)


# ---- UDP datagrams (transport/udp/) ---------------------------------------------------------------------------
def test_a_chunk_of_another_dtype_before_the_size_is_known_is_counted_not_raised():
    """Found by the campaign (corpus/wire/crash-other-dtype-before-the-size-is-known): a gather of a vector of
    unknown size (expected None) with NACKs on raised TypeError in Inbound.arm_nack when the first authentic
    chunk had another dtype (its count stayed None); it is now counted as malformed and the gather goes on."""
    from halo.transport import wire
    from halo.transport.udp import GatherPolicy, UdpEndpoint

    key = bytes(range(wire.KEY_BYTES))
    master, agent = UdpEndpoint(key, 7, 0), UdpEndpoint(key, 7, 1)
    try:
        master.peers[1] = agent.address
        agent.send_vector({0: master.address}, 5, np.ones(300, np.float32), wire.FLOAT16)
        agent.send_vector({0: master.address}, 5, np.ones(355, np.float32), wire.FLOAT32)  # the same epoch, right
        result = master.gather(5, {1: None}, wire.FLOAT32, GatherPolicy(deadline_s=0.2, nack=True))
    finally:
        master.close()
        agent.close()
    assert master.stats[1].rejected["malformed"] == 1
    np.testing.assert_array_equal(result.values[1], np.ones(355, np.float32))


def sentencepiece_vocabulary(scores: int | None = None, bos: int = 1):
    """tokenizer.* metadata of a llama (SentencePiece-style) vocabulary for tests/gguf_models.raw_gguf."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581a"]

    def write(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(pieces)
        writer.add_token_scores([0.0] * (len(pieces) if scores is None else scores))
        writer.add_bos_token_id(bos)
        writer.add_eos_token_id(2)
    return write


@pytest.mark.parametrize("vocabulary, message", [
    (sentencepiece_vocabulary(scores=10), "10 tokenizer.ggml.scores for 260 tokens"),  # was IndexError in encode
    (sentencepiece_vocabulary(bos=300), "special token id 300 is outside the 260 tokens"),  # was TokenIdError
    (sentencepiece_vocabulary(bos=5000), "tokenizer.ggml.bos_token_id=5000 is outside the vocabulary"),
])
def test_gguf_tokenizer_metadata(tmp_path, vocabulary, message):
    from gguf_models import raw_gguf

    from halo.model.loader import load_tokenizer, load_weights

    path = raw_gguf(tmp_path / "model.gguf", tokenizer=vocabulary)
    with pytest.raises(ModelFormatError, match=message):
        load_tokenizer(load_weights(path)).encode("a b")


def test_a_chat_template_nested_beyond_the_stack():
    """jinja2's parser raised RecursionError on 3000 nested parentheses (a GGUF's tokenizer.chat_template)."""
    from halo.model.chat import ChatTemplate

    with pytest.raises(ModelFormatError, match="nested too deeply"):
        ChatTemplate("{{" + "(" * 3000 + "1" + ")" * 3000 + "}}")
