"""Tokenizers: llama2.c's score-ordered BPE, and Hugging Face tokenizer.json via `tokenizers`.

Both satisfy `Tokenizer`: encode text to ids (optionally after BOS), decode ids to text, and
`stream()` an incremental decoder for printing tokens as they are generated.
"""

from __future__ import annotations

import codecs
import heapq
import os
import re
from pathlib import Path
from typing import Callable, Protocol

from .errors import ModelFormatError
from .formats import llama2c

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

    def encode(self, text: str, bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], at_start: bool = True) -> str: ...

    def stream(self, at_start: bool = True) -> Callable[[int], str]: ...


class Llama2cTokenizer:
    """llama2.c's encoder: dummy space, characters (byte fallback), then greedy best-score merges.

    Merges use a heap over adjacent pairs, so encoding is O(n log n) instead of llama2.c's O(n^2);
    ties go to the leftmost pair, as in llama2.c.
    """

    def __init__(self, path: str | os.PathLike, vocab_size: int, bos_id: int = 1, eos_id: int = 2):
        self.path = Path(path)
        self.pieces, self.scores = llama2c.read_tokenizer(path, vocab_size)
        self.vocab_size = len(self.pieces)
        self.bos_id, self.eos_ids, self.unk_id = bos_id, (eos_id,), 0
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
        ids = [self.bos_id] if bos else []
        if not text:
            return ids
        symbols: list[int] = [self.piece_id[b" "]] if b" " in self.piece_id else []
        for ch in valid_text(text):
            encoded = ch.encode("utf-8")
            if encoded in self.piece_id:
                symbols.append(self.piece_id[encoded])
            else:
                symbols.extend(self.byte_id[b] for b in encoded)
        return ids + self._merge(symbols)

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
                if data.startswith(b" "):
                    data = data[1:]  # the dummy prefix the encoder added
            return decoder.decode(data)

        return step


class HFTokenizer:
    """A Hugging Face tokenizer.json, through the `tokenizers` library."""

    def __init__(self, path: str | os.PathLike, model_vocab_size: int, bos_id: int | None, eos_ids: tuple[int, ...]):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:  # pragma: no cover - depends on the installed extras
            raise ModelFormatError(path, "reading tokenizer.json needs the 'tokenizers' package",
                                   "pip install 'halo-edge[master]'") from e
        self.path = Path(path)
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # the library's own untyped errors, and Rust panics (PanicException is no Exception)
            raise ModelFormatError(path, f"cannot parse tokenizer.json: {type(e).__name__}: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        if self.vocab_size > model_vocab_size:
            raise ModelFormatError(path, f"tokenizer has {self.vocab_size} tokens but the model's embedding has only "
                                   f"{model_vocab_size} rows", "use the tokenizer that belongs to this checkpoint")
        self.model_vocab_size = model_vocab_size  # ids the model can emit; those the tokenizer lacks decode to ""
        self.bos_id, self.eos_ids = bos_id, eos_ids

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self._tok.encode(valid_text(text), add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids

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
