"""The seed corpus: small valid (and a few nearly valid) inputs per target, written by code so they follow
the formats as they evolve. `python -m halo.eval.fuzz --write-seeds` rewrites corpus/*/seed-* and the
fixtures; crash-* files (regressions) are left alone."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import numpy as np

from halo.eval.fuzz.targets import CORPUS, FIXTURES, FRAME_SEPARATOR

CLUSTER_TOML = """[cluster]
context = 256
weights = "fp32"

[[device]]
name = "laptop"
address = "127.0.0.1:7070"
memory_mb = 3000
compute_gflops = 20
master = true

[[device]]
name = "pi-1"
address = "192.168.1.20:7070"
memory_mb = 800
compute_gflops = 4.5
plr = 0.05
bandwidth_mbps = 50
latency_ms = 2.0
"""


def llama2c_checkpoint(dim=4, hidden=6, n_layers=1, n_heads=2, n_kv=1, vocab=5, seq_len=3, tied=True) -> bytes:
    head = dim // n_heads
    kv_dim = n_kv * head
    n = (vocab * dim + n_layers * (2 * dim + 2 * dim * dim + 2 * kv_dim * dim + 3 * hidden * dim) + dim
         + seq_len * head + (0 if tied else vocab * dim))
    values = np.random.default_rng(0).standard_normal(n).astype("<f4")
    return struct.pack("<7i", dim, hidden, n_layers, n_heads, n_kv, vocab if tied else -vocab, seq_len) + values.tobytes()


def llama2c_tokenizer(extra: list[bytes]) -> bytes:
    pieces = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)] + extra
    out = bytearray(struct.pack("<i", max(len(p) for p in pieces)))
    for i, piece in enumerate(pieces):
        out += struct.pack("<fi", -float(i), len(piece)) + piece
    return bytes(out)


def safetensors(tensors: dict[str, tuple[str, np.ndarray]], metadata: dict | None = None) -> bytes:
    header, blob = {}, b""
    for name, (dtype, array) in tensors.items():
        data = array.tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + blob


def hf_config(**overrides) -> bytes:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
              "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1}
    config.update(overrides)
    return json.dumps(config).encode()


def wire_seeds() -> dict[str, bytes]:
    """Datagrams as a peer's UdpEndpoint sends them (sender 1, session 7, the fuzz key), framed for the wire
    target: flags, values per peer, the epoch gathered, then (2-byte length, datagram) pairs."""
    from halo.transport import udp, wire

    from halo.eval.fuzz.targets import DATAGRAM_LENGTH

    key = bytes(range(wire.KEY_BYTES))
    peer = udp.UdpEndpoint(key, 7, 1)
    sent: list[bytes] = []
    peer.send_hook = lambda sock, datagram, address: sent.append(datagram)

    def vector(epoch: int, n: int, dtype: int, parity_group: int = 0) -> list[bytes]:
        sent.clear()
        peer.send_vector({0: ("127.0.0.1", 9)}, epoch, np.linspace(-1, 1, n, dtype=np.float32), dtype, parity_group)
        return list(sent)

    def framed(flags: int, n: int, epoch: int, datagrams: list[bytes]) -> bytes:
        return bytes([flags]) + n.to_bytes(2, "little") + bytes([epoch]) + b"".join(
            DATAGRAM_LENGTH.pack(len(d)) + d for d in datagrams)

    try:
        f32 = vector(5, 800, wire.FLOAT32, parity_group=2)  # 3 data chunks, then P and Q of 2 groups (f16: 2 whole chunks, as senders of unknown sizes pad)
        f16, int8 = vector(5, 2 * 711, wire.FLOAT16), vector(5, 300, wire.INT8)
        old, new = vector(4, 10, wire.FLOAT32), vector(6, 10, wire.FLOAT32)
        nack = peer.pack(wire.NACK, wire.FLOAT32, 5, 0, 1, np.array([0, 2, 9], "<u2").tobytes())
        probe = [peer.pack(wire.PROBE, 0, 9, 0, 2, b"ping"), peer.pack(wire.PROBE, 0, 9, 1, 2, b"pong")]
        forged = bytearray(f32[0])
        forged[18:26] = (1 << 40).to_bytes(8, "little")  # another counter: valid only once re-tagged (flag bit 0)
    finally:
        peer.close()
    return {"vector-f32": framed(2, 800, 5, f32[:3]),
            "parity-repair": framed(2, 800, 5, [f32[0], f32[2], f32[3], f32[4]]),
            "replayed": framed(2, 800, 5, [f32[0], f32[1], f32[0], f32[2], f32[1]]),
            "f16-unknown-size": framed(wire.FLOAT16 << 2, 0, 5, f16),
            "int8": framed(2 | wire.INT8 << 2, 300, 5, int8),
            "stale-and-early": framed(2, 800, 5, old + new + f32[:1]),
            "nack-probe": framed(0, 800, 5, [nack, *probe]),
            "retag": framed(1, 800, 5, [bytes(forged), f32[1]]),
            "garbage": framed(1, 800, 5, [b"", b"HL\x02", f32[0][:40], f32[0] + b"x", bytes(1500)])}


def control_seeds() -> dict[str, bytes]:
    from halo.transport.reliable import Message, encode

    messages = {
        "hello": Message("hello", {"session": 7, "layers": [0, 1], "sync": {"mode": "halo"}},
                         [np.arange(4, dtype=np.float32), np.arange(6, dtype=np.int64).reshape(2, 3)]),
        "status": Message("status"),
        "uint8": Message("partial", {"layer": 2}, [np.arange(5, dtype=np.uint8), np.zeros((0, 3), dtype=np.float16)]),
        "nested": None,  # a deeply nested header: decode must refuse it without RecursionError
    }
    seeds = {}
    for name, message in messages.items():
        frames = encode(message) if message else [b"HALO\x01", b"[" * 2000]
        seeds[name] = FRAME_SEPARATOR.join(frames)
    return seeds


def session_seeds() -> dict[str, bytes]:
    """A hello over UDP, a profile request, a ready, each as the sender's JSON fields."""
    from halo.transport import wire
    from halo.transport.control import Hello, ProfileRequest, Ready, UdpSession

    udp = UdpSession(7, "ab" * wire.NONCE_BYTES, 40000)
    messages = {"hello": Hello("0" * 64, 256, 32, 256, "laptop", "native", {"mode": "exact"}, 1, ((0, 1), ()),
                               ((0,), (1, 2)), (3,), udp),
                "profile": ProfileRequest("f" * 64, "int8", 32, 256, "laptop", True, False, 2, udp),
                "ready": Ready("pi-1", 1 << 20, {"cores": 4}, 40001, 0, False)}
    return {name: json.dumps(m.to_fields()).encode() for name, m in messages.items()}


