"""The OpenAI wire format: request validation, errors, responses and stream chunks.

Requests are pydantic models: unknown fields that clients routinely send (user, logit_bias left empty,
presence_penalty 0, ...) are accepted and ignored; what halo cannot honour (n > 1, logprobs, tools,
non-zero penalties, a logit_bias, echo, suffix, best_of > 1) is a 400 that says so, never silently dropped.
Sampling: temperature (0 = greedy; default 1 as in OpenAI), top_p, seed (default: a fresh one per
request), plus top_k as llama.cpp's server accepts it. max_tokens (or max_completion_tokens) defaults
to the rest of the context and is cut to it (finish_reason "length").
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from halo.errors import HaloError
from halo.generation.sampling import SamplingSettings


class ServeError(HaloError):
    """An error for the client, with its HTTP status and OpenAI error type/code."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param

    def to_json(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(ServeError):
    status, type = 400, "invalid_request_error"


class Unauthorized(ServeError):
    status, type = 401, "authentication_error"


class Forbidden(ServeError):
    status, type = 403, "invalid_request_error"


class NotFound(ServeError):
    status, type = 404, "invalid_request_error"


class PayloadTooLarge(ServeError):
    status, type = 413, "invalid_request_error"


class UnsupportedMediaType(ServeError):
    status, type = 415, "invalid_request_error"


class QueueFull(ServeError):
    status, type = 429, "rate_limit_error"


class ClusterUnavailable(ServeError):
    status, type = 503, "server_error"


class RequestTimeout(ServeError):
    status, type = 504, "timeout_error"


# what clients may send only at its neutral value: field -> (is neutral, why not)
UNSUPPORTED = {
    "n": (lambda v: v is None or v == 1 and v is not True, "n must be 1: halo generates one choice per request"),
    "best_of": (lambda v: v is None or v == 1 and v is not True, "best_of must be 1: halo generates one choice per request"),
    "presence_penalty": (lambda v: not v, "presence_penalty is not supported (send 0 or leave it out)"),
    "frequency_penalty": (lambda v: not v, "frequency_penalty is not supported (send 0 or leave it out)"),
    "logprobs": (lambda v: v is None or v is False, "logprobs are not supported"),  # (completions' 0 asks for them)
    "top_logprobs": (lambda v: not v, "logprobs are not supported"),
    "echo": (lambda v: not v, "echo is not supported"),
    "suffix": (lambda v: not v, "suffix (insertion) is not supported"),
    "tools": (lambda v: not v, "tools / function calling are not supported by this server"),
    "functions": (lambda v: not v, "tools / function calling are not supported by this server"),
    "response_format": (lambda v: not v or isinstance(v, dict) and v.get("type") == "text",
                        "only text responses are supported"),  # (a string or list was an AttributeError: a 500)
    "logit_bias": (lambda v: not v, "logit_bias is not supported (send {} or leave it out)"),
}


class Unsupported(ValueError):
    """A field sent at a value halo cannot honour; `field` names it (a model-level check has no location)."""

    def __init__(self, field: str, why: str):
        super().__init__(why)
        self.field = field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data):
        if isinstance(data, dict):
            for name, (neutral, why) in UNSUPPORTED.items():
                if name in data and not neutral(data[name]):
                    raise Unsupported(name, why)
        return data

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2 ** 64)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: bool = Field(default=False, strict=True)  # true or false, not "yes"
    stream_options: dict[str, Any] | None = None

    @field_validator("temperature", "top_p", "top_k", "stream", mode="before")
    @classmethod
    def _null_is_the_default(cls, value, info):
        """OpenAI's clients send null for a field left unset: it means the default."""
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def sampling(self) -> SamplingSettings:
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(4), "little")
        return SamplingSettings(self.temperature, self.top_k, self.top_p, seed)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Content as plain text; a list of parts may hold only text parts (no images, no audio)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"message content part of type {part.get('type')!r}: this model reads text only",
                                 "unsupported_content", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("one prompt per request (send a list of one string, or a string)")
            return value[0]
        return value

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens


def parse(model: type[BaseModel], body: bytes):
    """The request body as `model`, or a BadRequest naming the first offending field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or getattr(first.get("ctx", {}).get("error"), "field", None)
        if first["type"] == "json_invalid":
            raise BadRequest(f"the body is not valid JSON: {first['msg']}", "invalid_json") from None
        message = first["msg"].removeprefix("Value error, ")
        raise BadRequest(f"{where}: {message}" if where else message, "invalid_value", where) from None


# ---- responses ----------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Shaper:
    """Responses and stream chunks of one request, chat or text completion, in OpenAI's shapes."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, obj: str, choice: dict) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "halo", "choices": [choice]}

    def response(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(self.object, choice), "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", choice)
        return self._envelope("text_completion", {"index": 0, "text": text or "", "logprobs": None,
                                                  "finish_reason": finish_reason})

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "halo", "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
