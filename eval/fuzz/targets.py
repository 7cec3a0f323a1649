"""Fuzz targets: every parser halo runs on outside input, as a function of one byte string.

A target imports its parser only when built (so the atheris worker can instrument it first) and names
the only exceptions that parser may raise: its domain errors. Anything else escaping is a crash; so is
a hang (the per-input timeout) or a runaway allocation (the worker's address-space limit turns it into
MemoryError).

Adding a target is a few lines: a builder that returns (one-input function, allowed exceptions),
registered with `@target`, plus one or more seed files in corpus/NAME/ (see corpus/README.md).
"""

from __future__ import annotations

import atexit
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from halo.transport.reliable import PROTOCOL, PROTOCOL_VERSION

CORPUS = Path(__file__).parent / "corpus"
FIXTURES = CORPUS / "_fixtures"
FRAME_SEPARATOR = b"\xfe\xfe"  # control-message target: frames joined by this

OneInput = Callable[[bytes], object]


@dataclass(frozen=True)
class Target:
    name: str
    what: str  # one line for --list and the report
    build: Callable[[], tuple[OneInput, tuple[type[BaseException], ...]]]
    dictionary: tuple[bytes, ...] = ()  # tokens libFuzzer splices in (magic numbers, field names)
    max_len: int = 4096  # longest input libFuzzer generates (seeds may be longer)

    @property
    def seeds(self) -> Path:
        return CORPUS / self.name


TARGETS: dict[str, Target] = {}


def target(name: str, what: str, dictionary: tuple[bytes, ...] = (), max_len: int = 4096):
    """Register a target builder under `name`."""
    def register(build):
        TARGETS[name] = Target(name, what, build, dictionary, max_len)
        return build
    return register


def run_one(one_input: OneInput, allowed: tuple[type[BaseException], ...], data: bytes) -> BaseException | None:
    """Feed one input; a domain error is returned (it is the parser doing its job), anything else propagates."""
    try:
        one_input(data)
    except allowed as e:
        return e
    return None


# ---- scratch files: parsers that read paths get the bytes in a file (in memory where /dev/shm exists) ------
_scratch: list[Path] = []


def scratch_dir() -> Path:
    if not _scratch:
        base = "/dev/shm" if Path("/dev/shm").is_dir() else None
        _scratch.append(Path(tempfile.mkdtemp(prefix="halo-fuzz-", dir=base)))
        atexit.register(shutil.rmtree, _scratch[0], True)
    return _scratch[0]


def in_file(parse: Callable[[Path], object], name: str = "input") -> OneInput:
    """A one-input function that writes the bytes to a scratch file and parses that path."""
    path = scratch_dir() / name

    def one_input(data: bytes):
        path.write_bytes(data)
        return parse(path)
    return one_input


# ---- the targets ----------------------------------------------------------------------------------------------
DATAGRAM_LENGTH = struct.Struct("<H")  # wire target: each datagram of an input follows its 2-byte length


def split_datagrams(data: bytes) -> list[bytes]:
    """The datagrams of a wire-target input body: (2-byte little-endian length, bytes) repeated."""
    out, at = [], 0
    while at + DATAGRAM_LENGTH.size <= len(data):
        (n,) = DATAGRAM_LENGTH.unpack_from(data, at)
        at += DATAGRAM_LENGTH.size
        out.append(data[at:at + n])
        at += n
    return out


@target("wire", "UDP datagrams (wire v3) into an endpoint: Codec.unpack (and the C checks of transport/_datagrams.c, "
        "which must agree), replay window (counter), NACK/probe answers, then a gather's Inbound states (chunks, "
        "parity repair, vectors)",
        dictionary=(b"HL\x03", b"HL\x03\x00\x00", b"HL\x03\x01\x00", b"HL\x03\x02\x02", b"HL\x03\x03\x00",
                    b"HL\x03\x04\x00", b"\x07\x00\x00\x00", b"\xff\xff\xff\xff\xff\xff\xff\xff"), max_len=8192)
