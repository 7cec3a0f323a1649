"""Chat templates: a model's own Jinja2 template turns a conversation into the prompt text it was tuned on.

Rendered as transformers renders them (`apply_chat_template`): a sandboxed Jinja2 environment with
trim_blocks/lstrip_blocks and loop controls, `raise_exception`, a `tojson` that keeps non-ASCII text,
and the special tokens (bos_token, eos_token) as variables. The template is untrusted text from a
model file: the sandbox is immutable and underscore attributes stay out of reach.
"""

from __future__ import annotations

import json
from datetime import datetime

from halo.errors import ConfigError, ModelFormatError

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplate:
    """A compiled chat template; `render(messages)` gives the prompt text (special tokens included)."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None, origin: str = ""):
        try:
            import jinja2
            import jinja2.ext  # loopcontrols; `import jinja2` alone does not load the submodule
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover - depends on the installed extras
            raise ModelFormatError(origin or "chat template", "rendering a chat template needs jinja2",
                                   "pip install 'halo-edge[master]'") from e
        self.source, self.bos_token, self.eos_token, self.origin = source, bos_token, eos_token, origin

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ModelFormatError(origin or "chat template", f"the chat template does not parse: {e} (line {e.lineno})") from e
        except (RecursionError, SyntaxError) as e:  # nested beyond the parser's stack or Python's 20 static blocks
            raise ModelFormatError(origin or "chat template", f"the chat template is nested too deeply: {e}") from None
        self._errors = (jinja2.exceptions.TemplateError,)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation [{"role": ..., "content": ...}, ...]; with
        add_generation_prompt, it ends where the assistant's answer begins."""
        checked = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise ConfigError(f"chat message {i} must be a dict with string 'role' and 'content', got {message!r}")
            checked.append(dict(message))
        try:
            return self._template.render(messages=checked, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except self._errors as e:
            raise ConfigError(f"the model's chat template refused the conversation: {e}") from e

    def __repr__(self) -> str:
        return f"ChatTemplate({self.origin or 'inline'}, {len(self.source)} characters)"


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """The model's chat template around a conversation, ending where the assistant's answer begins
    (generate --chat and the server's chat completions)."""
    template = tokenizer.chat_template
    if template is None:
        raise ConfigError("this model has no chat template (a GGUF's tokenizer.chat_template, or a Hugging Face "
                          "directory's tokenizer_config.json / chat_template.jinja): drop --chat/--system")
    text = template.render(messages, add_generation_prompt=True)
    bos = template.bos_token
    if bos and getattr(tokenizer, "add_bos", False) and text.startswith(bos):
        text = text[len(bos):]  # the tokenizer puts BOS first itself: once, not twice
    return text
