"""`halo-master serve` against careless and hostile requests: body and prompt limits, JSON only, loopback names only
without a key, /health's details behind the key, headers that keep the page out of frames, the key file's mode."""

import argparse
import json

import httpx
import pytest
from serve_server import API_KEY, start_server, stop_server

from halo.errors import ConfigError
from halo.serve.cli import read_api_key
from halo.serve.guard import host_name

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process, url = start_server(tmp_path_factory.mktemp("guard"), "--local-agents", "1", "--rebalance-every", "0",
                                "--max-request-bytes", "100000")
    yield url
    stop_server(process)


def post(url, content: bytes, headers=None, **kwargs):
    return httpx.post(url + "/v1/completions", content=content, timeout=60,
                      headers={**AUTH, "Content-Type": "application/json", **(headers or {})}, **kwargs)


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    big = json.dumps({**BODY, "prompt": "x" * 200_000}).encode()
    r = post(server, big)
    assert r.status_code == 413 and "100000" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        for i in range(0, len(big), 16384):
            yield big[i:i + 16384]

    assert post(server, chunks()).status_code == 413
    assert post(server, json.dumps(BODY).encode()).status_code == 200  # the server is fine


def test_a_prompt_no_context_can_hold_is_refused_before_tokenizing(server):
    r = post(server, json.dumps({**BODY, "prompt": "ab" * 45_000}).encode())
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_only_json_is_taken(server):
    """text/plain is what a web page may send anywhere without a CORS preflight."""
    r = post(server, json.dumps(BODY).encode(), headers={"Content-Type": "text/plain", "Origin": "http://evil.test"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert post(server, json.dumps(BODY).encode(), headers={"Content-Type": "application/json; charset=utf-8"}) \
        .status_code == 200


def test_health_tells_details_only_to_the_key_and_every_response_refuses_frames(server):
    bare = httpx.get(server + "/health", timeout=10)
    assert bare.status_code == 200 and bare.json() == {"status": "ok"}
    detailed = httpx.get(server + "/health", headers=AUTH, timeout=10).json()
    assert detailed["status"] == "ok" and detailed["model"] == "stories260K" and "queue" in detailed
    for r in (bare, httpx.get(server + "/", timeout=10), post(server, b"{}", headers={"Content-Type": "text/plain"})):
        assert r.headers["x-frame-options"] == "DENY" and "frame-ancestors 'none'" in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"


def test_without_a_key_only_loopback_names_are_served(tmp_path):
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 reaches the socket, but names its own host."""
    process, url = start_server(tmp_path, "--local-agents", "1", "--rebalance-every", "0", api_key=False)
    try:
        port = url.rsplit(":", 1)[1]
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/health", headers={"Host": f"localhost:{port}"}, timeout=10).status_code == 200
        rebound = httpx.post(url + "/v1/completions", json=BODY, headers={"Host": f"evil.test:{port}"}, timeout=10)
        assert rebound.status_code == 403 and "--api-key-file" in rebound.json()["error"]["message"]
        assert httpx.get(url + "/v1/models", headers={"Host": "evil.test"}, timeout=10).status_code == 403
    finally:
        stop_server(process)


@pytest.mark.parametrize("header, name", [("127.0.0.1:8000", "127.0.0.1"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
                                          ("localhost", "localhost"), ("LocalHost:80", "localhost"),
                                          ("evil.test:80", "evil.test"), ("", "")])
def test_host_names(header, name):
    assert host_name(header) == name


def test_a_key_file_others_can_read_is_refused(tmp_path):
    key = tmp_path / "api.key"
    key.write_text("k" * 24 + "\n")
    key.chmod(0o644)
    args = argparse.Namespace(api_key=None, api_key_file=str(key))
    with pytest.raises(ConfigError, match="chmod 600"):
        read_api_key(args)
    key.chmod(0o600)
    assert read_api_key(args) == "k" * 24


def test_an_api_key_no_client_can_send_is_refused_at_start():
    """A non-ASCII --api-key was taken, and no client could ever authenticate (headers are latin-1 / ASCII: 401, or
    the openai client's UnicodeEncodeError)."""
    for key in ("clé-ü", "tab\there"):
        with pytest.raises(ConfigError, match="printable ASCII"):
            read_api_key(argparse.Namespace(api_key=key, api_key_file=None))
    assert read_api_key(argparse.Namespace(api_key="  s3cret-Key_1 ", api_key_file=None)) == "s3cret-Key_1"


def test_requests_the_guard_refuses_are_counted_in_the_metrics(server):
    """A 413 by Content-Length or a 415 never reached halo_requests_total (only a chunked body over the limit did),
    though the labels were there for them."""
    import re

    def count(outcome: str) -> float:
        text = httpx.get(server + "/metrics", headers=AUTH, timeout=10).text
        found = re.search(rf'halo_requests_total{{endpoint="completions",outcome="{outcome}"}} ([0-9.]+)', text)
        return float(found.group(1)) if found else 0.0

    before = count("too_large"), count("bad_request")
    assert post(server, json.dumps({**BODY, "prompt": "x" * 200_000}).encode()).status_code == 413
    assert post(server, json.dumps(BODY).encode(), headers={"Content-Type": "text/plain"}).status_code == 415
    assert (count("too_large"), count("bad_request")) == (before[0] + 1, before[1] + 1)