def _wire():
    import numpy as np

    from halo.transport import udp, wire

    endpoint = udp.UdpEndpoint(bytes(range(wire.KEY_BYTES)), 7, 0)  # bound, never read: datagrams come from here
    endpoint.send_hook = lambda sock, datagram, address: None  # NACK and probe answers go nowhere
    sender = ("127.0.0.1", 9)
    endpoint.send_vector({1: sender, 2: sender}, 5, np.arange(1000, dtype=np.float32))  # what NACKs may ask for
    policy = udp.GatherPolicy(nack=True)

    def retag(datagram: bytes) -> bytes:
        """The datagram as the key holder would send it (header fields kept, length and tag made right), so
        inputs reach the checks after the tag."""
        payload = datagram[wire.HEADER.size:len(datagram) - wire.TAG_BYTES]
        if len(datagram) < wire.HEADER.size + wire.TAG_BYTES or len(payload) > wire.MAX_PAYLOAD:
            return datagram
        return endpoint.codec.pack(*wire.HEADER.unpack_from(datagram)[2:10], payload)

    def rejected() -> int:
        return sum(sum(s.rejected.values()) for s in endpoint.stats.values())

    def one_input(data: bytes):
        """Byte 0: bit 0 = re-tag every datagram, bit 1 = the receiver knows the vector size, bits 2-3 = its
        dtype. Bytes 1-2: values per peer; byte 3: the epoch gathered. Then (length, datagram) pairs."""
        if len(data) < 4:
            return
        flags, n_values, epoch = data[0], max(1, int.from_bytes(data[1:3], "little")), data[3]
        dtype = (flags >> 2) & 3 if (flags >> 2) & 3 <= wire.INT8 else wire.FLOAT32
        endpoint.join(7, 0)
        endpoint.probe_replies.clear()
        inbound = endpoint._open_inbound(0.0, {1: n_values if flags & 2 else None, 2: None}, dtype, policy, None)
        accepted: dict[int, set[int]] = {}
        for datagram in split_datagrams(data[4:]):
            datagram = retag(datagram) if flags & 1 else datagram
            before, fresh = rejected(), None
            _same_in_c(endpoint, datagram)
            if _authentic(endpoint, datagram):
                header = wire.HEADER.unpack_from(datagram)
                fresh = _fresh(accepted, header[4], header[7])
            admitted = endpoint.admit(datagram)
            assert (admitted is None) == (rejected() == before + 1) and rejected() <= before + 1, "counted once"
            if fresh is not None:
                assert (admitted is not None) == fresh, f"replay window: counter {header[7]}, fresh={fresh}"
            if admitted is not None:
                endpoint._take(epoch, *admitted, sender, inbound, True, None, policy)
        result = endpoint._close_gather(0.0, inbound)
        for peer, state in inbound.items():
            values, mask = result.values[peer], result.masks[peer]
            assert values.dtype == np.float32 and values.shape == ((state.n_values or 0),), (values.shape, state.n_values)
            assert state.received == int(np.count_nonzero(np.frombuffer(bytes(state.got), np.uint8)))
            assert not state.complete or mask.all()

    return one_input, ()


def _authentic(endpoint, datagram: bytes) -> bool:
    """Whether the endpoint's codec takes the datagram (the replay oracle only judges those)."""
    from halo.transport import wire

    try:
        endpoint.codec.unpack(datagram, endpoint.session)
    except wire.WireError:
        return False
    return True


def _same_in_c(endpoint, datagram: bytes) -> None:
    """The C path (transport/_datagrams.c, where built) refuses a datagram for Codec.unpack's reason, or gives its
    header and payload."""
    from halo.transport import wire

    if endpoint.codec.state is None:
        return
    try:
        header, payload = endpoint.codec.unpack(datagram, endpoint.session)
        expected = (header, bytes(payload))
    except wire.WireError as e:
        expected = e.reason
    got = wire._datagrams.unpack(endpoint.codec.state, datagram, endpoint.session, wire.Header)
    assert got == expected, f"C says {got!r}, Python {expected!r}"


def _fresh(accepted: dict[int, set[int]], sender: int, counter: int) -> bool:
    """The replay rule stated plainly: a counter is taken once, and only within REPLAY_WINDOW of the newest
    taken from that sender (the oracle ReplayWindow's bit set must agree with)."""
    from halo.transport.wire import REPLAY_WINDOW

    seen = accepted.setdefault(sender, set())
    top = max(seen, default=-1)
    fresh = counter > top or (top - counter < REPLAY_WINDOW and counter not in seen)
    if fresh:
        seen.add(counter)
    return fresh


