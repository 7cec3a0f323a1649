"""The project's known answer: greedy decoding of the bundled stories260K from BOS."""

import json
import subprocess
import sys

from halo.compute.transformer import Transformer
from halo.generation.generate import generate
from halo.model.loader import load_tokenizer


def test_cli_reproduces_the_known_answer_token_for_token(known_answer):
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--prompt", "", "--max-new-tokens", "256",
                          "--temperature", "0", "--json"], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result["text"] == known_answer
    assert len(result["token_ids"]) == 256
    assert result["timings"]["mean_ms_per_output_token"] > 0


def test_known_answer_tokens_equal_the_encoded_text(stories_weights, known_answer):
    tokenizer = load_tokenizer(stories_weights)
    result = generate(Transformer(stories_weights), tokenizer, "", 256)
    assert tokenizer.encode(known_answer, bos=False) == result.token_ids


def test_prompt_continuation_is_the_known_text(stories_weights, known_answer):
    tokenizer = load_tokenizer(stories_weights)
    prompt = "Once upon a time"
    assert tokenizer.encode(known_answer, bos=False)[:4] == tokenizer.encode(prompt, bos=False)
    result = generate(Transformer(stories_weights), tokenizer, prompt, 256 - 4)
    assert result.text == known_answer[len(prompt):]


def test_streamed_text_equals_the_final_text(stories_weights, known_answer):
    pieces = []
    result = generate(Transformer(stories_weights), load_tokenizer(stories_weights), "", 256, on_text=pieces.append)
    assert "".join(pieces) == result.text == known_answer
