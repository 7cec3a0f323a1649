"""Chat completions through the model's chat template, over 2 local agents, with the official openai client.

The model: a small random Llama written by transformers with a ChatML template in tokenizer_config.json
(its answers are noise, but deterministic: greedy must equal `halo-master generate --chat`). Set
HALO_CHAT_MODEL=PATH (e.g. SmolLM2-135M-Instruct) to run the same check on a real instruction model.
"""

import json
import os
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai", reason="the openai client comes with the dev extra")
pytest.importorskip("uvicorn", reason="halo-master serve needs the serve extra")
pytest.importorskip("transformers", reason="the random checkpoint is written by transformers")

from serve_server import API_KEY, start_server, stop_server  # noqa: E402

CHATML = ("{% for message in messages %}"
          "{% if loop.first and message['role'] == 'assistant' %}{{ raise_exception('the user speaks first') }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QUESTION = "Where do packets go when they are lost?"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    if os.environ.get("HALO_CHAT_MODEL"):
        return os.environ["HALO_CHAT_MODEL"]
    from hf_models import make_checkpoint

    directory = tmp_path_factory.mktemp("chat-model")
    make_checkpoint(directory, seed=5, max_position_embeddings=256)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "bos_token": "<s>",
                                                                 "eos_token": "</s>"}))
    return str(directory)


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    process, url = start_server(tmp_path_factory.mktemp("serve-chat"), "--model", chat_model, "--local-agents", "2",
                                "--model-name", "chat-model")
    yield url
    stop_server(process)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_streamed_chat_equals_the_cli_greedy_chat_output(chat_model, client):
    cli = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--model", chat_model, "--chat", "--prompt",
                          QUESTION, "--max-new-tokens", "24", "--temperature", "0", "--local-agents", "2", "--json"],
                         capture_output=True, text=True, timeout=180)
    assert cli.returncode == 0, cli.stderr
    expected = json.loads(cli.stdout)
    assert expected["token_ids"], "the model answered nothing: the comparison would be empty"
    stream = client.chat.completions.create(model="chat-model", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [expected["stop_reason"] == "eos" and "stop" or "length"]
    assert chunks[-1].usage.completion_tokens == len(expected["token_ids"])
    assert chunks[-1].usage.prompt_tokens == len(expected["prompt_token_ids"])


def test_non_streamed_chat_with_a_system_message(client):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    a = client.chat.completions.create(model="chat-model", messages=messages, max_tokens=8, temperature=0)
    assert a.object == "chat.completion" and a.choices[0].message.role == "assistant"
    assert a.usage.completion_tokens <= 8 and a.usage.prompt_tokens > 10
    with_parts = client.chat.completions.create(
        model="chat-model", max_tokens=8, temperature=0,
        messages=[messages[0], {"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    assert with_parts.choices[0].message.content == a.choices[0].message.content


@pytest.mark.skipif(bool(os.environ.get("HALO_CHAT_MODEL")), reason="the refusal is this file's own template's")
def test_a_conversation_the_template_refuses_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="the user speaks first"):
        client.chat.completions.create(model="chat-model", messages=[{"role": "assistant", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="text only"):
        client.chat.completions.create(model="chat-model", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}])
