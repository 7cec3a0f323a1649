"""Browser workers: the coordinator serves a page that a person opens to lend the tab to the cluster.

`BrowserHub` runs an aiohttp server (the `browser` extra) on a thread of its own:
  GET /?token=...        the worker page (web/src/index.html, built into halo/pipeline/web_assets)
  GET /assets/NAME       the page's script and onnxruntime-web (its WASM and WebGPU builds), never a CDN
  GET /models/SHA.onnx   a stage's ONNX sub-model, named by content hash (cached by the browser for good)
  GET /ws?token=...      the WebSocket: stage messages (halo/pipeline/protocol.py), binary frames
Each tab gets its own address: the token in it admits one WebSocket, once (a sniffed or shared token cannot join
a second tab). Messages are limited to what a stage's activations take, and the hidden states a tab returns must be
finite and bounded. Pages get cross-origin isolation headers so onnxruntime-web can run WASM with threads. WebGPU
needs a secure context: localhost, or HTTPS (`tls_cert`/`tls_key`: --worker-tls-cert/--worker-tls-key) when the
laptop is another machine; without TLS beyond loopback the hub warns that tokens and hidden states travel in clear.

A tab answers `probe` by timing one and two layers of the model in its own engine (WebGPU, else WASM)
and becomes a `BrowserStage`: a link like a native worker's, so planning, forwarding and recovery
treat it alike.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import threading
import time
from importlib import resources
from pathlib import Path

import numpy as np

from halo.arguments import is_loopback
from halo.errors import ConfigError
from halo.transport.reliable import Message, MessageError

from halo.pipeline.links import StageFailed, StageRefused, Traffic, measure_link
from halo.pipeline.onnx_export import content_name, export_stage
from halo.pipeline.protocol import STAGE_PROTOCOL, ws_pack, ws_unpack
from halo.pipeline.stage import HeadRequest

ASSETS = resources.files("halo.pipeline") / "web_assets"
BUILD_HINT = ("the worker page is not built: run `npm --prefix web ci && npm --prefix web run build` in the halo "
              "source tree (it copies onnxruntime-web into halo/pipeline/web_assets), then reinstall")
MAX_HIDDEN_MAGNITUDE = 1e6  # beyond any real hidden state or logit: a tab returning more is broken or hostile
ISOLATION = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp",
             "Cross-Origin-Resource-Policy": "same-origin"}
CONTENT_TYPES = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm",
                 ".html": "text/html", ".css": "text/css"}


def assets_built() -> bool:
    return (Path(str(ASSETS)) / "index.html").is_file() and (Path(str(ASSETS)) / "ort.min.mjs").is_file()


class BrowserHub:
    def __init__(self, weights, listen: str = "127.0.0.1:8765", context: int = 2048, tls_cert: str | None = None,
                 tls_key: str | None = None, announce=None, tabs: int = 1):
        """tabs: how many tabs may join, each through an address of its own (a single-use token)."""
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise ConfigError("browser workers need aiohttp: pip install 'halo-edge[browser]'") from None
        if not assets_built():
            raise ConfigError(BUILD_HINT)
        host, _, port = listen.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:8765
        if not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"--serve-worker {listen!r}: expected HOST:PORT ([ADDRESS]:PORT for IPv6)")
        self.weights, self.host, self.port, self.context = weights, host, int(port), context
        if bool(tls_cert) != bool(tls_key):
            raise ConfigError("give --worker-tls-cert and --worker-tls-key together")
        for option, path in (("--worker-tls-cert", tls_cert), ("--worker-tls-key", tls_key)):
            if path and not Path(path).is_file():
                raise ConfigError(f"{option} {path}: no such file")
        self.tls = (tls_cert, tls_key) if tls_cert else None
        if self.tls is None and not is_loopback(host):
            (announce or print)(f"halo: WARNING: the worker page on {listen} without TLS: each tab's token and every "
                                "hidden state cross the network in clear (give --worker-tls-cert/--worker-tls-key)")
        self.tokens = [secrets.token_urlsafe(16) for _ in range(max(1, tabs))]
        self.unused = set(self.tokens)  # a token admits one WebSocket (again only if it left before the run took it)
        self.left_early = 0  # tabs that joined and left before the run took them
        self.joins = 0  # tabs that joined so far: each one's name is its number
        c = weights.config  # the largest message a stage exchanges: all positions' logits, or their hidden states
        self.max_message = 4 * context * max(c.dim, c.vocab_size) + (1 << 20)
        self.models: dict[str, bytes] = {}
        self.tabs: list[BrowserStage] = []
        self.joined = threading.Condition()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="halo-browser-hub", daemon=True)
        self.announce = announce or (lambda line: print(line, file=sys.stderr, flush=True))
        self.runner = None

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> "BrowserHub":
        self.thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        except OSError as e:  # a port in use, an address not of this machine, a certificate that does not load
            self.__exit__(None, None, None)
            raise ConfigError(f"cannot serve the worker page on {self.host}:{self.port}: {e} (choose another "
                              "--serve-worker HOST:PORT, or check --worker-tls-cert/--worker-tls-key)") from None
        scheme = "https" if self.tls else "http"
        shown = "localhost" if self.host in ("127.0.0.1", "0.0.0.0", "") else self.host
        shown = f"[{shown}]" if ":" in shown else shown  # an IPv6 address in a URL
        self.urls = [f"{scheme}://{shown}:{self.port}/?token={token}" for token in self.tokens]
        self.url = self.urls[0]
        for url in self.urls:
            self.announce(f"halo: lend a browser to this cluster: open {url}" + (" (one tab per address)"
                                                                                 if len(self.urls) > 1 else ""))
        return self

    def __exit__(self, *exc) -> None:
        for tab in list(self.tabs):
            tab.close()
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=1 << 20)
        app.router.add_get("/", self._page)
        app.router.add_get("/assets/{name}", self._asset)
        app.router.add_get("/models/{name}", self._model)
        app.router.add_get("/ws", self._socket)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        ssl_context = None
        if self.tls:
            import ssl

            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(*self.tls)
        site = web.TCPSite(self.runner, self.host, self.port, ssl_context=ssl_context)
        await site.start()
        if self.port == 0:
            self.port = site._server.sockets[0].getsockname()[1]

    # ---- HTTP --------------------------------------------------------------------------------------------
    def _file(self, name: str):
        from aiohttp import web

        path = Path(str(ASSETS)) / name
        if "/" in name or name.startswith(".") or not path.is_file():
            raise web.HTTPNotFound(text=f"no asset {name}")
        headers = {**ISOLATION, "Content-Type": CONTENT_TYPES.get(path.suffix, "application/octet-stream"),
                   "Cache-Control": "no-cache"}
        return web.FileResponse(path, headers=headers)

    async def _page(self, request):
        return self._file("index.html")

    async def _asset(self, request):
        return self._file(request.match_info["name"])

    async def _model(self, request):
        from aiohttp import web

        data = self.models.get(request.match_info["name"])
        if data is None:
            raise web.HTTPNotFound(text="no such model part (the coordinator exports one when it assigns it)")
        return web.Response(body=data, headers={**ISOLATION, "Content-Type": "application/octet-stream",
                                                "Cache-Control": "public, max-age=31536000, immutable"})

    def model_part(self, start: int, stop: int) -> str:
        """Export units [start, stop) once and serve it under its content hash; returns the file name."""
        data = export_stage(self.weights, start, stop, self.context)
        name = content_name(data)
        self.models[name] = data
        return name

    # ---- WebSocket ---------------------------------------------------------------------------------------
    async def _socket(self, request):
        from aiohttp import WSMsgType, web

        given = request.query.get("token", "")
        token = next((t for t in self.unused if secrets.compare_digest(given, t)), None)
        if token is None:
            raise web.HTTPForbidden(text="wrong, missing or already used token: open an address the coordinator "
                                         "printed, one tab each")
        self.unused.discard(token)
        ws = web.WebSocketResponse(max_msg_size=self.max_message, heartbeat=5.0)
        await ws.prepare(request)
        tab = BrowserStage(self, ws, request.headers.get("User-Agent", "?"))
        with self.joined:
            self.tabs.append(tab)
            self.joined.notify_all()
        try:
            async for msg in ws:
                if msg.type == WSMsgType.BINARY:
                    tab.traffic.received += len(msg.data)
                    try:
                        tab.deliver(ws_unpack(msg.data))
                    except MessageError as e:
                        tab.deliver(Message("error", {"reason": f"malformed message from the page: {e}"}))
                elif msg.type == WSMsgType.ERROR:
                    break
        finally:
            tab.gone("its WebSocket closed (the tab was closed, reloaded or lost its network)")
            with self.joined:
                if not tab.claimed:  # left before the run took it: its address admits the reloaded tab again
                    self.unused.add(token)
                    self.tabs.remove(tab)
                    self.left_early += 1
                self.joined.notify_all()
        return ws

    def wait_for_workers(self, n: int, timeout_s: float) -> list["BrowserStage"]:
        deadline = time.monotonic() + timeout_s
        with self.joined:
            while len([t for t in self.tabs if t.alive]) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    early = (f"; {self.left_early} tab(s) joined and left again (their addresses admit a tab again)"
                             if self.left_early else "")
                    raise ConfigError(f"only {len([t for t in self.tabs if t.alive])} of {n} browser workers are open "
                                      f"on their addresses ({', '.join(self.urls)}) after {timeout_s:.0f} s{early}")
                self.joined.wait(min(left, 1.0))
            taken = [t for t in self.tabs if t.alive][:n]
            for tab in taken:
                tab.claimed = True
            return taken


class BrowserStage:
    """One browser tab as a stage link (the coordinator's thread calls it; the hub's loop talks to the tab)."""

    kind = "browser"

    def __init__(self, hub: BrowserHub, ws, agent: str):
        self.hub, self.ws, self.agent = hub, ws, agent
        hub.joins += 1  # (not len(tabs): a tab that left early is removed, and its name came back to the next)
        self.name = f"browser-{hub.joins}"
        self.traffic = Traffic()
        self.alive = True
        self.claimed = False  # handed to the run by wait_for_workers: from then on its address is spent
        self.session = ""
        self.timeout_s = 30.0
        self.engine = "?"
        self._reply = None  # concurrent.futures-like slot for the one request in flight
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._gone_reason = ""

    def deliver(self, message: Message) -> None:
        self._reply = message
        self._event.set()

    def gone(self, reason: str) -> None:
        self.alive = False
        self._gone_reason = reason
        self._event.set()

    def _call(self, kind: str, fields: dict, arrays=(), what: str = "", timeout_s: float | None = None) -> Message:
        if not self.alive:
            raise StageFailed(self.name, f"browser worker {self.name} is gone: {self._gone_reason}")
        data = ws_pack(Message(kind, fields, list(arrays)))
        with self._lock:
            self._event.clear()
            self._reply = None
            self.traffic.sent += len(data)
            asyncio.run_coroutine_threadsafe(self.ws.send_bytes(data), self.hub.loop).result(10)
            timeout_s = self.timeout_s if timeout_s is None else timeout_s
            if not self._event.wait(timeout_s):
                self.alive = False
                raise StageFailed(self.name, f"browser worker {self.name} did not answer {what or kind} within "
                                             f"{timeout_s:.0f} s")
            if self._reply is None:
                raise StageFailed(self.name, f"browser worker {self.name} left during {what or kind}: {self._gone_reason}")
            reply = self._reply
        if reply.kind in ("error", "refused"):
            raise StageRefused(f"browser worker {self.name} {reply.kind} {what or kind}: {reply.fields.get('reason')}")
        return reply

    def probe(self, fmt: str = "fp32") -> dict:
        """(fmt: a tab computes the fp32 ONNX export, whatever the native workers run.)"""
        c = self.hub.weights.config
        parts = [self.hub.model_part(1, 2)] + ([self.hub.model_part(1, 3)] if c.n_layers >= 2 else [])
        reply = self._call("probe", {"parts": parts, "dim": c.dim, "n_kv_heads": c.n_kv_heads,
                                     "head_dim": c.head_dim}, what="the profile probe", timeout_s=300)
        self.engine = str(reply.fields.get("engine", "?"))
        self.name = f"{self.name}({self.engine})"
        return {**reply.fields, "weight_format": "fp32"}  # the ONNX export the tab runs

    def link(self) -> tuple[float, float]:
        return measure_link(lambda arrays: self._call("ping", {}, arrays, what="a ping"))

    def open(self, start: int, stop: int, context: int, fmt: str) -> dict:
        if fmt != "fp32":
            raise StageRefused(f"browser worker {self.name}: browser stages run fp32 ONNX weights, not {fmt}")
        c = self.hub.weights.config
        self.session = os.urandom(8).hex()
        part = self.hub.model_part(start, stop)
        layers = list(range(max(0, start - 1), min(c.n_layers, stop - 1)))
        reply = self._call("hello", {"protocol": STAGE_PROTOCOL, "session": self.session, "start": start, "stop": stop,
                                     "context": context, "part": part, "layers": layers, "takes_tokens": start == 0,
                                     "head": stop == c.n_layers + 2, "dim": c.dim, "vocab_size": c.vocab_size,
                                     "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim},
                           what=f"hello for units [{start}, {stop})", timeout_s=600)
        return dict(reply.fields)

    def forward(self, inputs: np.ndarray, start_pos: int, head: HeadRequest) -> tuple[list[np.ndarray], float]:
        reply = self._call("forward", {"session": self.session, "start_pos": start_pos, "head": head.to_json()},
                           [inputs], what=f"the forward pass at position {start_pos}")
        outputs = [np.ascontiguousarray(a) for a in reply.arrays]
        for a in outputs:  # a page's numbers go into the next stage: nothing non-finite or absurd
            if a.dtype.kind == "f" and a.size and not (np.isfinite(a).all() and np.abs(a).max() <= MAX_HIDDEN_MAGNITUDE):
                self.alive = False
                raise StageFailed(self.name, f"browser worker {self.name} returned non-finite or out-of-range values "
                                             f"(|x| > {MAX_HIDDEN_MAGNITUDE:g}) at position {start_pos}: dropped")
        return outputs, float(reply.fields.get("compute_ms", 0.0))

    def reset(self) -> None:
        self._call("reset", {"session": self.session})

    def close(self) -> None:
        if self.alive:
            try:
                data = ws_pack(Message("bye", {"session": self.session}))
                asyncio.run_coroutine_threadsafe(self.ws.send_bytes(data), self.hub.loop).result(2)
            except Exception:  # noqa: BLE001 - closing must not fail
                pass
        self.alive = False
