"""SmolLM2-135M-Instruct from its GGUF file against transformers loading the same file (gguf_file=, which
dequantizes to fp32): logits, tokenizer, chat template, known chat answers, 4-bit agreement, and the same
tokens over 1-4 local agents. Needs `halo-master fetch smollm2-135m-instruct` (.ci/run does it)."""

import os
from pathlib import Path

import numpy as np
import pytest

from halo.compute.neuron_groups import GroupLayout
from halo.compute.transformer import Transformer
from halo.errors import ConfigError
from halo.generation.generate import generate
from halo.model.catalog import resolve_model
from halo.model.loader import load_tokenizer, load_weights
from halo.predictors.profiler import split_text

from conftest import SHARED

NAME = "smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant."
# (user message, the greedy answer of transformers' fp32-dequantized model; halo's must equal it)
KNOWN_ANSWERS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Explain what a neural network is in two sentences.",
     "A neural network is a type of machine learning algorithm inspired by the human brain's neural network, "
     "where algorithms are inspired by the structure and function of the human brain's neural network."),
]
HELD_OUT = Path(os.environ.get("HALO_HELD_OUT_TEXT", SHARED / "data" / "tinystories_valid_dev.txt"))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def path() -> Path:
    try:
        return resolve_model(NAME)
    except ConfigError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def weights(path):
    return load_weights(path)


@pytest.fixture(scope="module")
def tokenizer(weights):
    return load_tokenizer(weights)


@pytest.fixture(scope="module")
def reference(path):
    """transformers' model and tokenizer from the same GGUF file (loading takes a minute or two)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="module")
def held_out_tokens(tokenizer) -> list[int]:
    if not HELD_OUT.is_file():
        pytest.skip(f"{HELD_OUT} is missing (set HALO_HELD_OUT_TEXT to the file)")
    _, text = split_text(HELD_OUT.read_text(), 0.8)
    return tokenizer.encode(text, bos=False)


def chat_text(tokenizer, user: str) -> str:
    return tokenizer.chat_template.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])


def chat(tokenizer, user: str) -> list[int]:
    return tokenizer.encode(chat_text(tokenizer, user))


def test_config_from_the_metadata(weights):
    c = weights.config
    assert (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size) == (576, 1536, 30, 9, 3, 49152)
    assert c.tied_embeddings and c.rope_theta == 100000.0 and c.bos_id == 1 and c.eos_ids == (2,)
    assert weights.nbytes() == 96_576_768  # the file's tensor bytes: nothing expanded


def test_fp32_logits_match_transformers(weights, tokenizer, reference):
    from hf_models import reference_logits

    tokens = chat(tokenizer, KNOWN_ANSWERS[1][0])
    prefill, steps, decoded = reference_logits(reference[0], tokens, n_decode=32)
    model = Transformer(weights, "fp32", max_seq_len=256)
    errors = [np.abs(model.forward(tokens, all_logits=True) - prefill).max()]
    errors += [np.abs(model.forward([t]) - expected).max() for t, expected in zip(decoded, steps)]
    assert max(errors) <= 1e-4, max(errors)


def test_tokenizer_and_template_equal_transformers(tokenizer, reference, held_out_tokens):
    _, tok = reference
    _, text = split_text(HELD_OUT.read_text(), 0.8)
    assert held_out_tokens == tok(text, add_special_tokens=False).input_ids
    for sample in ["In 2024, 1,234 cats ate 56.7 kg.", "  leading spaces\tand\ttabs\n\nnew lines", "naïve café ☃ 日本語",
                   "<|im_start|>user\nHi<|im_end|>", "x<|endoftext|>y"]:
        assert tokenizer.encode(sample, bos=False) == tok(sample, add_special_tokens=False).input_ids, sample
        assert tokenizer.decode(tokenizer.encode(sample, bos=False)) == tok.decode(tok(sample).input_ids,
                                                                                  skip_special_tokens=True)
    for user, _ in KNOWN_ANSWERS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        assert tokenizer.chat_template.render(messages) == tok.apply_chat_template(messages, tokenize=False,
                                                                                    add_generation_prompt=True)
        assert chat(tokenizer, user) == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)


@pytest.mark.parametrize("user, answer", KNOWN_ANSWERS)
def test_known_chat_answers(weights, tokenizer, reference, user, answer):
    import torch

    prompt = chat(tokenizer, user)
    with torch.no_grad():
        out = reference[0].generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)
    theirs = out[0, len(prompt):].tolist()
    assert theirs[-1] == 2 and reference[1].decode(theirs[:-1]) == answer  # ends with <|im_end|>
    for fmt in ("fp32", "native"):
        result = generate(Transformer(weights, fmt, max_seq_len=256), tokenizer, chat_text(tokenizer, user), 48)
        assert result.token_ids == theirs[:-1] and result.stop_reason == "eos" and result.text == answer, fmt


def test_native_4bit_agrees_with_transformers_on_held_out_text(weights, reference, held_out_tokens):
    import torch

    window = held_out_tokens[:512]
    with torch.no_grad():
        expected = reference[0](torch.tensor([window])).logits[0].numpy()
    ours = Transformer(weights, "native", max_seq_len=512).forward(window, all_logits=True)
    agreement = np.mean(ours.argmax(-1) == expected.argmax(-1))
    assert agreement >= 0.99 and np.abs(ours - expected).mean() < 0.01, (agreement, np.abs(ours - expected).max())


@pytest.mark.parametrize("n_agents", [1, 2, 3, 4])
def test_local_agents_give_the_single_process_tokens(path, weights, tokenizer, n_agents):
    from halo.distributed import LocalCluster, cluster_model

    prompt = chat_text(tokenizer, KNOWN_ANSWERS[1][0])
    expected = generate(Transformer(weights, "native", max_seq_len=256), tokenizer, prompt, 40).token_ids
    with LocalCluster(n_agents, model_path=str(path)) as cluster:
        model = cluster_model(weights, cluster.endpoints, cluster.key, context=256, fmt="native")
        try:
            assert generate(model, tokenizer, prompt, 40).token_ids == expected
        finally:
            model.close()


def test_the_named_model_comes_with_its_predictors_and_runs_halo_mode(path):
    """`halo-master fetch` brings the model; the package ships the predictors the project trained for that very file
    (halo/assets/predictors/, found by its sha256), so --sync halo needs no training step."""
    import json
    import subprocess
    import sys

    from halo.predictors.store import SHIPPED_PREDICTORS, load_predictors, predictors_path

    found = predictors_path(path)
    assert found.parent == SHIPPED_PREDICTORS and (found / "manifest.json").exists()
    weights = load_weights(str(path))
    assert load_predictors(weights, GroupLayout.for_model(weights.config)).layers == list(range(1, weights.config.n_layers))  # layer 0 is always exact
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--model", NAME, "--chat", "--prompt",
                          KNOWN_ANSWERS[0][0], "--max-new-tokens", "8", "--local-agents", "2", "--sync", "halo",
                          "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["sync"]["settings"]["mode"] == "halo"


def test_a_model_without_predictors_names_what_is_shipped_and_how_to_train(tmp_path):
    from halo.eval.random_checkpoint import write_random_gguf
    from halo.predictors.store import load_predictors

    from gguf_models import TINY

    model = write_random_gguf(tmp_path / "random.gguf", TINY, "Q8_0")
    with pytest.raises(ConfigError, match=r"ships them for: smollm2-135m-instruct, stories260K\); train them: "
                                          r"halo-train-predictors --model .*random.gguf"):
        weights = load_weights(str(model))
        load_predictors(weights, GroupLayout.for_model(weights.config))
