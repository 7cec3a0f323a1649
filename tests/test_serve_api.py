"""`halo-master serve` end to end: a live server over 2 local agents, driven by the official openai client."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx  # the dev extra brings both clients and the serve extra; these tests must never skip
import openai
import pytest
from serve_server import API_KEY, start_server, stop_server

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # no re-plans for speed: over a whole module of requests on a loaded 2-core machine, a rebalance could give a
    # device no groups (its compute per token 0) or restart the counters mid-request; re-plans have their own tests
    # one slot: the queue and 429 tests hold it with one stream (batching has its own tests)
    process, url = start_server(tmp_path_factory.mktemp("serve"), "--local-agents", "2", "--max-queue", "2", "--slots", "1",
                                "--request-timeout", "120", "--rebalance-every", "0",
                                "--plan", "even")  # every agent has work: a benchmark taken on a busy machine may plan one out
    yield url
    stop_server(process)
    assert process.returncode == 0, "the server did not shut down cleanly on SIGTERM"


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def cli_greedy(prompt: str, tokens: int) -> str:
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--prompt", prompt, "--max-new-tokens",
                          str(tokens), "--temperature", "0", "--local-agents", "2", "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)["text"]


def cluster(server) -> dict:
    r = httpx.get(server + "/v1/halo/cluster", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    r.raise_for_status()
    return r.json()


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["stories260K"]
    health = httpx.get(server + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_streamed_completion_equals_the_cli_greedy_output(client):
    expected = cli_greedy(PROMPT, 60)
    stream = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=60, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == expected
    assert finish == "length"
    assert usage.completion_tokens == 60 and usage.prompt_tokens == 5  # BOS + 4 tokens
    assert usage.total_tokens == 65


def test_non_streamed_completion_with_usage_and_a_seed(client):
    a = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=20, temperature=0.8, seed=7)
    b = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=20, temperature=0.8, seed=7)
    assert a.object == "text_completion" and a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 20
    assert a.choices[0].text == b.choices[0].text  # same seed, same sample
    greedy = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=20, temperature=0)
    assert greedy.choices[0].text == cli_greedy(PROMPT, 20)


def test_stop_strings_are_honoured_streamed_and_not(client):
    full = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    assert "Lily" in full
    cut = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40, temperature=0, stop=["Lily"])
    assert cut.choices[0].text == full[:full.index("Lily")]
    assert cut.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40, temperature=0,
                                       stop=["named L", "zzz"], stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index("named L")]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_without_a_template_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 400
    assert "no chat template" in e.value.message and "/v1/completions" in e.value.message


def test_401_without_or_with_a_wrong_key(server):
    c = openai.OpenAI(base_url=server + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.completions.create(model="stories260K", prompt=PROMPT, max_tokens=2)
    r = httpx.post(server + "/v1/completions", json={"model": "stories260K", "prompt": PROMPT}, timeout=10)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server + "/metrics", timeout=10).status_code == 401
    assert httpx.get(server + "/v1/halo/cluster", timeout=10).status_code == 401
    assert httpx.get(server + "/health", timeout=10).status_code == 200  # for load balancers
    assert httpx.get(server + "/", timeout=10).status_code == 200  # the page asks for the key itself


@pytest.mark.parametrize("body, where, param", [
    (b"{not json", "not valid JSON", None),
    ({"model": "stories260K", "prompt": PROMPT, "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"model": "stories260K", "prompt": PROMPT, "temperature": -0.5}, "temperature", "temperature"),
    ({"model": "stories260K", "prompt": PROMPT, "n": 2}, "one choice", "n"),
    ({"model": "stories260K", "prompt": PROMPT, "n": 0}, "n must be 1", "n"),  # param was null: a model-level check
    ({"model": "stories260K", "prompt": PROMPT, "logprobs": 0}, "logprobs", "logprobs"),  # completions' 0: chosen tokens'
    ({"model": "stories260K", "prompt": PROMPT, "stream": "yes"}, "stream", "stream"),
    ({"model": "stories260K", "prompt": PROMPT, "seed": -1}, "seed", "seed"),  # once a 500 that took the cluster down
    ({"model": "stories260K", "prompt": "word " * 600}, "context holds", None),
    ({"model": "stories260K", "prompt": PROMPT, "response_format": "json_object"}, "only text", "response_format"),  # 500
    ({"model": "stories260K", "prompt": PROMPT, "logit_bias": {"300": 100}}, "logit_bias", "logit_bias"),  # ignored
])
def test_400_for_bad_requests(server, body, where, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + "/v1/completions", content=content, timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert where in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def test_an_unknown_model_is_404_model_not_found(server):
    r = httpx.post(server + "/v1/completions", json={"model": "gpt-4", "prompt": PROMPT}, timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert "unknown model 'gpt-4'" in error["message"] and error["code"] == "model_not_found" and error["param"] == "model"


def test_null_sampling_fields_are_their_defaults(server):
    """OpenAI's clients send null for what is left unset: it is the default, not a 400."""
    body = {"model": "stories260K", "prompt": PROMPT, "max_tokens": 4, "seed": 3}
    nulls = {"temperature": None, "top_p": None, "top_k": None, "stream": None}
    answers = [httpx.post(server + "/v1/completions", json=b, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})
               for b in (body, {**body, **nulls})]
    assert [r.status_code for r in answers] == [200, 200], answers[1].text
    assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]


