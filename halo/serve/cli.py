"""`halo-master serve` and `halo-master status --server`: the command-line ends of the server."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from halo.arguments import is_loopback
from halo.errors import ConfigError, Terminated

log = logging.getLogger("halo.serve")


def read_api_key(args) -> str | None:
    """--api-key, or the first line of --api-key-file (not both)."""
    if args.api_key and args.api_key_file:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        try:
            mode = os.stat(args.api_key_file).st_mode
            key = next(iter(Path(args.api_key_file).read_text().splitlines()), "").strip()
        except OSError as e:
            raise ConfigError(f"cannot read --api-key-file {args.api_key_file}: {e.strerror}") from None
        if mode & 0o077:
            raise ConfigError(f"--api-key-file {args.api_key_file} can be read by other users (mode "
                              f"{stat.S_IMODE(mode):04o}): chmod 600 {args.api_key_file}")
        if not key:
            raise ConfigError(f"--api-key-file {args.api_key_file} is empty: put the key on its first line")
    elif args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key is empty")
    else:
        key = args.api_key.strip() if args.api_key else None
    if key is not None and not (key.isascii() and key.isprintable()):  # HTTP headers carry no other: no client
        raise ConfigError("the API key must be printable ASCII (an HTTP header cannot carry other characters; a "
                          "client could never send it): e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`")
    return key


def default_model_name(model: str | None) -> str:
    if not model:
        return "stories260K"
    path = Path(model)
    return path.stem if path.suffix in (".bin", ".gguf") else path.name


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (bound here so that `--port 0` can print the port it got)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e} (another server there? try --port)") from None
    return sock


def serve(args, open_model) -> int:
    try:
        import uvicorn

        from halo.serve.app import create_app
        from halo.serve.engine import Engine
    except ImportError as e:
        raise ConfigError(f"halo-master serve needs the 'serve' extra ({e.name} is missing): "
                          "pip install 'halo-edge[serve]'") from None
    from rich.console import Console

    from halo.generation.speculative import speculation_from
    from halo.model.loader import load_tokenizer, load_weights

    err = Console(stderr=True)
    api_key = read_api_key(args)
    if not is_loopback(args.host) and api_key is None:
        err.print(f"[bold red]WARNING: listening on {args.host} WITHOUT an API key: anyone who can reach this "
                  f"machine can use the cluster. Add --api-key-file FILE.[/bold red]")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    weights = load_weights(args.model)
    tokenizer = load_tokenizer(weights, args.tokenizer)
    speculation = speculation_from(args.speculate, args.draft, weights.config.vocab_size, args.context, args.threads)
    name = args.model_name or default_model_name(args.model)
    sock = listen(args.host, args.port)
    err.print(f"[dim]loading {name} ...[/dim]")
    engine = Engine(lambda stack: open_model(args, weights, stack), tokenizer, weights, model_name=name,
                    sync_mode=args.sync or "exact", max_queue=args.max_queue, request_timeout_s=args.request_timeout,
                    speculation=speculation).start()
    try:
        app = create_app(engine, api_key, loopback_only=api_key is None and is_loopback(args.host),
                         max_body_bytes=args.max_request_bytes)
        host, port = sock.getsockname()[:2]
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        print(f"LISTENING {url}", flush=True)
        err.print(f"serving [bold]{name}[/bold] ({engine.snapshot['sync']} sync, context {engine.max_seq_len}): "
                  f"chat page {url}/ · API {url}/v1 · metrics {url}/metrics"
                  + ("" if api_key else " · no API key"), soft_wrap=True)
        server = _graceful_server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=2), engine)
        # uvicorn shuts down gracefully on SIGTERM, then raises the signal again: end here, not by it
        previous = signal.signal(signal.SIGTERM, _terminated)
        try:
            server.run(sockets=[sock])
        except Terminated:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        engine.close()  # the agents' sessions end; local agents stop
        sock.close()
    return 0


class Terminated(Exception):
    """SIGTERM, after uvicorn's graceful shutdown."""


def _graceful_server(config, engine):
    """uvicorn's server whose SIGTERM / Ctrl-C first ends the engine's requests with 503 "the server is shutting down"
    (their handlers answer so within the graceful shutdown; with the engine closed after it, a stream was cut
    mid-token and a plain request got a bare 500), then shuts down as uvicorn does."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                threading.Thread(target=engine.close, name="halo-engine-close", daemon=True).start()
            super().handle_exit(sig, frame)

    return Server(config)


def _terminated(signum, frame):
    raise Terminated()


# ---- status --server --------------------------------------------------------------------------------------------
def fetch_cluster(server: str, api_key: str | None, timeout: float) -> dict:
    url = server.rstrip("/") + "/v1/halo/cluster"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise ConfigError(f"{server} wants its API key: add --api-key-file FILE") from None
        raise ConfigError(f"{url} answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ConfigError(f"cannot reach {server}: {getattr(e, 'reason', e)} (is `halo-master serve` running?)") from None


def status_from_server(args) -> int:
    from rich.console import Console

    from halo.serve.view import render

    api_key = read_api_key(args)
    timeout = args.timeout
    console = Console()
    if not args.watch:
        snapshot = fetch_cluster(args.server, api_key, timeout)
        if args.json:
            print(json.dumps(snapshot))
        else:
            console.print(render(snapshot))
        return 1 if snapshot.get("state") == "down" else 0
    from rich.live import Live
    from rich.text import Text

    try:
        with Live(console=console, auto_refresh=False) as live:
            while True:
                try:
                    live.update(render(fetch_cluster(args.server, api_key, timeout)), refresh=True)
                except ConfigError as e:  # the server restarts: keep watching
                    live.update(Text(f"{e} (retrying)", style="red"), refresh=True)
                time.sleep(args.interval)
    except Terminated:  # (SIGTERM ends a run as such: exit 143)
        raise
    except KeyboardInterrupt:  # Ctrl-C is how a watch ends
        return 0
