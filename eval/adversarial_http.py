"""Careless and hostile HTTP clients against `halo-master serve` while one client streams.

    python -m halo.eval.adversarial --http [--requests 10000] [--concurrency 32]

The server runs as users run it on one machine: the bundled model over 2 local agents, no API key, loopback. One
client streams greedy completions again and again; meanwhile others send --requests requests of every kind a
careless client or a web page could: malformed JSON, impossible sampling values (seed -1, temperature 5e-324),
unknown models, bodies over the 1 MB limit (declared and chunked), prompts no context holds, text/plain from a
foreign Origin, a foreign Host (DNS rebinding), CORS preflights, wrong paths and methods, and slow (slowloris)
connections that trickle their headers. What must hold: no cluster teardown (no rebuild, /health never down), every
streamed text equal to the unattacked run's, /health answering within 100 ms throughout, the server's memory growing
by at most 50 MB. Writes eval/results/NAME.{json,md}.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

from halo.eval.report import command_line, host, write_report

PROMPT = "Once upon a time"
STREAM_TOKENS = 120
BODY = {"model": "stories260K", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def attack(index: int, url: str, port: int) -> dict:
    """The index-th request of the mix: (kind, method, path, headers, content)."""
    json_headers = {"Content-Type": "application/json"}
    kinds = [
        ("malformed json", "POST", "/v1/completions", json_headers, b"{\"model\": "),
        ("seed -1", "POST", "/v1/completions", json_headers, json.dumps({**BODY, "seed": -1}).encode()),
        ("n = 2", "POST", "/v1/completions", json_headers, json.dumps({**BODY, "n": 2}).encode()),
        ("unknown model", "POST", "/v1/chat/completions", json_headers,
         json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).encode()),
        ("2 MB body, declared", "POST", "/v1/completions", json_headers, b"x" * 2_000_000),
        ("prompt no context holds", "POST", "/v1/completions", json_headers,
         json.dumps({**BODY, "prompt": "ab" * 300_000}).encode()),
        ("text/plain from a foreign Origin", "POST", "/v1/completions",
         {"Content-Type": "text/plain", "Origin": "http://evil.test"}, json.dumps(BODY).encode()),
        ("foreign Host (rebinding)", "POST", "/v1/completions", {**json_headers, "Host": f"evil.test:{port}"},
         json.dumps(BODY).encode()),
        ("CORS preflight", "OPTIONS", "/v1/completions",
         {"Origin": "http://evil.test", "Access-Control-Request-Method": "POST"}, b""),
        ("wrong path", "GET", "/v1/../../etc/passwd", {}, b""),
        ("wrong method", "DELETE", "/v1/models", {}, b""),
        ("not an object", "POST", "/v1/completions", json_headers, b"[1, 2, 3]"),
        ("temperature 5e-324", "POST", "/v1/completions", json_headers,
         json.dumps({**BODY, "temperature": 5e-324, "max_tokens": 1}).encode()),
    ]
    kind, method, path, headers, content = kinds[index % len(kinds)]
    return {"kind": kind, "method": method, "url": url + path, "headers": headers, "content": content}


async def chunked_oversize(client, url: str) -> int:
    async def body():
        for _ in range(100):
            yield b"y" * 16384  # 1.6 MB, no Content-Length
    r = await client.post(url + "/v1/completions", content=body(), headers={"Content-Type": "application/json"})
    return r.status_code


async def slowloris(port: int, seconds: float) -> str:
    """A connection that trickles its request line and headers, a byte at a time."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        return f"refused: {e}"
    request = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    step = seconds / len(request)
    try:
        for byte in request:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(step)
        return "held"
    except (ConnectionError, OSError):
        return "closed by the server"
    finally:
        writer.close()


async def stream_once(client, url: str) -> str | int:
    """A streamed greedy completion's text, or the HTTP status it was refused with (429: the queue was full)."""
    pieces = []
    async with client.stream("POST", url + "/v1/completions", json={**BODY, "max_tokens": STREAM_TOKENS,
                                                                      "stream": True}) as r:
        if r.status_code != 200:
            return r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                pieces.append(chunk["choices"][0]["text"] if chunk.get("choices") else "")
    return "".join(pieces)