def test_400_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="stories260K", prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        client.completions.create(model="nope", prompt=PROMPT)


def test_a_temperature_too_small_for_the_logits_is_greedy_and_the_cluster_stays_up(server, client):
    """5e-324 overflowed the sampler mid-generation, which the engine took for a cluster failure (500, agents
    reloaded); its limit is greedy decoding."""
    tiny = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=6, temperature=5e-324, seed=1)
    greedy = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=6, temperature=0)
    assert tiny.choices[0].text == greedy.choices[0].text
    assert httpx.get(server + "/health", timeout=10).json()["status"] == "ok"
    assert cluster(server)["totals"].get("last_error") is None


def _hold_stream(server, started: threading.Event, stop: threading.Event, tokens: int = 500):
    """A streaming request that reads its first chunk, then holds the connection until `stop`."""
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "stories260K", "prompt": "", "max_tokens": tokens, "temperature": 0,
                            "stream": True}) as r:
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                return
        started.set()


def test_429_when_the_queue_is_full_and_the_cluster_frees_up(server, client):
    stop = threading.Event()
    threads = []
    try:
        running = threading.Event()
        threads.append(threading.Thread(target=_hold_stream, args=(server, running, stop), daemon=True))
        threads[-1].start()
        assert running.wait(30)
        for _ in range(2):  # --max-queue 2
            threads.append(threading.Thread(target=_hold_stream, args=(server, threading.Event(), stop), daemon=True))
            threads[-1].start()
        deadline = time.monotonic() + 20
        while cluster(server)["queue"]["waiting"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cluster(server)["queue"] == {"waiting": 2, "limit": 2, "running": True, "slots": 1, "slots_busy": 1}
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=2)
        assert "--max-queue 2" in e.value.message
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    deadline = time.monotonic() + 10
    idle = {"waiting": 0, "limit": 2, "running": False, "slots": 1, "slots_busy": 0}
    while cluster(server)["queue"] != idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_a_client_that_disconnects_mid_stream_frees_the_cluster_within_a_second(server, client):
    before = cluster(server)["totals"]["requests"]["cancelled"]
    with httpx.stream("POST", server + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "stories260K", "prompt": "", "max_tokens": 500, "temperature": 0,
                            "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    left = time.perf_counter()  # the connection is closed here
    stream = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=5, temperature=0, stream=True)
    first = next(iter(stream))
    waited = time.perf_counter() - left
    assert first.choices[0].text
    list(stream)
    assert waited < 1.0, f"the next request waited {waited:.2f} s for the cluster"
    assert cluster(server)["totals"]["requests"]["cancelled"] == before + 1


def test_a_non_streamed_request_whose_client_leaves_is_cancelled(server, client):
    before = cluster(server)["totals"]["requests"]["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "stories260K", "prompt": "", "max_tokens": 500, "temperature": 0},
                   timeout=httpx.Timeout(10, read=0.5))
    left = time.perf_counter()
    with client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=2, stream=True) as stream:
        first = next(iter(stream))
        waited = time.perf_counter() - left
        list(stream)  # read to the end: a stream closed early is a cancellation too (it raced the count below)
    assert first.choices[0].text and waited < 1.0, f"the next request waited {waited:.2f} s"
    assert cluster(server)["totals"]["requests"]["cancelled"] == before + 1