@target("control", "control message: reliable.decode of frames (split at b'\\xfe\\xfe')",
        dictionary=(PROTOCOL + bytes([PROTOCOL_VERSION]), FRAME_SEPARATOR, b'"kind"', b'"fields"', b'"arrays"', b'"float32"', b'"int64"',
                    b'"uint8"', b"[[", b"]]", b"[[[[[[[[[[[[[[[["))
def _control():
    from halo.transport.reliable import MessageError, decode

    def one_input(data: bytes):
        message = decode(data.split(FRAME_SEPARATOR))
        assert isinstance(message.kind, str) and isinstance(message.fields, dict)

    return one_input, (MessageError,)


@target("session", "a session's control messages (JSON fields): transport/control.py Hello, ProfileRequest and Ready "
        "from_fields", dictionary=(b'"udp_session"', b'"udp_nonce"', b'"attention"', b'"mlp"', b'"lm_head"',
                                   b'"node_id"', b'"model_sha256"', b"true", b"null", b"[[", b"]]", b"-1"))
def _session():
    import json

    from halo.transport.control import ControlError, Hello, ProfileRequest, Ready

    def one_input(data: bytes):
        try:
            fields = json.loads(data)
        except (ValueError, RecursionError):
            return
        if not isinstance(fields, dict):
            return
        for message in (Hello, ProfileRequest, Ready):
            try:
                parsed = message.from_fields(fields)
            except ControlError:
                continue
            assert message.from_fields(parsed.to_fields()) == parsed  # what was taken goes out and back unchanged

    return one_input, (ControlError,)


@target("address", "agent addresses: arguments.parse_endpoints (--agents, cluster files)",
        dictionary=(b"tcp://", b":7070", b"192.168.1.20", b"pi-1.local", b",", b"[::1]"), max_len=256)
def _address():
    from halo.arguments import parse_endpoints
    from halo.errors import ConfigError

    def one_input(data: bytes):
        endpoints = parse_endpoints(data.decode("utf-8", errors="surrogateescape"))
        assert all(e.startswith("tcp://") and 1 <= int(e.rsplit(":", 1)[1]) <= 65535 for e in endpoints), endpoints

    return one_input, (ConfigError,)


@target("plan", "plan file (JSON): scheduler.plan_io.load",
        dictionary=(b'"halo-plan"', b'"tp"', b'"pipeline"', b'"counts"', b'"priority"', b'"stages"', b'"units"',
                    b'"participants"', b'"worker"', b'"master"'))
def _plan():
    from halo.errors import ConfigError
    from halo.scheduler import plan_io
    from halo.scheduler.tp_plan import TensorParallelPlan

    def parse(path: Path):
        plan = plan_io.load(path)
        if isinstance(plan, TensorParallelPlan):
            plan.memory_used()  # what `generate --plan` computes next
        else:
            assert plan[0].covered <= plan[0].n_units

    return in_file(parse, "plan.json"), (ConfigError,)


@target("cluster", "cluster file (TOML): scheduler.profiles.load_cluster",
        dictionary=(b"[cluster]", b"[[device]]", b"memory_mb", b"compute_gflops", b"plr", b"bandwidth_mbps",
                    b"latency_ms", b"master = true", b"context", b"weights", b'"int8"', b"[[[[[[[[[[[[[[[[", b"{a={a={a={a="))
def _cluster():
    from halo.errors import ConfigError
    from halo.scheduler.profiles import load_cluster

    def parse(path: Path):
        cluster = load_cluster(path)
        assert 0 <= cluster.master < len(cluster.devices)

    return in_file(parse, "cluster.toml"), (ConfigError,)


@target("llama2c", "llama2.c checkpoint: formats.llama2c.read_checkpoint (header, sizes, weights)",
        dictionary=(struct.pack("<i", 0x616B3432), struct.pack("<i", 1), struct.pack("<i", 2), struct.pack("<i", -1)))
