"""GGUF files: the reader, compact blocks and their kernels, neuron-group slicing, and bad input."""

import numpy as np
import pytest

from halo.cli.master import main
from halo.compute.linear import CompactProjection, make_projection
from halo.compute.neuron_groups import AttentionShard, GroupLayout, LmHeadShard, MlpShard
from halo.compute.transformer import Transformer
from halo.errors import ConfigError, ModelFormatError
from halo.model.loader import load_config, load_tokenizer, load_weights
from halo.model.ops import Rotary, rmsnorm
from halo.model.quant import KERNEL_CODECS, QuantizedMatrix

from gguf_models import TINY, raw_gguf, tiny_gguf

TYPES = ("Q4_0", "Q4_1", "Q8_0")


def blocks_of(w: np.ndarray, qtype: str) -> QuantizedMatrix:
    import gguf
    import gguf.quants

    codec = KERNEL_CODECS[qtype]
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return QuantizedMatrix(codec, data.reshape(w.shape[0], -1, codec.type_size), name="test.weight")


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantization_is_llama_cpps(qtype):
    import gguf
    import gguf.quants

    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32) + 0.3
    m = blocks_of(w, qtype)
    reference = gguf.quants.dequantize(m.blocks.reshape(24, -1), gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(m.dequantize(), reference)
    assert np.array_equal(m[[5, 2]], reference[[5, 2]]) and np.array_equal(m[7], reference[7])  # row lookups


def random_k_blocks(qtype: str, rows: int, k: int, seed: int = 0) -> QuantizedMatrix:
    """K-quant super-blocks of random bytes with sane float16 scales (gguf cannot quantize K-quants)."""
    codec = KERNEL_CODECS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, k // 256, codec.type_size), dtype=np.uint8)
    scale_at = (0, 2) if qtype == "Q4_K" else (208,)
    for at in scale_at:
        blocks[..., at:at + 2] = (rng.random((rows, k // 256, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return QuantizedMatrix(codec, blocks, name="k.weight")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_map_onto_the_kernel_exactly(qtype):
    import gguf
    import gguf.quants

    m = random_k_blocks(qtype, 24, 512)
    reference = gguf.quants.dequantize(m.blocks.reshape(24, -1), gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(m.dequantize(), reference)
    x = np.random.default_rng(3).standard_normal((2, 512)).astype(np.float32)
    exact = x @ reference.T
    y = CompactProjection([m], accuracy_level=1)(x)[0]  # the kernel form, fp32 activations
    assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()
    assert np.abs(make_projection([m], "native")(x)[0] - exact).max() <= 1e-3 * np.abs(exact).max()
    unit = m.codec.unit  # columns are cut in sub-blocks: 32 (Q4_K) or 16 (Q6_K)
    cols = np.r_[unit:2 * unit, 300 - 300 % unit:300 - 300 % unit + unit]
    part = m.take_rows([3, 1]).take_cols(cols)
    assert np.array_equal(part.dequantize(), reference[[3, 1]][:, cols])
    xs = x[:, cols]
    assert np.abs(CompactProjection([part], accuracy_level=1)(xs)[0] - xs @ reference[[3, 1]][:, cols].T).max() < 1e-4
    with pytest.raises(ConfigError, match=f"split {qtype} blocks of {unit}"):
        m.take_cols(np.arange(unit // 2))


@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_computes_the_files_blocks_exactly(qtype):
    rng = np.random.default_rng(1)
    a, b = blocks_of(rng.standard_normal((40, 128)).astype(np.float32), qtype), \
        blocks_of(rng.standard_normal((24, 128)).astype(np.float32) + 0.5, qtype)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    exact = [x @ m.dequantize().T for m in (a, b)]
    # accuracy level 1 (fp32 activations): the blocks as stored, to float rounding
    for y, e in zip(CompactProjection([a, b], accuracy_level=1)(x), exact):
        assert np.abs(y - e).max() <= 1e-5 * np.abs(e).max()
    # the default (int8 activations per block of 32 in two terms; halo's C kernel where built): within about 1 % of
    # the output's scale
    for y, e in zip(make_projection([a, b], "native")(x), exact):
        assert y.shape == e.shape and np.abs(y - e).max() <= 0.02 * np.abs(e).max()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_halos_kernel_computes_what_matmulnbits_computes(qtype, monkeypatch):
    """Where the package has halo's C kernel every compact projection runs on it (wide ones too: a shard computes as
    the single process does); it computes MatMulNBits' quantity, int8 activations in two terms, so the two agree
    far inside the activations' own rounding (1/64516 of a block's range) and both sit within 1e-3 of the file's
    weights in float32."""
    from halo.compute import linear

    if not linear.C_KERNEL_VECTORIZED:
        pytest.skip("halo._nbits not built, or without a vector path on this CPU: MatMulNBits computes every kernel")
    rng = np.random.default_rng(4)
    m = blocks_of(rng.standard_normal((300, 2048)).astype(np.float32), qtype)
    x = rng.standard_normal((3, 2048)).astype(np.float32)
    exact = x @ m.dequantize().T
    in_c = CompactProjection([m])
    assert all(kernel.in_c for kernel in in_c.kernels)
    monkeypatch.setattr(linear, "PREFER_C_KERNEL", False)
    sessions = CompactProjection([m])
    assert not any(kernel.in_c for kernel in sessions.kernels)
    ours, theirs = in_c(x)[0], sessions(x)[0]
    scale = np.abs(exact).max()
    assert np.abs(ours - exact).max() <= 1e-3 * scale and np.abs(theirs - exact).max() <= 1e-3 * scale
    assert np.abs(ours - theirs).max() <= 2e-4 * scale


def test_selections_are_lazy_and_cut_whole_blocks():
    w = np.random.default_rng(2).standard_normal((16, 128)).astype(np.float32)
    m = blocks_of(w, "Q4_1")
    full = m.dequantize()
    rows, cols = np.array([9, 3, 4]), np.r_[64:96, 0:32]
    part = m.take_rows(rows).take_cols(cols)
    assert part.blocks is m.blocks and part.shape == (3, 64) and part.nbytes == 3 * 2 * 20
    assert np.array_equal(part.dequantize(), full[rows][:, cols])
    assert np.array_equal(m.columns_float32([3, 70, 71]), full[:, [3, 70, 71]])
    with pytest.raises(ConfigError, match="test.weight: these 16 columns split Q4_1 blocks of 32"):
        m.take_cols(np.arange(16))
    with pytest.raises(ConfigError, match="split Q4_1 blocks"):
        m.take_cols(np.r_[1:33])


@pytest.mark.parametrize("qtype", ["F32", "F16", *TYPES])
def test_reader_gives_the_config_and_the_stored_types(tmp_path, qtype):
    path = tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype)
    weights = load_weights(path)
    c = weights.config
    assert (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size) == (64, 256, 2, 2, 1, 320)
    assert c.tied_embeddings and weights.lm_head is weights.tok_embeddings and c.bos_id == 0 and c.eos_ids == (1,)
    assert load_config(path) == c
    w_down = weights.layers[0].w_down
    assert isinstance(w_down, np.ndarray if qtype in ("F32", "F16") else QuantizedMatrix)
    assert isinstance(w_down, np.memmap) == (qtype == "F32")  # F32 is a zero-copy view of the file


def test_gguf_reads_the_same_model_as_its_hugging_face_directory(tmp_path):
    """One checkpoint, two files: llama.cpp's interleaved q/k rows come back in rotate-half order."""
    pytest.importorskip("transformers")
    from gguf_models import gguf_from_hf
    from hf_models import make_checkpoint

    reference = make_checkpoint(tmp_path / "hf", seed=5, num_attention_heads=4, num_key_value_heads=2)
    path = gguf_from_hf(tmp_path / "model.gguf", reference)
    tokens = [3, 9, 120, 7, 44]
    ours = Transformer(load_weights(path)).forward(tokens, all_logits=True)
    theirs = Transformer(load_weights(tmp_path / "hf")).forward(tokens, all_logits=True)
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("qtype", ["F32", *TYPES])
def test_logits_match_transformers_loading_the_same_gguf(tmp_path, qtype):
    """transformers dequantizes the file to fp32 (gguf_file=); halo fp32 agrees to 1e-4 over prefill and
    16 decode steps; the 4-bit/8-bit kernels stay close and pick the same next tokens."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch
    from transformers import LlamaForCausalLM

    from hf_models import reference_logits

    path = tiny_gguf(tmp_path / "model.gguf", qtype, seed=3)
    reference = LlamaForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    tokens = [0, 5, 17, 99, 3, 250, 42, 7]
    prefill, steps, decoded = reference_logits(reference, tokens, n_decode=16)
    weights = load_weights(path)
    for fmt, tolerance in (("fp32", 1e-4), ("native", 0.1)):
        model = Transformer(weights, fmt)
        errors = [np.abs(model.forward(tokens, all_logits=True) - prefill).max()]
        errors += [np.abs(model.forward([t]) - expected).max() for t, expected in zip(decoded, steps)]
        assert max(errors) <= tolerance * (1 if fmt == "fp32" else np.abs(prefill).max()), (fmt, max(errors))


@pytest.mark.parametrize("qtype", TYPES)
def test_neuron_group_shards_of_compact_blocks_sum_to_the_whole(tmp_path, qtype):
    weights = load_weights(tiny_gguf(tmp_path / "model.gguf", qtype, seed=4))
    layout = GroupLayout.for_model(weights.config)
    assert layout.mlp_group_size % 32 == 0 and layout.head_dim % 32 == 0
    layer, c = weights.layers[0], weights.config
    x = rmsnorm(np.random.default_rng(5).standard_normal((3, c.dim)).astype(np.float32), layer.attn_norm, c.norm_eps)
    rotary = Rotary(c, 16)
    whole = AttentionShard(layer, layout, range(c.n_heads), 16, "native").forward(x, 0, rotary)
    parts = sum(AttentionShard(layer, layout, [h], 16, "native").forward(x, 0, rotary) for h in range(c.n_heads))
    assert np.abs(parts - whole).max() <= 1e-5 * np.abs(whole).max()
    groups = list(range(layout.n_mlp_groups))
    whole = MlpShard(layer, layout, groups, "native").forward(x)
    split = [groups[0::3], groups[1::3], groups[2::3]]  # non-contiguous sets: W_down blocks gathered
    parts = sum(MlpShard(layer, layout, g, "native").forward(x) for g in split)
    assert np.abs(parts - whole).max() <= 1e-5 * np.abs(whole).max()
    head = LmHeadShard(weights.lm_head, layout, [1], "native")
    assert head.forward(x).shape == (3, 64)


def test_a_group_boundary_inside_a_block_is_refused_in_native_and_dequantized_otherwise(tmp_path):
    weights = load_weights(tiny_gguf(tmp_path / "model.gguf", "Q4_0", seed=6))
    layout = GroupLayout.for_model(weights.config, mlp_group_size=48)  # 48 = 1.5 blocks
    with pytest.raises(ConfigError, match="blk.0.ffn_down.weight: these 48 columns split Q4_0 blocks of 32"):
        MlpShard(weights.layers[0], layout, [0], "native")
    x = np.ones((1, 64), np.float32)
    whole = MlpShard(weights.layers[0], layout, range(layout.n_mlp_groups), "fp32").forward(x)
    parts = sum(MlpShard(weights.layers[0], layout, [g], "fp32").forward(x) for g in range(layout.n_mlp_groups))
    assert np.allclose(parts, whole, atol=1e-5)


def test_native_keeps_weights_compact_and_int8_requantizes(tmp_path):
    weights = load_weights(tiny_gguf(tmp_path / "model.gguf", "Q4_1", seed=7))
    native, fp32, int8 = (Transformer(weights, fmt) for fmt in ("native", "fp32", "int8"))
    assert native.weight_nbytes() < 0.4 * fp32.weight_nbytes()
    tokens = [0, 9, 8, 7, 6, 5, 4, 3, 2, 11, 12, 13]
    reference = fp32.forward(tokens, all_logits=True).argmax(-1)
    for model in (native, int8):
        assert np.mean(model.forward(tokens, all_logits=True).argmax(-1) == reference) >= 0.9


def test_other_block_types_dequantize_for_fp32_and_are_refused_natively(tmp_path):
    path = raw_gguf(tmp_path / "q5k.gguf", {"blk.1.ffn_down.weight": "Q5_K"})
    weights = load_weights(path)
    assert Transformer(weights, "fp32").forward([1, 2]).shape == (320,)
    with pytest.raises(ConfigError, match="unsupported type Q5_K in tensor blk.1.ffn_down.weight for --weights native"):
        Transformer(weights, "native")
    # a Q4_K_M-style mix (Q4_K, Q6_K for W_down, F32 elsewhere) runs natively
    mixed = load_weights(raw_gguf(tmp_path / "q4km.gguf", {"blk.0.ffn_down.weight": "Q6_K",
                                                           "blk.1.ffn_down.weight": "Q4_K"}))
    assert Transformer(mixed, "native").forward([1, 2]).shape == (320,)


def test_the_tokenizer_comes_from_the_metadata(tmp_path):
    weights = load_weights(tiny_gguf(tmp_path / "model.gguf", "Q8_0"))
    tokenizer = load_tokenizer(weights)
    ids = tokenizer.encode("Hi there</s>")
    assert ids[0] == 0 and ids[-1] == 1  # BOS (add_bos_token) and a control token kept whole
    assert tokenizer.decode(ids) == "Hi there"
    assert tokenizer.chat_template is None


BAD_FILES = {
    "truncated": "truncated: tensor .* ends past the end of the file",
    "header-cut": "truncated: the header ends inside",
    "magic": "not a GGUF file: it starts with b'GGML'",
    "unsupported-type": "unsupported type Q8_1 in tensor blk.0.attn_q.weight",
    "architecture": "unsupported architecture 'qwen2'",
    "missing-tensor": "tensor blk.1.ffn_up.weight is missing",
    "no-tokenizer": "the file carries no tokenizer",
}


def bad_file(tmp_path, kind):
    good = tiny_gguf(tmp_path / "good.gguf", "Q4_0")
    data = good.read_bytes()
    path = tmp_path / f"{kind}.gguf"
    if kind == "truncated":
        path.write_bytes(data[:-100])
    elif kind == "header-cut":
        path.write_bytes(data[:200])
    elif kind == "magic":
        path.write_bytes(b"GGML" + data[4:])
    elif kind == "unsupported-type":
        raw_gguf(path, {"blk.0.attn_q.weight": "Q8_1"})
    elif kind == "architecture":
        raw_gguf(path, arch="qwen2")
    elif kind == "missing-tensor":
        raw_gguf(path, skip=("blk.1.ffn_up.weight",))
    elif kind == "no-tokenizer":
        raw_gguf(path, tokenizer=False)
    return path


@pytest.mark.parametrize("kind", BAD_FILES)
def test_bad_files_fail_with_one_clear_line(tmp_path, kind, capsys):
    path = bad_file(tmp_path, kind)
    with pytest.raises((ModelFormatError, ConfigError), match=BAD_FILES[kind]):
        load_tokenizer(load_weights(path))
    rc = main(["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("halo-master: error: ") and str(path) in err
    assert "Traceback" not in err


@pytest.mark.parametrize("qtype", TYPES)
def test_random_llama_gguf_for_benchmarks(tmp_path, qtype):
    from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf

    cfg = dict(TINYLLAMA_1_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=300,
               num_attention_heads=2, num_key_value_heads=1)  # TinyLlama's settings, a tiny shape
    weights = load_weights(write_random_gguf(tmp_path / "random.gguf", cfg, qtype))
    assert not weights.config.tied_embeddings and weights.lm_head.codec.name == qtype
    assert all(isinstance(getattr(layer, name), QuantizedMatrix) and getattr(layer, name).codec.name == qtype
               for layer in weights.layers for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    tokenizer = load_tokenizer(weights)
    logits = Transformer(weights, "native").forward(tokenizer.encode("random text"))
    assert logits.shape == (300,) and np.isfinite(logits).all()
    # llama.cpp refuses a BPE vocabulary without merges ("cannot find tokenizer merges in model file": llama-bench
    # failed to load these files), and GGUF drops an empty array: one merge is written, and used
    import gguf

    field = gguf.GGUFReader(str(tmp_path / "random.gguf")).fields["tokenizer.ggml.merges"]
    assert [bytes(field.parts[i]).decode() for i in field.data] == ["~ ~"]
    assert len(tokenizer.encode("~~", bos=False)) == 1 and tokenizer.decode(tokenizer.encode("a~~b", bos=False)) == "a~~b"


def test_sentencepiece_style_vocabularies_use_the_llama2c_encoder(tmp_path):
    """tokenizer.ggml.model = llama (TinyLlama, Llama 2, Mistral GGUFs): pieces with U+2581 for spaces, scores,
    byte pieces. stories260K's vocabulary written that way encodes exactly as its tokenizer.bin does, and as
    transformers' tokenizer from the same GGUF."""
    from halo import BUNDLED_TOKENIZER
    from halo.model.formats.llama2c import read_tokenizer
    from halo.model.tokenizer import Llama2cTokenizer

    pieces, scores = read_tokenizer(str(BUNDLED_TOKENIZER), 512)
    tokens = [p.decode("utf-8").replace(" ", "\u2581") for p in pieces]
    kinds = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else 1 for t in tokens]

    def spm(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores.tolist())
        writer.add_token_types(kinds)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)

    path = raw_gguf(tmp_path / "spm.gguf", tokenizer=spm, vocab_size=512)
    ours = load_tokenizer(load_weights(path))
    reference = Llama2cTokenizer(str(BUNDLED_TOKENIZER), 512)
    texts = ["Once upon a time, there was a little girl named Lily.", "She said: \"Hi!\"\n\nThe end. 42 ünï"]
    for text in texts:
        assert ours.encode(text) == reference.encode(text) and ours.decode(ours.encode(text)) == text
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in texts:
        assert ours.encode(text) == theirs(text).input_ids, text


def test_a_large_random_gguf_is_written_a_run_of_rows_at_a_time(tmp_path, monkeypatch):
    """The Llama-3.1-8B shape's LM head is 2.1 GB as float32: streamed, each matrix is generated and quantized a run of
    rows at a time, and the rows' blocks land where a whole-matrix write puts them."""
    from halo.eval import random_checkpoint as rc

    monkeypatch.setattr(rc.RowChunks, "ROWS", 7)  # runs that do not divide the rows
    cfg = dict(rc.LLAMA_3_1_8B, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=300)
    streamed = load_weights(rc.write_random_gguf(tmp_path / "streamed.gguf", cfg, "Q4_0", seed=3, streamed=True))
    assert streamed.config.rope_theta == 500000.0 and streamed.config.n_kv_heads == 1
    head = streamed.lm_head.dequantize()
    rng = np.random.default_rng(3)
    expected = {}
    for name, shape in rc.llama_tensor_shapes(cfg).items():  # the same draws, in the same order, whole
        rows = [rng.standard_normal((min(7, shape[0] - a), *shape[1:]), dtype=np.float32) * 0.02
                for a in range(0, shape[0], 7)] if len(shape) > 1 else [np.ones(shape, np.float32)]
        expected[name] = np.concatenate(rows) if len(shape) > 1 else rows[0]
    import gguf.quants

    want = gguf.quants.dequantize(gguf.quants.quantize(expected["lm_head.weight"], gguf.GGMLQuantizationType.Q4_0),
                                  gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(head, want)


@pytest.mark.parametrize("block_count, said", [
    (1, r"stores layers \[1\] past llama.block_count=1"),  # ran one layer of two, other tokens, exit 0
    (True, r"metadata llama.block_count=True is not a int"),  # a bool was taken for the integer 1
])
def test_a_block_count_that_disagrees_with_the_tensors_is_refused(tmp_path, block_count, said):
    from gguf_models import raw_gguf

    path = raw_gguf(tmp_path / "model.gguf", block_count=block_count)
    with pytest.raises(ModelFormatError, match=said):
        load_weights(path)


def test_a_sentencepiece_gguf_chat_keeps_its_control_tokens_whole(tmp_path):
    """--chat on a SentencePiece ("llama") GGUF put BOS in twice, the template's one spelt out as '<', 's', '>'
    (and a "</s>" between turns the same way): a prompt the model was never tuned on, without a word."""
    from gguf_models import raw_gguf

    from halo.model.chat import chat_prompt

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581a", "[INST]"]

    def vocabulary(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(pieces)
        writer.add_token_scores([0.0] * len(pieces))
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1, 1])  # unknown, control x2, bytes, normal
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_chat_template("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{{ eos_token }}"
                                 "{% endfor %}")

    weights = load_weights(raw_gguf(tmp_path / "spm.gguf", tokenizer=vocabulary))
    tokenizer = load_tokenizer(weights)
    ids = tokenizer.encode(chat_prompt(tokenizer, [{"role": "user", "content": "a"}]))
    assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 1, ids  # BOS once, the template's "</s>" whole
    plain = tokenizer.encode("a", bos=False)
    assert tokenizer.encode("a</s>a", bos=False) == plain + [2] + plain  # (the dummy space again after it, as llama.cpp)
