"""The HTTP application: OpenAI-compatible routes, the API key, server-sent events and the pages.

Built on Starlette (served by uvicorn): routing, streaming responses and static files from a
maintained ASGI toolkit, with pydantic validating the OpenAI request bodies (protocol.py). FastAPI
would add little here: every error must take OpenAI's shape rather than FastAPI's 422, and the
streaming and disconnect handling are Starlette's anyway.

Routes (all under the API key when one is set, except /health and the pages' static files):
  POST /v1/chat/completions, POST /v1/completions   (stream: true -> text/event-stream chunks)
  GET  /v1/models, GET /health, GET /metrics
  GET  /v1/halo/cluster          the cluster view as JSON (view.py)
  GET  /v1/halo/cluster/events   the same, pushed as server-sent events while it changes
  GET  /                          the chat page and cluster view (static/)

A stream is answered only once its first event exists: a request that fails before producing text
(a full context, a cluster that cannot be rebuilt) gets a proper HTTP error, not a 200 with an error
inside. A client that goes away (while waiting or while streaming) cancels its job (engine.py).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from importlib import resources

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from halo.errors import ConfigError
from halo.model.chat import chat_prompt
from halo.serve.engine import Cancelled, Engine, GenerationRequest
from halo.serve.guard import MAX_BODY_BYTES, Guard
from halo.serve.metrics import CONTENT_TYPE, Metrics
from halo.serve.protocol import (BadRequest, ChatCompletionRequest, ClusterUnavailable, CompletionRequest, NotFound,
                                 ServeError, Shaper, Unauthorized, parse)

STATIC = resources.files("halo.serve") / "static"
MAX_CHARS_PER_TOKEN = 64  # a prompt longer than this many characters a context token cannot fit (no tokenizer's do)
EVENTS_POLL_S = 0.25
KEEPALIVE_S = 15.0


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def error_response(error: ServeError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 429 else None
    if error.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error.to_json(), status_code=error.status, headers=headers)


class Server:
    """The routes over one engine."""

    def __init__(self, engine: Engine, api_key: str | None = None):
        self.engine = engine
        self.api_key = api_key
        self.metrics = Metrics(engine)
        engine.on_generation = self.metrics.on_generation
        engine.on_tokens = self.metrics.count_tokens
        self.tokenizer = engine.tokenizer
        self.chat_template = getattr(engine.tokenizer, "chat_template", None)
        self.created = int(time.time())

    # ---- plumbing ----------------------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer <key>' (the server's "
                               "--api-key / --api-key-file)", "invalid_api_key")

    def model_card(self) -> dict:
        return {"id": self.engine.model_name, "object": "model", "created": self.created, "owned_by": "halo",
                "halo": {"chat_template": self.chat_template is not None, "context": self.engine.max_seq_len,
                         "sync": self.engine.sync_mode}}

    # ---- routes ------------------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {**self.engine.snapshot, "queue": self.engine.queue_state()}

    async def health(self, request: Request) -> Response:
        """For load balancers, without the key; the details (the model, the queue, the last error: agents' addresses)
        only to who gives it."""
        s = self.snapshot()
        down = s.get("state") == "down"
        body = {"status": "down" if down else "ok"}
        try:
            self.authorize(request)
            body.update(model=self.engine.model_name, state=s.get("state"), queue=s.get("queue"),
                        last_error=s.get("totals", {}).get("last_error") if down else None)
        except Unauthorized:
            pass
        return JSONResponse(body, status_code=503 if down else 200)

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        if self.snapshot().get("state") == "down":  # (docs/serving.md: 503 while the cluster is down)
            raise ClusterUnavailable("the cluster is down: the next request rebuilds it", "cluster_unavailable")
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def metrics_route(self, request: Request) -> Response:
        self.authorize(request)
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def cluster(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse(self.snapshot())

    async def cluster_events(self, request: Request) -> Response:
        self.authorize(request)

        async def events():
            last, quiet = None, 0.0
            while True:
                snapshot = self.engine.snapshot
                if snapshot is not last:
                    last, quiet = snapshot, 0.0
                    yield sse(snapshot)
                elif quiet >= KEEPALIVE_S:
                    quiet = 0.0
                    yield ": keepalive\n\n"
                await asyncio.sleep(EVENTS_POLL_S)
                quiet += EVENTS_POLL_S

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    def refused(self, path: str, error: ServeError) -> None:
        """A generation request the guard refused (413 by its length, 415, 403) counts as the route's would."""
        endpoint = GENERATION_ROUTES.get(path)
        if endpoint is not None:
            self.metrics.requests.labels(endpoint, _outcome(error)).inc()

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            self.authorize(request)
            body = parse(ChatCompletionRequest if chat else CompletionRequest, await request.body())
            if body.model != self.engine.model_name:
                raise NotFound(f"unknown model {body.model!r}: this server runs {self.engine.model_name!r} "
                               "(GET /v1/models)", "model_not_found", "model")
            # the template and the tokenizer run beside the event loop: a long prompt must not stall other clients
            generation = await asyncio.to_thread(self._prepare, body, chat)
            job = self.engine.submit(generation, asyncio.get_running_loop())
        except ServeError as e:
            self.metrics.requests.labels(endpoint, _outcome(e)).inc()
            return error_response(e)
        shaper = Shaper(chat, self.engine.model_name)
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        try:
            first = await job.events.get()
        except asyncio.CancelledError:
            self.engine.cancel(job)
            watcher.cancel()
            raise
        if first[0] == "error":
            watcher.cancel()
            self.metrics.requests.labels(endpoint, _outcome(first[1])).inc()
            if isinstance(first[1], Cancelled):
                return Response(status_code=499)
            return error_response(first[1])
        if not body.stream:
            text, event = [], first
            while event[0] == "text":
                text.append(event[1])
                event = await job.events.get()
            watcher.cancel()
            self.metrics.requests.labels(endpoint, _outcome(event[1]) if event[0] == "error" else "completed").inc()
            if event[0] == "error":
                return Response(status_code=499) if isinstance(event[1], Cancelled) else error_response(event[1])
            outcome = event[1]
            return JSONResponse(shaper.response("".join(text), outcome.finish_reason, outcome.prompt_tokens,
                                                outcome.completion_tokens))
        watcher.cancel()
        return StreamingResponse(self._stream(job, shaper, first, body.include_usage, endpoint),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _stream(self, job, shaper: Shaper, event, include_usage: bool, endpoint: str):
        outcome_label = "cancelled"
        try:
            if shaper.chat:
                yield sse(shaper.chunk(first=True))
            while True:
                kind, value = event
                if kind == "text":
                    yield sse(shaper.chunk(value))
                elif kind == "done":
                    outcome_label = "completed"
                    yield sse(shaper.chunk(None if shaper.chat else "", finish_reason=value.finish_reason))
                    if include_usage:
                        yield sse(shaper.usage_chunk(value.prompt_tokens, value.completion_tokens))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    outcome_label = _outcome(value)
                    if not isinstance(value, Cancelled):
                        yield sse(value.to_json())
                        yield "data: [DONE]\n\n"
                    return
                event = await job.events.get()
        finally:  # also when the client went away and Starlette cancelled this generator
            self.engine.cancel(job)
            self.metrics.requests.labels(endpoint, outcome_label).inc()

    async def _watch_disconnect(self, request: Request, job) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.engine.cancel(job)
                return

    # ---- request -> generation ---------------------------------------------------------------------------------
    def _chat_prompt(self, body: ChatCompletionRequest) -> str:
        if self.chat_template is None:
            raise BadRequest(f"model {self.engine.model_name!r} has no chat template, so it cannot take chat "
                             "messages: use POST /v1/completions with a plain prompt, or serve an instruction-tuned "
                             "model that ships one (e.g. SmolLM2-135M-Instruct)", "no_chat_template", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            return chat_prompt(self.tokenizer, messages)
        except ConfigError as e:  # the template refused the conversation (roles out of order, ...)
            raise BadRequest(str(e), "template_error", "messages") from None
        except Exception as e:  # noqa: BLE001 - a template may fail in ways of its own
            raise BadRequest(f"the model's chat template failed on these messages: {type(e).__name__}: {e}",
                             "template_error", "messages") from None

    def _prepare(self, body, chat: bool) -> GenerationRequest:
        where = "messages" if chat else "prompt"
        text = sum(len(m.text()) for m in body.messages) if chat else len(body.prompt)
        if text > MAX_CHARS_PER_TOKEN * self.engine.max_seq_len:  # refused before the tokenizer spends time on it
            raise BadRequest(f"the {where} has {text} characters, more than a context of {self.engine.max_seq_len} "
                             "tokens can hold (shorten it, or serve with a larger --context)", "context_length_exceeded",
                             where)
        return self._request(body, self._chat_prompt(body) if chat else body.prompt)

    def _request(self, body, prompt: str) -> GenerationRequest:
        prompt_tokens = len(self.tokenizer.encode(prompt, bos=True))
        room = self.engine.max_seq_len - prompt_tokens
        if room < 1:
            raise BadRequest(f"the prompt has {prompt_tokens} tokens; the context holds {self.engine.max_seq_len} "
                             "(shorten it, or serve with a larger --context)", "context_length_exceeded",
                             "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
        budget = body.token_budget
        try:
            sampling = body.sampling()
        except Exception as e:  # noqa: BLE001 - SamplingSettings' own range checks
            raise BadRequest(str(e), "invalid_value") from None
        return GenerationRequest(prompt, prompt_tokens, min(budget, room) if budget else room, sampling,
                                 tuple(body.stop))

    async def index(self, request: Request) -> Response:
        return FileResponse(str(STATIC / "index.html"), headers={"Cache-Control": "no-cache"})


GENERATION_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # path -> metrics endpoint


def _outcome(error) -> str:
    if isinstance(error, Cancelled):
        return "cancelled"
    return {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 413: "too_large", 415: "bad_request",
            429: "queue_full", 503: "unavailable", 504: "timeout"}.get(getattr(error, "status", 500), "error")


def create_app(engine: Engine, api_key: str | None = None, loopback_only: bool = False,
               max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The application over a started engine (the caller closes the engine). loopback_only: answer only requests
    addressed to loopback names (a server without a key on loopback: guard.py)."""
    server = Server(engine, api_key)

    async def not_found(request: Request, exc) -> Response:
        return JSONResponse({"error": {"message": f"no route {request.method} {request.url.path}",
                                       "type": "invalid_request_error", "param": None, "code": "not_found"}},
                            status_code=getattr(exc, "status_code", 404))

    routes = [
        Route("/", server.index),
        Route("/health", server.health),
        Route("/metrics", server.metrics_route),
        Route("/v1/models", server.models),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/halo/cluster", server.cluster),
        Route("/v1/halo/cluster/events", server.cluster_events),
        Mount("/static", StaticFiles(directory=str(STATIC)), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found,
                                                       ServeError: lambda r, e: error_response(e)},
                    middleware=[Middleware(Guard, respond=error_response, loopback_only=loopback_only,
                                           max_body_bytes=max_body_bytes, refused=server.refused)])
    app.state.server = server
    return app