async def run_attack(url: str, pid: int, requests: int, concurrency: int) -> dict:
    import httpx

    port = int(url.rsplit(":", 1)[1])
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        reference = await stream_once(client, url)
        cluster = (await client.get(url + "/v1/halo/cluster")).json()
        rebuilds_before = cluster.get("totals", {}).get("rebuilds", 0)
        rss_before = rss_mb(pid)
        done = asyncio.Event()
        health_ms, health_states, streams, retries = [], Counter(), [], [0]

        async def probe_health():
            async with httpx.AsyncClient(timeout=10) as own:  # its own connection: not queued behind the attack's
                while not done.is_set():
                    t = time.perf_counter()
                    r = await own.get(url + "/health")
                    health_ms.append(1e3 * (time.perf_counter() - t))
                    health_states[r.json().get("status")] += 1
                    await asyncio.sleep(0.02)

        async def keep_streaming():
            """As a client does: a 429 (the queue full of the attack's valid requests) is tried again after its
            Retry-After; every stream that completes must be the unattacked text."""
            async with httpx.AsyncClient(timeout=120) as own:
                while not done.is_set():
                    outcome = await stream_once(own, url)
                    if outcome == 429:
                        retries[0] += 1
                        await asyncio.sleep(1.0)
                        continue
                    streams.append(outcome)

        statuses: dict[str, Counter] = {}
        queue = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)

        async def attacker():
            while not queue.empty():
                spec = attack(queue.get_nowait(), url, port)
                try:
                    r = await client.request(spec["method"], spec["url"], headers=spec["headers"],
                                             content=spec["content"])
                    code = str(r.status_code)
                except httpx.HTTPError as e:
                    code = type(e).__name__
                statuses.setdefault(spec["kind"], Counter())[code] += 1

        t0 = time.perf_counter()
        watchers = [asyncio.create_task(probe_health()), asyncio.create_task(keep_streaming())]
        slow = [asyncio.create_task(slowloris(port, 3.0)) for _ in range(20)]
        chunked = [await chunked_oversize(client, url) for _ in range(5)]
        await asyncio.gather(*(attacker() for _ in range(concurrency)))
        slow_results = await asyncio.gather(*slow)
        attack_s = time.perf_counter() - t0
        if not streams:  # at least one stream beside the attack
            await asyncio.sleep(0.5)
        done.set()
        await asyncio.gather(*watchers)
        rss_after = rss_mb(pid)
        cluster = (await client.get(url + "/v1/halo/cluster")).json()
    return {"requests": requests, "concurrency": concurrency, "attack_s": round(attack_s, 1),
            "statuses": {k: dict(v) for k, v in statuses.items()}, "chunked_oversize": chunked,
            "slowloris": dict(Counter(slow_results)), "streams": len(streams),
            "streams_equal_unattacked": sum(s == reference for s in streams), "reference_chars": len(reference),
            "streams_refused": dict(Counter(s for s in streams if isinstance(s, int))), "stream_retries_429": retries[0],
            "health": {"probes": len(health_ms), "max_ms": round(max(health_ms), 1),
                       "p99_ms": round(sorted(health_ms)[int(0.99 * (len(health_ms) - 1))], 1),
                       "states": dict(health_states)},
            "rebuilds": cluster.get("totals", {}).get("rebuilds", 0) - rebuilds_before,
            "last_error": cluster.get("totals", {}).get("last_error"),
            "server_rss_mb": {"before": round(rss_before, 1), "after": round(rss_after, 1),
                              "growth": round(rss_after - rss_before, 1)}}


def render(result: dict) -> list[str]:
    h, rss = result["health"], result["server_rss_mb"]
    lines = ["# Hostile and careless HTTP clients against `halo-master serve`", "",
             f"Command: `{result['command']}`. Host: {result['host']['cpu']}, {result['host']['cores']} cores. The "
             "bundled model over 2 local agents, no API key, loopback. One client streams greedy completions of "
             f"{STREAM_TOKENS} tokens again and again while {result['concurrency']} others send {result['requests']:,} "
             f"requests ({result['attack_s']} s), 5 chunked 1.6 MB bodies and 20 slowloris connections; /health is "
             "probed every 20 ms on a connection of its own.", "",
             "| what must hold | measured |", "|---|---|",
             f"| cluster teardowns | {result['rebuilds']} rebuilds, /health states {h['states']} |",
             f"| streamed text = the unattacked run's | {result['streams_equal_unattacked']} of {result['streams']} streams"
             + (f" (refused, status: {result['streams_refused']})" if result["streams_refused"] else "")
             + (f"; {result['stream_retries_429']} tries answered 429 (the queue full of the attack's valid requests) "
                "were made again after Retry-After" if result.get("stream_retries_429") else "") + " |",
             f"| /health within 100 ms | max {h['max_ms']} ms, p99 {h['p99_ms']} ms over {h['probes']} probes |",
             f"| server memory growth <= 50 MB | {rss['growth']} MB ({rss['before']} -> {rss['after']}) |", "",
             "| request | answers |", "|---|---|"]
    for kind, codes in result["statuses"].items():
        lines.append(f"| {kind} | {', '.join(f'{code}: {n}' for code, n in sorted(codes.items()))} |")
    lines += [f"| chunked 1.6 MB body | {', '.join(map(str, result['chunked_oversize']))} |",
              f"| slowloris (20) | {', '.join(f'{k}: {v}' for k, v in result['slowloris'].items())} |"]
    return lines


def run(requests: int, concurrency: int, out: str, name: str, argv=None) -> dict:
    from halo.runtime.local import AgentProcess, module_command, stop_processes

    argv_server = [*module_command("halo.cli.master"), "serve", "--port", "0", "--local-agents", "2", "--log-level",
                   "warning", "--rebalance-every", "0", "--plan", "even", "--max-queue", "4"]
    with tempfile.TemporaryDirectory(prefix="halo-adversarial-http-"):
        server = AgentProcess("server", argv_server)
        try:
            url = server.wait_listening(120)
            result = asyncio.run(run_attack(url, server.pid, requests, concurrency))
        finally:
            stop_processes([server])
    result.update(command=command_line("halo.eval.adversarial", argv), host=host())
    write_report(Path(out), name, result, render(result))
    return result
