"""llama2.c checkpoints and tokenizers: correct reading and clear errors for bad files."""

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from halo import BUNDLED_MODEL, BUNDLED_TOKENIZER
from halo.errors import ConfigError, ModelFormatError
from halo.model.formats import llama2c
from halo.model.loader import load_tokenizer, load_weights
from halo.model.tokenizer import Llama2cTokenizer

MODEL = Path(str(BUNDLED_MODEL))
TOKENIZER = Path(str(BUNDLED_TOKENIZER))


def test_bundled_header_is_read(stories_weights):
    c = stories_weights.config
    assert (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.max_seq_len) == \
           (64, 172, 5, 8, 4, 512, 512)
    assert c.tied_embeddings and stories_weights.lm_head is stories_weights.tok_embeddings


def copy_with(tmp_path, data: bytes) -> Path:
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    return path


def test_truncated_checkpoint_names_expected_and_found_sizes(tmp_path):
    data = MODEL.read_bytes()
    with pytest.raises(ModelFormatError, match=r"truncated: the header describes 1056540 bytes of weights, the file has 1000000"):
        load_weights(copy_with(tmp_path, data[:1_000_000]))


def test_file_shorter_than_the_header(tmp_path):
    with pytest.raises(ModelFormatError, match="shorter than the 28-byte llama2.c header"):
        load_weights(copy_with(tmp_path, b"\x00" * 10))


def test_versioned_export_magic_is_refused_with_the_fix(tmp_path):
    data = struct.pack("<I", llama2c.EXPORT_MAGIC) + MODEL.read_bytes()[4:]
    with pytest.raises(ModelFormatError, match="--version 0"):
        load_weights(copy_with(tmp_path, data))


def test_nonsense_header_field_is_named(tmp_path):
    data = bytearray(MODEL.read_bytes())
    data[12:16] = struct.pack("<i", -3)  # n_heads
    with pytest.raises(ModelFormatError, match="n_heads=-3 is out of range"):
        load_weights(copy_with(tmp_path, bytes(data)))


def test_shape_inconsistent_header(tmp_path):
    data = bytearray(MODEL.read_bytes())
    data[12:16] = struct.pack("<i", 7)  # n_heads that does not divide dim 64
    with pytest.raises(ModelFormatError, match="dim=64 is not divisible by n_heads=7"):
        load_weights(copy_with(tmp_path, bytes(data)))


def test_trailing_bytes_mean_a_wrong_header(tmp_path):
    with pytest.raises(ModelFormatError, match="unexpected trailing bytes"):
        load_weights(copy_with(tmp_path, MODEL.read_bytes() + b"\x00" * 64))


def test_tokenizer_vocab_mismatch(tmp_path):
    data = bytearray(MODEL.read_bytes())
    data[20:24] = struct.pack("<i", 400)  # vocab 400: also shrinks the weights, so keep the size consistent
    with pytest.raises(ModelFormatError):
        load_weights(copy_with(tmp_path, bytes(data)))
    with pytest.raises(ModelFormatError, match="tokenizer has 512 tokens but the model's vocabulary is 400"):
        Llama2cTokenizer(TOKENIZER, vocab_size=400)


def test_truncated_tokenizer(tmp_path):
    path = tmp_path / "tok.bin"
    path.write_bytes(TOKENIZER.read_bytes()[:3000])
    with pytest.raises(ModelFormatError, match="truncated inside the entry of token|length"):
        Llama2cTokenizer(path, 512)


def test_tokenizer_found_beside_a_copied_checkpoint(tmp_path, stories_weights):
    shutil.copy(MODEL, tmp_path / "stories260K.bin")
    shutil.copy(TOKENIZER, tmp_path / "tok512.bin")
    tokenizer = load_tokenizer(load_weights(tmp_path / "stories260K.bin"))
    assert Path(tokenizer.path) == tmp_path / "tok512.bin"


def reference_encode(tok: Llama2cTokenizer, text: str) -> list[int]:
    """llama2.c's encode, transcribed literally: O(n^2) best-pair scan, leftmost among ties."""
    ids = [tok.piece_id[b" "]] if text else []
    for ch in text:
        b = ch.encode()
        ids += [tok.piece_id[b]] if b in tok.piece_id else [tok.byte_id[x] for x in b]
    while True:
        best, best_i, best_id = -1e10, -1, -1
        for i in range(len(ids) - 1):
            merged = tok.piece_id.get(tok.pieces[ids[i]] + tok.pieces[ids[i + 1]])
            if merged is not None and tok.scores[merged] > best:
                best, best_i, best_id = tok.scores[merged], i, merged
        if best_i < 0:
            return ids
        ids[best_i:best_i + 2] = [best_id]


@pytest.mark.parametrize("text", ["Once upon a time", "", "Hello, world!  Two  spaces.\nNew line",
                                  "Ünïcödé → 日本語 🙂", "aaaaaaaaaaaaaaaaaaaa", "the the the cat sat"])
def test_heap_encoder_equals_llama2c_encoder(text):
    tok = Llama2cTokenizer(TOKENIZER, 512)
    assert tok.encode(text, bos=False) == reference_encode(tok, text)


def test_encode_decode_round_trip_with_byte_fallback():
    tok = Llama2cTokenizer(TOKENIZER, 512)
    text = "Ünïcödé → 日本語 🙂 and a\ttab"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == text


def test_stream_decoder_holds_back_incomplete_utf8():
    tok = Llama2cTokenizer(TOKENIZER, 512)
    ids = tok.encode("🙂", bos=False)
    step = tok.stream()
    pieces = [step(t) for t in ids]
    assert "".join(pieces) + step(None) == "🙂"
    assert all(p in ("", "🙂") for p in pieces)


def test_out_of_vocabulary_id_is_refused():
    tok = Llama2cTokenizer(TOKENIZER, 512)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([600])


def test_weights_are_float32_memory_maps_where_possible(stories_weights):
    assert isinstance(stories_weights.layers[0].wv, np.memmap) or isinstance(stories_weights.layers[0].wv.base, np.memmap)


def test_a_vocabulary_without_bos_or_eos_encodes_and_says_what_an_empty_prompt_needs():
    """A SentencePiece GGUF without bos_token_id put None first (a TypeError at the first pass); one without an EOS id
    was an IndexError when its tokenizer was built."""
    from halo.generation.generate import encode_prompt

    tok = Llama2cTokenizer(TOKENIZER, 512, bos_id=None, eos_ids=())
    assert None not in tok.encode("Once upon a time") and tok.encode("Once upon a time")
    assert tok.encode("") == [] and tok.eos_ids == ()
    with pytest.raises(ConfigError, match="no BOS token: give a prompt"):
        encode_prompt(tok, "", 64)


def test_a_story_ends_at_the_bos_that_begins_the_next_as_llama2c_stops():
    """stories260K never said "eos": it writes BOS (1) after a story, where llama2.c's run.c stops; halo ran on into
    the next story until the token budget or the context ran out."""
    from halo.compute.transformer import Transformer
    from halo.generation.generate import generate

    weights = load_weights(None)
    result = generate(Transformer(weights), load_tokenizer(weights), "", 600)
    assert result.stop_reason == "eos" and len(result.token_ids) == 345
    assert result.text.endswith('You are a good friend."') and "Once upon a time" not in result.text[20:]