def _llama2c():
    from halo.errors import ModelFormatError
    from halo.model.formats import llama2c

    return in_file(llama2c.read_checkpoint, "model.bin"), (ModelFormatError,)


@target("llama2c_tokenizer", "llama2.c tokenizer.bin: Llama2cTokenizer (bytes 0-1: vocab size, the rest: the file)",
        dictionary=(b"<0x", b"<0x00>", b"<0xFF>"), max_len=8192)
def _llama2c_tokenizer():
    from halo.errors import ModelFormatError
    from halo.model.tokenizer import Llama2cTokenizer

    path = scratch_dir() / "tokenizer.bin"

    def one_input(data: bytes):
        if len(data) < 2:
            return
        path.write_bytes(data[2:])
        tokenizer = Llama2cTokenizer(path, int.from_bytes(data[:2], "little"))
        ids = tokenizer.encode("Once upon a time, \u00e9\u4e16\U0001f600")
        tokenizer.decode(ids)

    return one_input, (ModelFormatError,)


@target("safetensors", "safetensors file: SafetensorsFile header, then every tensor as float32",
        dictionary=(b'"dtype"', b'"shape"', b'"data_offsets"', b'"F32"', b'"F16"', b'"BF16"', b'"__metadata__"'))
def _safetensors():
    from halo.errors import ModelFormatError
    from halo.model.formats.safetensors_file import SafetensorsFile

    def parse(path: Path):
        file = SafetensorsFile(path)
        for name in file.names():
            file.float32(name)
        del file  # release the memory map before the next input overwrites the file

    return in_file(parse, "model.safetensors"), (ModelFormatError,)


@target("gguf", "GGUF file: formats.gguf.read_checkpoint (header, metadata, tensor table, weights), then the "
        "tokenizer its metadata describes (encode and decode a text)",
        dictionary=(b"GGUF", b"general.architecture", b"llama", b"general.alignment", b"llama.embedding_length",
                    b"llama.attention.head_count", b"llama.block_count", b"tokenizer.ggml.model", b"tokenizer.ggml.tokens",
                    b"tokenizer.ggml.scores", b"tokenizer.ggml.merges", b"gpt2", b"token_embd.weight",
                    struct.pack("<I", 8), struct.pack("<I", 9), struct.pack("<Q", 1 << 62)), max_len=32768)
def _gguf():
    from halo.errors import ModelFormatError
    from halo.model.formats import gguf
    from halo.model.tokenizer import gguf_tokenizer

    def parse(path: Path):
        weights = gguf.read_checkpoint(path)
        file = weights.extra["gguf_file"]
        if "tokenizer.ggml.model" in file.metadata:
            tokenizer = gguf_tokenizer(file, weights.config)
            tokenizer.decode(tokenizer.encode("Once upon a time, \u00e9\u4e16"))
        del weights, file  # release the memory map before the next input overwrites the file

    return in_file(parse, "model.gguf"), (ModelFormatError,)


@target("hf_config", "Hugging Face config.json: formats.hf.read_config",
        dictionary=(b'"hidden_size"', b'"num_attention_heads"', b'"num_key_value_heads"', b'"head_dim"',
                    b'"rope_scaling"', b'"rope_type"', b'"llama3"', b'"LlamaForCausalLM"', b'"eos_token_id"'))
def _hf_config():
    from halo.errors import ModelFormatError
    from halo.model.formats import hf

    def parse(path: Path):
        return hf.read_config(path.parent)

    return in_file(parse, "config.json"), (ModelFormatError,)


@target("hf_index", "sharded checkpoint index: formats.hf.TensorIndex (a valid shard lies beside it)",
        dictionary=(b'"weight_map"', b'"model-1.safetensors"', b'"model.norm.weight"', b"/", b".."))
def _hf_index():
    from halo.errors import ModelFormatError
    from halo.model.formats import hf

    directory = scratch_dir() / "hf_index"
    directory.mkdir(exist_ok=True)
    shutil.copy(FIXTURES / "model-1.safetensors", directory / "model-1.safetensors")
    index_path = directory / "model.safetensors.index.json"

    def one_input(data: bytes):
        index_path.write_bytes(data)
        index = hf.TensorIndex(directory)
        for name in list(index.where)[:4]:
            index.float32(name, (2,))

    return one_input, (ModelFormatError,)


