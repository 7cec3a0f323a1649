"""Tokenizers: llama2.c's score-ordered BPE, and Hugging Face tokenizer.json via `tokenizers`.

Both satisfy `Tokenizer`: encode text to ids (optionally after BOS), decode ids to text,
`stream()` an incremental decoder for printing tokens as they are generated, and `chat_template`:
the model's own chat template (halo/model/chat.py) or None when the model has none.
"""

from __future__ import annotations

import codecs
import heapq
import os
import re
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from halo.errors import ModelFormatError
from halo.model.chat import ChatTemplate
from halo.model.formats import llama2c

BYTE_PIECE = re.compile(rb"^<0x([0-9A-Fa-f]{2})>$")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class TokenIdError(ValueError):
    """A token id outside the vocabulary was given to decode (a caller's bug or a model/tokenizer mismatch)."""


def valid_text(text: str) -> str:
    """`text` with lone surrogates (a str that is not valid Unicode, e.g. from undecodable bytes with
    errors="surrogateescape") replaced by U+FFFD, which both encoders can represent."""
    return LONE_SURROGATE.sub("\ufffd", text)


def check_ids(ids, vocab_size: int) -> None:
    for token in ids:
        if not 0 <= token < vocab_size:
            raise TokenIdError(f"token id {token} is outside the vocabulary (0..{vocab_size - 1})")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    chat_template: ChatTemplate | None

    def encode(self, text: str, bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], at_start: bool = True) -> str: ...

    def stream(self, at_start: bool = True) -> Callable[[int], str]: ...


