"""The browser-worker hub as an attacker on the LAN meets it (no browser needed: aiohttp's client): a token per tab,
used once; messages no larger than a stage's activations; TLS when asked; hidden states checked."""

import asyncio
import ssl
import subprocess

import numpy as np
import pytest

from halo.errors import ConfigError

aiohttp = pytest.importorskip("aiohttp", reason="the browser extra (aiohttp) is not installed")


def hub_or_skip(weights, **kwargs):
    from halo.pipeline.browser import BrowserHub, assets_built

    if not assets_built():
        pytest.skip("the worker page is not built (npm --prefix web ci && npm --prefix web run build)")
    return BrowserHub(weights, "127.0.0.1:0", 64, announce=lambda line: None, **kwargs)


async def join(url: str, ssl_context=None, payload: bytes | None = None):
    """Open the WebSocket a tab opens: 'joined', 'refused 403', or how a too-large message ended it."""
    ws_url = url.replace("http", "ws", 1).replace("/?", "/ws?")
    async with aiohttp.ClientSession() as session:
        try:
            async with session.ws_connect(ws_url, ssl=ssl_context or True) as ws:
                if payload is None:
                    return "joined"
                try:
                    await ws.send_bytes(payload)
                except ConnectionError:  # the hub ended the socket while the rest of the message was still going out
                    return "reset while sending"
                message = await ws.receive(timeout=10)
                return f"closed {ws.close_code}" if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                                                                      aiohttp.WSMsgType.ERROR) else "answered"
        except aiohttp.WSServerHandshakeError as e:
            return f"refused {e.status}"


def test_each_tab_has_a_token_of_its_own_and_each_admits_once(stories_weights):
    with hub_or_skip(stories_weights, tabs=2) as hub:
        assert len(set(hub.urls)) == 2
        first, second = hub.urls
        async def twice():  # the first tab still open
            async with aiohttp.ClientSession() as session, session.ws_connect(first.replace("http", "ws", 1).replace("/?", "/ws?")):
                return await join(first)
        assert asyncio.run(twice()) == "refused 403"  # sniffed or shared: it joins no second tab
        assert asyncio.run(join(first.split("?")[0] + "?token=guess")) == "refused 403"
        assert asyncio.run(join(second)) == "joined"


def test_a_message_larger_than_a_stages_activations_ends_the_socket(stories_weights):
    with hub_or_skip(stories_weights) as hub:
        c = stories_weights.config
        assert hub.max_message == 4 * 64 * max(c.dim, c.vocab_size) + (1 << 20)  # was 1 GiB
        # the hub closes with 1009 (message too big) as soon as it reads the frame's length; the rest of the frame, still
        # being written, may then meet a reset connection instead of the close frame (a race of the OS, not the hub)
        assert asyncio.run(join(hub.url, payload=bytes(hub.max_message + 1))) in ("closed 1009", "reset while sending")


def test_tls_when_asked(stories_weights, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                           str(cert), "-days", "1", "-subj", "/CN=localhost"], capture_output=True, timeout=60)
    if made.returncode:
        pytest.skip(f"openssl could not make a test certificate: {made.stderr[-200:]}")
    with pytest.raises(ConfigError, match="together"):
        hub_or_skip(stories_weights, tls_cert=str(cert))
    with hub_or_skip(stories_weights, tls_cert=str(cert), tls_key=str(key)) as hub:
        assert hub.url.startswith("https://")
        trusting = ssl.create_default_context(cafile=str(cert))
        assert asyncio.run(join(hub.url, ssl_context=trusting)) == "joined"


def test_a_tab_returning_non_finite_or_absurd_hidden_states_is_dropped(stories_weights):
    from halo.pipeline.browser import BrowserStage
    from halo.pipeline.links import StageFailed
    from halo.pipeline.stage import HeadRequest
    from halo.transport.reliable import Message

    class Hub:
        tabs, joins = [], 0

    tab = BrowserStage(Hub(), None, "test")
    good = np.ones((1, 8), np.float32)
    for bad in (np.array([[np.nan]], np.float32), np.array([[np.inf]], np.float32), np.full((1, 8), 1e9, np.float32)):
        tab.alive = True
        tab._call = lambda *a, bad=bad, **k: Message("output", {"compute_ms": 1.0}, [bad])
        with pytest.raises(StageFailed, match="non-finite or out-of-range"):
            tab.forward(good, 0, HeadRequest())
        assert not tab.alive
    tab.alive = True
    tab._call = lambda *a, **k: Message("output", {"compute_ms": 1.0}, [good, np.array([3], np.int64)])
    assert len(tab.forward(good, 0, HeadRequest())[0]) == 2


def test_a_page_that_cannot_be_served_is_one_clear_error_and_ipv6_gets_a_usable_address(stories_weights):
    """A port in use ended `generate --browser-workers` in an OSError traceback; `[::1]:0` was a gaierror, and
    `::1:0` printed http://::1:PORT/, which is no URL."""
    import socket

    from halo.pipeline.browser import BrowserHub

    hub_or_skip(stories_weights)  # (skips where the page is not built)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve the worker page on 127.0.0.1:{port}: .*--serve-worker"):
            BrowserHub(stories_weights, f"127.0.0.1:{port}", 64, announce=lambda line: None).__enter__()
    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 on this machine")
    with BrowserHub(stories_weights, "[::1]:0", 64, announce=lambda line: None) as hub:
        assert hub.url.startswith("http://[::1]:") and asyncio.run(join(hub.url)) == "joined"


def test_a_tab_reloaded_before_the_run_takes_it_joins_again(stories_weights):
    """A tab that closed or reloaded before the plan started had spent its address: the reload was refused (403), the
    coordinator waited out its 600 s and then said "only 1 of 1 browser workers opened their address". An address
    still admits one tab at a time, and none once the run has taken its tab."""
    import time

    with hub_or_skip(stories_weights, tabs=1) as hub:
        ws_url = hub.url.replace("http", "ws", 1).replace("/?", "/ws?")

        async def scenario():
            async with aiohttp.ClientSession() as session:
                await (await session.ws_connect(ws_url)).close()  # the tab reloads
                deadline = time.monotonic() + 5
                while hub.left_early == 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                with pytest.raises(ConfigError, match=r"only 0 of 1 browser workers are open .* 1 tab\(s\) joined and left"):
                    hub.wait_for_workers(1, 0.2)
                reloaded = await session.ws_connect(ws_url)
                assert await join(hub.url) == "refused 403"  # one tab at a time
                taken = await asyncio.get_running_loop().run_in_executor(None, hub.wait_for_workers, 1, 5.0)
                assert len(taken) == 1 and taken[0].claimed
                await reloaded.close()
                deadline = time.monotonic() + 5
                while taken[0].alive and time.monotonic() < deadline:  # the hub has seen the tab leave
                    await asyncio.sleep(0.02)
                assert not taken[0].alive and await join(hub.url) == "refused 403"  # taken by the run: spent
        asyncio.run(scenario())