@target("hf_tokenizer", "tokenizer.json: HFTokenizer construction (the tokenizers library)",
        dictionary=(b'"model"', b'"type"', b'"BPE"', b'"vocab"', b'"merges"', b'"added_tokens"', b'"decoder"'),
        max_len=16384)
def _hf_tokenizer():
    from halo.errors import ModelFormatError
    from halo.model.tokenizer import HFTokenizer

    def parse(path: Path):
        tokenizer = HFTokenizer(path, 1 << 20, 0, (1,))
        tokenizer.decode(tokenizer.encode("Once upon a time"))

    return in_file(parse, "tokenizer.json"), (ModelFormatError,)


def _tokenizers():
    """The bundled llama2.c tokenizer and a small byte-level BPE tokenizer.json (when `tokenizers` is installed)."""
    from halo import BUNDLED_TOKENIZER
    from halo.model.tokenizer import Llama2cTokenizer

    tokenizers = [Llama2cTokenizer(str(BUNDLED_TOKENIZER), 512)]
    try:
        from halo.model.tokenizer import HFTokenizer

        tokenizers.append(HFTokenizer(FIXTURES / "tokenizer.json", 320, 0, (1,)))
    except Exception:  # noqa: BLE001 - without the master extra only the llama2.c tokenizer is fuzzed
        pass
    return tokenizers


@target("encode", "tokenizer encode of arbitrary text (invalid UTF-8 as lone surrogates); decode gives it back",
        dictionary=(b" ", b"\xe2\x96\x81", b"<0x0A>", b"\xed\xa0\x80", b"\xf0\x9f\x98\x80"), max_len=512)
def _encode():
    from halo.model.tokenizer import valid_text

    tokenizers = _tokenizers()

    # tokenizer.json models read the text of their special tokens ("<s>", "</s>") as those tokens, as
    # transformers does by default (chat templates rely on it), and decode drops them: no round trip there
    specials = [[a.content for a in t._tok.get_added_tokens_decoder().values() if a.special] if hasattr(t, "_tok")
                else [] for t in tokenizers]

    def one_input(data: bytes):
        text = data.decode("utf-8", errors="surrogateescape")
        for tokenizer, special in zip(tokenizers, specials):
            ids = tokenizer.encode(text, bos=True)
            assert ids[0] == tokenizer.bos_id and all(0 <= i < tokenizer.vocab_size for i in ids), ids
            if not any(s in text for s in special):
                assert tokenizer.decode(ids[1:]) == valid_text(text), "decode(encode(text)) must give the text back"

    return one_input, ()


@target("decode", "tokenizer decode and stream of arbitrary ids (byte 0 picks 1/2/4/8-byte ids): TokenIdError "
        "exactly for ids outside the vocabulary, stream == decode")
def _decode():
    import numpy as np

    from halo.model.tokenizer import TokenIdError

    tokenizers = _tokenizers()
    widths = {0: "<u1", 1: "<u2", 2: "<i4", 3: "<i8"}

    def one_input(data: bytes):
        if not data:
            return
        dtype = np.dtype(widths[data[0] & 3])
        body = data[1:len(data) - (len(data) - 1) % dtype.itemsize]
        ids = np.frombuffer(body, dtype=dtype).tolist()
        for tokenizer in tokenizers:
            vocab = getattr(tokenizer, "model_vocab_size", tokenizer.vocab_size)
            outside = any(not 0 <= i < vocab for i in ids)
            at_start = bool(data[0] & 4)
            try:
                text = tokenizer.decode(ids, at_start=at_start)
                step = tokenizer.stream(at_start=at_start)
                streamed = "".join(step(i) for i in ids[:64]) + step(None)
            except TokenIdError:
                assert outside, "TokenIdError for ids inside the vocabulary"
                continue
            assert not outside, "decoded an id outside the vocabulary"
            assert isinstance(text, str) and streamed == tokenizer.decode(ids[:64], at_start=at_start), \
                "streaming must print what decode returns"

    return one_input, ()