def plan_seeds() -> dict[str, bytes]:
    from halo.scheduler import plan_io
    from halo.scheduler.pipeline import plan_pipeline
    from halo.scheduler.profiles import load_cluster, model_profile, named_config
    from halo.scheduler.tp_plan import plan_tp

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "cluster.toml"
        path.write_text(CLUSTER_TOML)
        cluster = load_cluster(path)
    model = model_profile(named_config("stories260k"), cluster.weights, "stories260k")
    tp = plan_tp(cluster, model, "minmax", select=False)
    pipeline = plan_pipeline(cluster, model)
    return {"tp": json.dumps(plan_io.tp_plan_json(tp)).encode(),
            "pipeline": json.dumps(plan_io.pipeline_plan_json(pipeline, cluster, model)).encode()}


def hf_tokenizer_json() -> bytes:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["Once upon a time there was a little robot who liked to count packets."] * 10, trainer)
    return json.dumps(json.loads(tok.to_str()), separators=(",", ":")).encode()


def gguf_model(cfg: dict, qtype: str, tokenizer) -> bytes:
    """A small Llama GGUF: norms F32, matrices `qtype` (F16 or a block type), `tokenizer(writer)` writes the
    tokenizer metadata."""
    import gguf
    import gguf.quants

    from halo.eval.random_checkpoint import gguf_tensor_name, random_tensors

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "model.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_block_count(cfg["num_hidden_layers"])
        writer.add_context_length(cfg["max_position_embeddings"])
        writer.add_embedding_length(cfg["hidden_size"])
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_head_count(cfg["num_attention_heads"])
        writer.add_head_count_kv(cfg["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        tokenizer(writer)
        kind = gguf.GGMLQuantizationType[qtype]
        for name, array in random_tensors(cfg):
            if array.ndim == 1 or qtype in ("F32", "F16"):
                writer.add_tensor(gguf_tensor_name(name), array.astype(np.float16 if array.ndim > 1 else np.float32))
            else:
                writer.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(array, kind), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes()


def gguf_seeds() -> dict[str, bytes]:
    """Tiny Llama GGUF files: F16 matrices with a byte-level BPE (gpt2) tokenizer of 8 tokens, and Q8_0 blocks
    with a SentencePiece-style (llama) vocabulary: 256 byte pieces (which that encoder needs) and merges."""

    def gpt2(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(["<s>", "</s>", "a", "b", "\u0120", "ab", "\u0120a", "<|im_start|>"])
        writer.add_token_types([3, 3, 1, 1, 1, 1, 1, 3])
        writer.add_token_merges(["a b", "\u0120 a"])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_add_bos_token(True)
        writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")

    def llama(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581a", "\u2581b", "ab"])
        writer.add_token_scores([0.0] * 259 + [-1.0, -2.0, -3.0])
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1, 1, 1])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)

    small = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=8, max_position_embeddings=16, rms_norm_eps=1e-5,
                 rope_theta=10000.0, tie_word_embeddings=False)
    blocks = dict(small, hidden_size=32, intermediate_size=32, num_attention_heads=1, vocab_size=262,
                  tie_word_embeddings=True)
    f16 = gguf_model(small, "F16", gpt2)
    header_only = f16[:f16.index(b"token_embd.weight") - 8]  # metadata, cut before the tensor table
    return {"f16-gpt2": f16, "q8-llama-vocab": gguf_model(blocks, "Q8_0", llama), "truncated": header_only}


