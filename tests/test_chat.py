"""Chat templates render as transformers renders them; bad templates and conversations fail clearly."""

import json

import pytest

from halo.errors import ConfigError, ModelFormatError
from halo.model.chat import ChatTemplate

# SmolLM2-Instruct's template (as its GGUF metadata and tokenizer_config.json carry it)
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
           "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# a Llama-2-style template: bos/eos variables, raise_exception, whitespace control, loop controls
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
          "{% set messages = messages[1:] %}{% endif %}"
          "{% for message in messages %}\n"
          "  {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\n"
          "  {% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}"
          "{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}\n"
          "  {% if loop.index > 8 %}{% break %}{% endif %}\n"
          "{% endfor %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi ünïcode ☃"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "  padded  "}],
]


@pytest.mark.parametrize("template", [SMOLLM2, LLAMA2], ids=["smollm2", "llama2"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendering_equals_transformers(tmp_path, template, generation_prompt):
    pytest.importorskip("transformers")
    from transformers import PreTrainedTokenizerFast

    from hf_models import write_tokenizer

    write_tokenizer(tmp_path, 256)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>",
                                        eos_token="</s>")
    ours = ChatTemplate(template, "<s>", "</s>")
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        assert ours.render(messages, add_generation_prompt=generation_prompt) == expected


def test_hf_directory_tokenizer_carries_its_template(tmp_path):
    pytest.importorskip("tokenizers")
    from halo.model.tokenizer import HFTokenizer

    from hf_models import write_tokenizer

    write_tokenizer(tmp_path, 256)
    plain = HFTokenizer(tmp_path / "tokenizer.json", 320, 0, (1,))
    assert plain.chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA2, "bos_token": "<s>",
                                                                "eos_token": {"content": "</s>"}}))
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json", 320, 0, (1,))
    text = tokenizer.chat_template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    assert text == "<s>[INST] Hi [/INST] Yo </s>"
    (tmp_path / "chat_template.jinja").write_text(SMOLLM2)  # transformers >= 4.50 saves it separately; it wins
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json", 320, 0, (1,))
    assert tokenizer.chat_template.render([{"role": "user", "content": "Hi"}]).endswith("<|im_start|>assistant\n")


def test_template_errors_are_clear():
    with pytest.raises(ModelFormatError, match="does not parse"):
        ChatTemplate("{% for m in messages %}", origin="model.gguf")
    alternate = ChatTemplate(LLAMA2, "<s>", "</s>")
    with pytest.raises(ConfigError, match="roles must alternate"):
        alternate.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ConfigError, match="message 0 must be a dict"):
        alternate.render([{"role": "user", "content": 3}])


def test_the_sandbox_keeps_python_internals_out_of_reach():
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ConfigError):
        escape.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate("{% set _ = messages.append({'role': 'user', 'content': 'injected'}) %}{{ messages | length }}")
    with pytest.raises(ConfigError):
        mutate.render([{"role": "user", "content": "x"}])