def requests_counted(server) -> dict[str, float]:
    """/metrics' halo_requests_total of the completions endpoint, by outcome."""
    text = httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    found = re.findall(r'^halo_requests_total\{endpoint="completions",outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {outcome: float(value) for outcome, value in found}


def test_the_cluster_view_and_metrics(server, client):
    before = requests_counted(server)
    client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=10, temperature=0)
    after = requests_counted(server)  # a request answered whole (not streamed) counts as completed, not as an error
    assert after.get("completed", 0) == before.get("completed", 0) + 1 and after.get("error") == before.get("error")
    view = cluster(server)
    assert view["state"] == "idle" and view["sync"] == "exact"
    names = [d["name"] for d in view["devices"]]
    assert names[0] == "master" and len(names) == 3
    assert abs(sum(d["share"] for d in view["devices"]) - 1.0) < 0.01
    assert all(d["alive"] for d in view["devices"])
    assert all(d["compute_ms_per_token"] > 0 for d in view["devices"]), view["devices"]
    assert all(d["sync_ms_per_token"] is not None for d in view["devices"][1:])
    assert view["current"]["decode_steps"] == 9 and view["current"]["finished"]
    metrics = httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    for line in ('halo_agent_up{device="master",role="master"} 1.0', "halo_generated_tokens_total",
                 "halo_time_per_token_seconds_bucket", "halo_time_to_first_token_seconds_count",
                 'halo_datagrams_dropped_total{cause="deadline"}', "halo_device_sync_wait_seconds_per_token",
                 'halo_requests_total{endpoint="completions",outcome="completed"}', "halo_tokens_per_second"):
        assert line in metrics, line
    events = []
    with httpx.stream("GET", server + "/v1/halo/cluster/events", timeout=10,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                break
    assert events and events[0]["devices"][1]["name"] == names[1]


def test_status_server_prints_the_same_view(server):
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "status", "--server", server, "--api-key", API_KEY,
                          "--json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert [d["role"] for d in json.loads(out.stdout)["devices"]] == ["master", "agent", "agent"]
    table = subprocess.run([sys.executable, "-m", "halo.cli.master", "status", "--server", server, "--api-key", API_KEY],
                           capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "160"})
    assert table.returncode == 0, table.stderr
    assert "local-1#1" in table.stdout and "compute" in table.stdout
    # Ctrl-C must reach it: a test run started in the background (`.ci/run &`) ignores SIGINT, which children inherit
    watch = subprocess.Popen([sys.executable, "-m", "halo.cli.master", "status", "--server", server, "--api-key", API_KEY,
                              "--watch", "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "COLUMNS": "160"},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(3)
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=10)
    assert watch.returncode == 0, err
    assert out.count("local-2#2") >= 1 and "ms/token" in out
    denied = subprocess.run([sys.executable, "-m", "halo.cli.master", "status", "--server", server], capture_output=True,
                            text=True, timeout=30)
    assert denied.returncode == 2 and "API key" in denied.stderr


def test_listening_beyond_localhost_without_a_key_warns_loudly(tmp_path):
    process, url = start_server(tmp_path, "--host", "0.0.0.0", api_key=False)
    try:
        assert httpx.get(url.replace("0.0.0.0", "127.0.0.1") + "/health", timeout=10).status_code == 200
    finally:
        stop_server(process)
    assert "WITHOUT an API key" in process.said()


@pytest.mark.parametrize("slots", [1, 2])
def test_sigterm_ends_running_and_waiting_requests_with_a_shutting_down_503(tmp_path, slots):
    """On SIGTERM a streamed request gets an error event and [DONE], a plain one a 503 "shutting_down" (one waiting
    in the queue with --slots 1, both in the batch with 2), and the server exits 0. (The engine closed only after
    uvicorn's graceful shutdown: the stream was cut mid-token and the plain request got a bare 500.)"""
    # over an agent a token takes milliseconds: a whole context (511 tokens) lasts seconds
    process, url = start_server(tmp_path, "--local-agents", "1", "--plan", "even", "--rebalance-every", "0",
                                "--max-queue", "2", "--slots", str(slots), "--request-timeout", "120")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "stories260K", "prompt": "", "max_tokens": 2000, "temperature": 0}
    streamed, answered, started = [], [], threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=60, headers=headers, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: "):
                    streamed.append(line[6:])

    def plain():
        answered.append(httpx.post(url + "/v1/completions", timeout=60, headers=headers, json=body))

    threads = [threading.Thread(target=stream, daemon=True), threading.Thread(target=plain, daemon=True)]
    try:
        threads[0].start()
        assert started.wait(30)
        threads[1].start()
        for _ in range(600):  # until the plain request is in: queued (--slots 1) or in the batch (2)
            queue = cluster(url)["queue"]
            if (queue["waiting"] if slots == 1 else queue["slots_busy"]) == 1 + (slots > 1):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the plain request never got in: {queue}")
        assert not answered, "the stream's 511 tokens ended before the plain request was in"
        process.terminate()
        for t in threads:
            t.join(30)
    finally:
        stop_server(process)
    assert process.returncode == 0
    assert streamed[-1] == "[DONE]" and json.loads(streamed[-2])["error"]["code"] == "shutting_down", streamed[-3:]
    assert answered and answered[0].status_code == 503 and answered[0].json()["error"]["code"] == "shutting_down"