def write_seeds(corpus: Path = CORPUS) -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    shard = safetensors({"model.norm.weight": ("F32", np.array([1.0, 2.0], "<f4")),
                         "half": ("F16", np.array([1.0, -2.0], "<f2")), "brain": ("BF16", np.array([0x3F80, 0xC000], "<u2"))})
    (FIXTURES / "model-1.safetensors").write_bytes(shard)
    tokenizer_json = hf_tokenizer_json()
    (FIXTURES / "tokenizer.json").write_bytes(tokenizer_json)
    from halo import BUNDLED_TOKENIZER

    seeds = {
        "wire": wire_seeds(),
        "address": {"list": b"192.168.1.20:7070, pi-1.local:7070,tcp://localhost:1", "one": b"10.0.0.2:65535"},
        "control": control_seeds(),
        "session": session_seeds(),
        "plan": plan_seeds(),
        "cluster": {"two-devices": CLUSTER_TOML.encode(),
                    "minimal": b'[[device]]\nmemory_mb = 100\ncompute_gflops = 1\n',
                    "bad-key": b'[cluster]\ncontext = "x"\n[[device]]\nname = 3\nmemory_mb = 1e400\ncompute_gflops = -1\n'},
        "llama2c": {"tied": llama2c_checkpoint(), "untied": llama2c_checkpoint(tied=False),
                    "gqa": llama2c_checkpoint(dim=8, hidden=4, n_layers=2, n_heads=4, n_kv=2, vocab=3, seq_len=2),
                    "export-magic": struct.pack("<7i", 0x616B3432, 2, 0, 0, 0, 0, 0)},
        "llama2c_tokenizer": {"small": (262).to_bytes(2, "little") + llama2c_tokenizer([b" ", b"a", b" a"]),
                              "tok512": (512).to_bytes(2, "little") + Path(str(BUNDLED_TOKENIZER)).read_bytes()},
        "gguf": gguf_seeds(),
        "safetensors": {"three-dtypes": safetensors(
            {"a": ("F32", np.arange(6, dtype="<f4").reshape(2, 3)), "b": ("F16", np.ones(3, "<f2")),
             "c": ("BF16", np.array([[0x3F80]], "<u2")), "empty": ("F32", np.zeros((0, 4), "<f4"))},
            metadata={"format": "pt"})},
        "hf_config": {"basic": hf_config(), "tied-gqa": hf_config(tie_word_embeddings=True, eos_token_id=[1, 2]),
                      "llama3": hf_config(rope_theta=500000.0, head_dim=4, rope_scaling={
                          "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16}),
                      "transformers5": hf_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})},
        "hf_index": {"index": json.dumps({"metadata": {"total_size": 20}, "weight_map": {
            "model.norm.weight": "model-1.safetensors", "half": "model-1.safetensors",
            "brain": "model-1.safetensors"}}).encode()},
        "hf_tokenizer": {"bpe": tokenizer_json},
        "encode": {"story": b"Once upon a time, there was a little girl named Lily.",
                   "unicode": "caf\u00e9 \u4e16\u754c \U0001f600\n\t".encode(), "invalid-utf8": b"ab\xff\xfe\xc3(\xed\xa0\x80",
                   "spaces": b"   a  b   ", "special-tokens": b" <0x0 <s>\x01 a </s>"},
        "decode": {"u8": bytes([0]) + bytes(range(0, 40)), "u16": bytes([1]) + np.arange(250, 270, dtype="<u2").tobytes(),
                   "i32-mixed": bytes([6]) + np.array([1, 300, -1, 511, 512], "<i4").tobytes()},
    }
    for name, files in seeds.items():
        folder = corpus / name
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("seed-*"):
            old.unlink()
        for stem, data in files.items():
            (folder / f"seed-{stem}").write_bytes(data)