class Llama2cTokenizer:
    """llama2.c's encoder: dummy space, characters (byte fallback), then greedy best-score merges.

    Merges use a heap over adjacent pairs, so encoding is O(n log n) instead of llama2.c's O(n^2);
    ties go to the leftmost pair, as in llama2.c.
    """

    def __init__(self, path: str | os.PathLike, vocab_size: int, bos_id: int | None = 1, eos_ids: tuple[int, ...] = (2,), *,
                 pieces: list[bytes] | None = None, scores: np.ndarray | None = None, add_dummy_prefix: bool = True,
                 control_ids: tuple[int | None, ...] = (), add_bos: bool = True):
        """Reads tokenizer.bin at `path`, or takes `pieces` and `scores` (a GGUF SentencePiece vocabulary). bos_id None:
        the model has none (nothing is put first); eos_ids may be empty (the context's end ends a generation).
        control_ids: tokens that stay whole where their text appears (a GGUF's control tokens: a chat template's
        "</s>"; llama2.c's tokenizer.bin has none, as run.c encodes); add_bos: BOS goes first when encoding asks for it (a chat template's own BOS text is dropped)."""
        self.path = Path(path)
        self.pieces, self.scores = (pieces, scores) if pieces is not None else llama2c.read_tokenizer(path, vocab_size)
        self.add_dummy_prefix, self.add_bos = add_dummy_prefix, add_bos
        self.vocab_size = len(self.pieces)
        self.bos_id, self.eos_ids, self.unk_id = bos_id, tuple(eos_ids), 0
        self.control = {self.pieces[i].decode("utf-8", "replace"): i for i in control_ids
                        if i is not None and 0 <= i < len(self.pieces) and len(self.pieces[i]) > 1}
        self._control_split = re.compile("(" + "|".join(map(re.escape, sorted(self.control, key=len, reverse=True)))
                                         + ")") if self.control else None
        self.chat_template: ChatTemplate | None = None  # llama2.c models are not chat-tuned
        self.piece_id: dict[bytes, int] = {}
        for i, piece in enumerate(self.pieces):
            self.piece_id.setdefault(piece, i)
        self.byte_value: dict[int, int] = {}
        for i, piece in enumerate(self.pieces):
            m = BYTE_PIECE.match(piece)
            if m:
                self.byte_value[i] = int(m.group(1), 16)
        self.byte_id = {v: i for i, v in self.byte_value.items()}
        if len(self.byte_id) != 256:
            raise ModelFormatError(path, f"expected 256 byte-fallback pieces <0x00>..<0xFF>, found {len(self.byte_id)}")

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Control tokens written in the text stay whole; the text between them is encoded as llama.cpp does (the
        dummy space again after each control token); BOS first where asked (and add_bos, or the text is empty)."""
        ids = [self.bos_id] if bos and self.bos_id is not None and (self.add_bos or not text) else []
        if not text:
            return ids
        parts = self._control_split.split(text) if self._control_split else [text]
        after_control = True  # the text's start counts as one: the dummy space goes first
        for i, part in enumerate(parts):
            if i % 2:  # a control token's text
                ids.append(self.control[part])
                after_control = True
            elif part:
                ids += self._encode_plain(part, dummy_prefix=after_control)
                after_control = False
        return ids

    def _encode_plain(self, text: str, dummy_prefix: bool) -> list[int]:
        symbols: list[int] = [self.piece_id[b" "]] if dummy_prefix and self.add_dummy_prefix and b" " in self.piece_id else []
        for ch in valid_text(text):
            encoded = ch.encode("utf-8")
            if encoded in self.piece_id:
                symbols.append(self.piece_id[encoded])
            else:
                symbols.extend(self.byte_id[b] for b in encoded)
        return self._merge(symbols)

    def _merge(self, symbols: list[int]) -> list[int]:
        n = len(symbols)
        tokens = list(symbols)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        version = [0] * n
        heap: list[tuple[float, int, int, int, int]] = []

        def push(a: int) -> None:
            b = nxt[a]
            if a < 0 or b >= n:
                return
            merged = self.piece_id.get(self.pieces[tokens[a]] + self.pieces[tokens[b]])
            if merged is not None:
                heapq.heappush(heap, (-float(self.scores[merged]), a, version[a], version[b], merged))

        for i in range(n - 1):
            push(i)
        while heap:
            _, a, va, vb, merged = heapq.heappop(heap)
            b = nxt[a] if alive[a] else n
            if b >= n or version[a] != va or version[b] != vb:
                continue  # stale: one side changed since this pair was queued
            tokens[a] = merged
            version[a] += 1
            alive[b] = False
            nxt[a] = nxt[b]
            if nxt[b] < n:
                prv[nxt[b]] = a
            if prv[a] >= 0:
                push(prv[a])
            push(a)
        return [tokens[i] for i in range(n) if alive[i]]

    def _bytes(self, token: int) -> bytes:
        if token in self.byte_value:
            return bytes([self.byte_value[token]])
        if token == self.bos_id or token in self.eos_ids or token == self.unk_id:
            return b""
        return self.pieces[token]

    def decode(self, ids: list[int], at_start: bool = True) -> str:
        step = self.stream(at_start)
        return "".join(step(t) for t in ids) + step(None)

    def stream(self, at_start: bool = True) -> Callable[[int | None], str]:
        """An incremental decoder; call with each token id, and with None at the end to flush."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        first = [at_start]

        def step(token: int | None) -> str:
            if token is None:
                return decoder.decode(b"", final=True)
            check_ids((token,), self.vocab_size)
            data = self._bytes(token)
            if first[0] and data:
                first[0] = False
                if data.startswith(b" ") and self.add_dummy_prefix:
                    data = data[1:]  # the dummy prefix the encoder added
            return decoder.decode(data)

        return step


class HFTokenizer:
    """A Hugging Face tokenizer.json through the `tokenizers` library (or a `tokenizers.Tokenizer` built
    elsewhere, e.g. from GGUF metadata: `backend`). The chat template comes from tokenizer_config.json
    or chat_template.jinja beside tokenizer.json, unless given."""

    def __init__(self, path: str | os.PathLike, model_vocab_size: int, bos_id: int | None, eos_ids: tuple[int, ...],
                 *, backend=None, chat_template: ChatTemplate | None = None, add_bos: bool = True):
        self.path = Path(path)
        if backend is None:
            try:
                from tokenizers import Tokenizer as _Tokenizer
            except ImportError as e:  # pragma: no cover - depends on the installed extras
                raise ModelFormatError(path, "reading tokenizer.json needs the 'tokenizers' package",
                                       "pip install 'halo-edge[master]'") from e
            try:
                backend = _Tokenizer.from_file(str(path))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # the library's own untyped errors, and Rust panics (PanicException is no Exception)
                raise ModelFormatError(path, f"cannot parse tokenizer.json: {type(e).__name__}: {e}") from None
            chat_template = chat_template or read_hf_chat_template(self.path.parent)
        self._tok = backend
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        if self.vocab_size > model_vocab_size:
            raise ModelFormatError(path, f"tokenizer has {self.vocab_size} tokens but the model's embedding has only "
                                   f"{model_vocab_size} rows", "use the tokenizer that belongs to this checkpoint")
        top = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)  # ids need not be dense
        if top >= model_vocab_size:
            raise ModelFormatError(path, f"tokenizer has token id {top} but the model's embedding has only "
                                   f"{model_vocab_size} rows", "use the tokenizer that belongs to this checkpoint")
        self.model_vocab_size = model_vocab_size  # ids the model can emit; those the tokenizer lacks decode to ""
        self.bos_id, self.eos_ids = bos_id, eos_ids
        self.add_bos = add_bos  # False: the model's text starts without BOS (its chat template writes its own)
        self.chat_template = chat_template

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Special tokens written in the text (e.g. a rendered chat template's <|im_start|>) stay whole.
        BOS goes first when asked for and the model uses one, and always before an empty text (a start)."""
        ids = self._tok.encode(valid_text(text), add_special_tokens=False).ids
        prepend = bos and self.bos_id is not None and (self.add_bos or not ids)
        return ([self.bos_id] if prepend else []) + ids

    def decode(self, ids: list[int], at_start: bool = True) -> str:
        ids = list(ids)
        check_ids(ids, self.model_vocab_size)
        return self._tok.decode(ids, skip_special_tokens=True)

    def stream(self, at_start: bool = True) -> Callable[[int | None], str]:
        """Decode the growing sequence and emit only the new, complete characters."""
        ids: list[int] = []
        emitted = [0]

        def step(token: int | None) -> str:
            if token is not None:
                ids.append(token)
            text = self.decode(ids)
            if token is not None and text.endswith("\ufffd"):
                return ""  # an incomplete UTF-8 sequence: wait for its next byte
            new, emitted[0] = text[emitted[0]:], len(text)
            return new

        return step


def read_hf_chat_template(directory: Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face directory: chat_template.jinja, else tokenizer_config.json's
    chat_template (a string, or a list of named templates: "default"); None when it has none."""
    import json

    config_path, jinja_path = directory / "tokenizer_config.json", directory / "chat_template.jinja"
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFormatError(config_path, f"not valid JSON: {e}") from e
        if not isinstance(config, dict):
            raise ModelFormatError(config_path, f"holds a JSON {type(config).__name__}, not an object of settings")
    source, origin = config.get("chat_template"), config_path
    if jinja_path.is_file():
        try:
            source, origin = jinja_path.read_text(encoding="utf-8"), jinja_path
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFormatError(jinja_path, f"cannot read the chat template: {e}") from None
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None

    def token_text(name: str) -> str | None:
        value = config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    return ChatTemplate(source, token_text("bos_token"), token_text("eos_token"), str(origin))


# GGUF `tokenizer.ggml.pre` -> how byte-level BPE text is split before merging (as llama.cpp splits it)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3", "llama-v3")
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def gguf_tokenizer(file, config) -> Tokenizer:
    """The tokenizer a GGUF file describes in its tokenizer.* metadata (`file`: formats.gguf.GGUFFile):
    GPT-2-style byte-level BPE (tokenizer.ggml.model = gpt2) through `tokenizers`, or SentencePiece-style
    score BPE (= llama) through halo's llama2.c encoder. Control tokens stay whole; BOS/EOS and
    whether BOS leads the text come from the metadata; the chat template from tokenizer.chat_template."""
    path = file.path
    kind = file.get("tokenizer.ggml.model", str, default=None, required=False)
    if kind is None:
        raise ModelFormatError(path, "the file carries no tokenizer (tokenizer.ggml.model is missing)",
                               "pass --tokenizer PATH to the model's tokenizer.json")
    tokens = file.get("tokenizer.ggml.tokens", list)
    if not all(isinstance(t, str) for t in tokens):
        raise ModelFormatError(path, "tokenizer.ggml.tokens must be an array of strings")
    if len(tokens) > config.vocab_size:
        raise ModelFormatError(path, f"tokenizer has {len(tokens)} tokens but the model's embedding has only "
                               f"{config.vocab_size} rows")
    types = file.get("tokenizer.ggml.token_type", np.ndarray, default=np.ones(len(tokens), np.int32))
    template_source = file.get("tokenizer.chat_template", str, default=None, required=False)

    def token_text(key: str) -> str | None:
        token_id = file.get(key, default=None, required=False)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    template = ChatTemplate(template_source, token_text("tokenizer.ggml.bos_token_id"),
                            token_text("tokenizer.ggml.eos_token_id"),
                            f"{path} (tokenizer.chat_template)") if template_source else None
    if kind == "llama":
        scores = file.get("tokenizer.ggml.scores", np.ndarray)
        if len(scores) != len(tokens):
            raise ModelFormatError(path, f"{len(scores)} tokenizer.ggml.scores for {len(tokens)} tokens")
        outside = [t for t in (config.bos_id, *config.eos_ids) if t is not None and t >= len(tokens)]
        if outside:
            raise ModelFormatError(path, f"special token id {outside[0]} is outside the {len(tokens)} tokens")
        pieces = [t.replace("\u2581", " ").encode("utf-8") for t in tokens]
        tokenizer = Llama2cTokenizer(path, len(tokens), config.bos_id, config.eos_ids,
                                     pieces=pieces, scores=np.asarray(scores, np.float32),
                                     add_dummy_prefix=file.get("tokenizer.ggml.add_space_prefix", bool, True),
                                     control_ids=tuple(int(i) for i in np.flatnonzero(np.asarray(types) == CONTROL))
                                     or (config.bos_id, *config.eos_ids),  # (no types: BOS and EOS)
                                     add_bos=file.get("tokenizer.ggml.add_bos_token", bool, True))
        tokenizer.chat_template = template
        return tokenizer
    if kind != "gpt2":
        raise ModelFormatError(path, f"tokenizer type {kind!r} is not supported (halo reads gpt2 and llama)")
    return HFTokenizer(path, config.vocab_size, config.bos_id, config.eos_ids,
                       backend=_byte_level_bpe(file, tokens, types), chat_template=template,
                       add_bos=file.get("tokenizer.ggml.add_bos_token", bool, False))


def _byte_level_bpe(file, tokens: list[str], types: np.ndarray):
    try:
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as _Tokenizer
    except ImportError as e:  # pragma: no cover - depends on the installed extras
        raise ModelFormatError(file.path, "a GGUF tokenizer needs the 'tokenizers' package",
                               "pip install 'halo-edge[master]'") from e
    pre = file.get("tokenizer.ggml.pre", str, default="default")
    merges = file.get("tokenizer.ggml.merges", list, default=[])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        splitter = byte_level
    elif pre == "smollm":  # digits one by one, then GPT-2's split (SmolLM's tokenizer.json; llama.cpp's "smollm")
        splitter = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "llama3", "llama-v3"):
        splitter = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        raise ModelFormatError(file.path, f"tokenizer.ggml.pre = {pre!r} is not supported (halo splits text for: "
                               f"{', '.join(GGUF_PRE_TOKENIZERS)})")
    try:
        backend = _Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                        [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
        backend.pre_tokenizer = splitter
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, k in zip(tokens, types) if k == CONTROL])
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # the library's own untyped errors, and Rust panics (PanicException is no Exception)
        raise ModelFormatError(file.path, f"the tokenizer's vocabulary and merges do not fit together: "
                               f"{type(e).__name__}: {e}") from None
    return backend
