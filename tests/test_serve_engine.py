"""The serving engine in process: cancellation, timeouts, stop strings, queue bounds, rebuilds, the view."""

import asyncio
import time

import pytest

pytest.importorskip("starlette", reason="halo.serve needs the serve extra")

from halo.generation.generate import GenerationCancelled, generate  # noqa: E402
from halo.model.loader import load_tokenizer  # noqa: E402
from halo.compute.transformer import Transformer  # noqa: E402
from halo.generation.sampling import SamplingSettings  # noqa: E402
from halo.serve.app import create_app  # noqa: E402
from halo.serve.engine import Cancelled, Engine, GenerationRequest, StopScanner  # noqa: E402
from halo.serve.protocol import ClusterUnavailable, QueueFull, RequestTimeout  # noqa: E402
from halo.serve.view import render  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

GREEDY = SamplingSettings()


@pytest.fixture(scope="module")
def tokenizer(stories_weights):
    return load_tokenizer(stories_weights)


def engine_for(weights, tokenizer, open_model=None, **kwargs):
    open_model = open_model or (lambda stack: Transformer(weights, max_seq_len=512))
    return Engine(open_model, tokenizer, weights, model_name="stories260K", **kwargs).start()


def request(prompt="Once upon a time", tokens=20, stop=()):
    return GenerationRequest(prompt, 0, tokens, GREEDY, tuple(stop))


async def collect(job):
    """(text, final event) of a job."""
    text = []
    while True:
        kind, value = await job.events.get()
        if kind == "text":
            text.append(value)
        else:
            return "".join(text), (kind, value)


def test_generate_stops_when_cancelled_and_the_model_serves_the_next_request(stories_weights, tokenizer):
    model = Transformer(stories_weights, max_seq_len=512)
    full = generate(model, tokenizer, "Once upon a time", 30)
    asked = []

    def after_ten() -> bool:
        asked.append(1)
        return len(asked) > 10

    with pytest.raises(GenerationCancelled) as e:
        generate(model, tokenizer, "Once upon a time", 30, cancelled=after_ten)
    assert e.value.result.token_ids == full.token_ids[:10]  # 1 prefill + 9 decode steps ran, 10 tokens sampled
    assert full.text.startswith(e.value.result.text)
    assert generate(model, tokenizer, "Once upon a time", 30).text == full.text


def test_stop_scanner_holds_back_only_possible_stop_prefixes():
    s = StopScanner(("named Lily", "\n\n"))
    assert s.feed("there was a girl na") == "there was a girl "
    assert s.feed("med") == ""
    assert s.feed(" Tom") == "named Tom"
    assert s.feed("\n") == ""
    assert s.feed("\nmore") == "" and s.stopped
    assert s.flush() == ""
    plain = StopScanner(())
    assert plain.feed("abc") == "abc" and not plain.stopped
    tail = StopScanner(("xyz",))
    assert tail.feed("abx") == "ab" and tail.flush() == "x"


def test_stop_string_and_text_match_greedy(stories_weights, tokenizer):
    full = generate(Transformer(stories_weights, max_seq_len=512), tokenizer, "Once upon a time", 40).text
    engine = engine_for(stories_weights, tokenizer)
    try:
        async def run():
            loop = asyncio.get_running_loop()
            plain = await collect(engine.submit(request(tokens=40), loop))
            cut = await collect(engine.submit(request(tokens=40, stop=["Lily"]), loop))
            return plain, cut

        (text, (kind, outcome)), (cut, (kind2, outcome2)) = asyncio.run(run())
    finally:
        engine.close()
    assert kind == "done" and text == full and outcome.finish_reason == "length" and outcome.completion_tokens == 40
    assert kind2 == "done" and cut == full[:full.index("Lily")] and outcome2.finish_reason == "stop"
    assert outcome2.completion_tokens < 40


@pytest.mark.parametrize("slots", [1, 4])
def test_a_stop_string_the_last_allowed_token_completes_is_a_stop(stories_weights, tokenizer, slots):
    """max_tokens reached by the very token that completes a stop string: the text is cut there and the finish is
    "stop", one request at a time (--slots 1) as in a batch."""
    full = generate(Transformer(stories_weights, max_seq_len=512), tokenizer, "Once upon a time", 12).text
    stop = full[-5:]
    assert full.index(stop) == len(full) - 5, "the stop string must first appear at the end"
    engine = engine_for(stories_weights, tokenizer, lambda stack: Transformer(stories_weights, max_seq_len=512, slots=slots))
    try:
        async def run():
            return await collect(engine.submit(request(tokens=12, stop=[stop]), asyncio.get_running_loop()))

        text, (kind, outcome) = asyncio.run(run())
    finally:
        engine.close()
    assert kind == "done" and text == full[:-5] and outcome.finish_reason == "stop"


def test_queue_bound_cancel_while_waiting_and_timeouts(stories_weights, tokenizer):
    engine = engine_for(stories_weights, tokenizer, max_queue=1, request_timeout_s=0.1)
    try:
        async def run():
            loop = asyncio.get_running_loop()
            running = engine.submit(request(prompt="", tokens=400), loop)
            kind, _ = await running.events.get()  # it streams: it runs
            assert kind == "text"
            waiting = engine.submit(request(), loop)
            with pytest.raises(QueueFull):
                engine.submit(request(), loop)
            engine.cancel(waiting)
            assert engine.queue_state()["waiting"] == 0
            _, cancelled = await collect(waiting)
            _, timed_out = await collect(running)  # 400 tokens take longer than 0.1 s (~0.4 s on a fast core)
            return cancelled, timed_out

        t = time.monotonic()
        cancelled, timed_out = asyncio.run(run())
        took = time.monotonic() - t
    finally:
        engine.close()
    assert cancelled[0] == "error" and isinstance(cancelled[1], Cancelled)
    assert timed_out[0] == "error" and isinstance(timed_out[1], RequestTimeout) and "--request-timeout" in str(timed_out[1])
    assert took < 5
    assert engine.totals.requests["timeout"] == 1 and engine.totals.requests["cancelled"] == 1


def agent_processes() -> list:
    """This process's local agents (children running halo.edge_agent)."""
    import psutil

    found = []
    for p in psutil.Process().children():
        try:  # a child another test left unreaped (a zombie) has no command line: not an agent of this test
            if "halo.edge_agent" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def named(process, name: str) -> bool:
    """Whether a local agent runs with --name `name` (its key path, /tmp/halo-local-XXXX/, may contain any name)."""
    argv = process.cmdline()
    return "--name" in argv and argv[argv.index("--name") + 1] == name


def test_an_agent_failure_is_planned_around_inside_the_request(stories_weights, tokenizer):
    """--on-agent-loss replan (the default): the request completes on the agent left; the view says so."""
    from halo.distributed import connect

    def open_model(stack):
        return connect(stories_weights, stack, local_agents=2, context=512, timeout=1.0)

    expected = generate(Transformer(stories_weights, max_seq_len=512), tokenizer, "Once upon a time", 12).text
    engine = engine_for(stories_weights, tokenizer, open_model)
    try:
        victim = next(p for p in agent_processes() if named(p, "local-2"))
        victim.kill()
        victim.wait(10)

        async def run():
            return await collect(engine.submit(request(tokens=12), asyncio.get_running_loop()))

        text, (kind, _) = asyncio.run(run())
        view = engine.snapshot
    finally:
        engine.close()
    assert text == expected and kind == "done"
    assert engine.totals.rebuilds == 0 and view["replans"]["count"] == 1
    assert view["replans"]["last"]["lost"] and "local-2" not in " ".join(d["name"] for d in view["devices"])
    assert [d["role"] for d in view["devices"]] == ["master", "agent"]


def test_an_agent_failure_fails_one_request_then_the_cluster_is_rebuilt(stories_weights, tokenizer):
    """--on-agent-loss stop: the request fails naming the agent; the next one rebuilds the cluster."""
    from halo.distributed import connect

    def open_model(stack):
        return connect(stories_weights, stack, local_agents=2, context=512, timeout=1.0, survive=None)

    expected = generate(Transformer(stories_weights, max_seq_len=512), tokenizer, "Once upon a time", 12).text
    engine = engine_for(stories_weights, tokenizer, open_model)
    try:
        assert [d["name"] for d in engine.snapshot["devices"]] == ["master", "local-1#1", "local-2#2"]
        first = sorted(agent_processes(), key=lambda p: p.pid)
        assert len(first) == 2
        victim = next(p for p in first if named(p, "local-2"))
        victim.kill()
        victim.wait(10)

        async def run():
            loop = asyncio.get_running_loop()
            failed = await collect(engine.submit(request(tokens=12), loop))
            down = engine.snapshot
            listed = TestClient(create_app(engine)).get("/v1/models")  # docs/serving.md: 503 while down (it was 200)
            ok = await collect(engine.submit(request(tokens=12), loop))
            return failed, down, listed, ok

        failed, down, listed, ok = asyncio.run(run())
        assert listed.status_code == 503 and listed.json()["error"]["code"] == "cluster_unavailable"
        second = agent_processes()
    finally:
        engine.close()
    assert isinstance(failed[1][1], ClusterUnavailable) and "local-2" in str(failed[1][1])
    assert down["state"] == "down"
    assert [d["alive"] for d in down["devices"]] == [True, True, False]
    assert ok[0] == expected and ok[1][0] == "done"
    assert engine.totals.rebuilds == 1
    assert len(second) == 2 and not {p.pid for p in second} & {p.pid for p in first}  # new agents; the old ones gone
    assert not agent_processes()  # closing the engine stopped them


def test_the_view_shows_what_halo_sync_dropped(stories_weights, tokenizer):
    from rich.console import Console

    from halo.distributed import connect
    from halo.sync import SyncSettings

    def open_model(stack):
        return connect(stories_weights, stack, local_agents=2, context=512, plan="even",  # every agent has work
                       sync=SyncSettings(mode="halo", inject_plr=0.2, seed=3))

    engine = engine_for(stories_weights, tokenizer, open_model, sync_mode="halo")
    try:
        async def run():
            return await collect(engine.submit(request(tokens=20), asyncio.get_running_loop()))

        _, (kind, _) = asyncio.run(run())
        snapshot = engine.snapshot
    finally:
        engine.close()
    assert kind == "done"
    loss = snapshot["loss"]
    assert loss["partials_dropped"] > 0 and loss["dropped_by_layer"] and loss["dropped_rank_mean"] is not None
    agents = snapshot["devices"][1:]
    assert all(d["link_plr"] is not None and d["rtt_ms"] is not None and d["observed_plr"] > 0 for d in agents)
    console = Console(width=140, record=True)
    console.print(render(snapshot))
    out = console.export_text()
    assert "local-1#1" in out and "predicted rank of dropped groups" in out and "layer" in out


@pytest.mark.parametrize("slots", [1, 4])
def test_a_requests_own_error_fails_the_request_and_keeps_the_cluster(stories_weights, tokenizer, monkeypatch, slots):
    """Anything but the cluster's failure (here: the sampler raising, as "seed": -1 once did) fails that request
    alone: the cluster answers a reset and serves the next request, no rebuild. One generation at a time and batched."""
    from halo.serve import engine as engine_module

    expected = generate(Transformer(stories_weights, max_seq_len=512), tokenizer, "Once upon a time", 12).text
    engine = engine_for(stories_weights, tokenizer, lambda stack: Transformer(stories_weights, max_seq_len=512,
                                                                              slots=slots))
    calls = []
    if slots == 1:
        real = engine_module.generate

        def failing_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise ValueError("a sampler's own error")
            return real(*args, **kwargs)

        monkeypatch.setattr(engine_module, "generate", failing_once)
    else:
        real = engine_module.Sampler

        def failing_once(settings):
            calls.append(1)
            if len(calls) == 1:
                def fail(logits):
                    raise ValueError("a sampler's own error")
                return fail
            return real(settings)

        monkeypatch.setattr(engine_module, "Sampler", failing_once)
    try:
        async def run():
            loop = asyncio.get_running_loop()
            failed = await collect(engine.submit(request(tokens=12), loop))
            ok = await collect(engine.submit(request(tokens=12), loop))
            return failed, ok

        failed, ok = asyncio.run(run())
        assert failed[1][0] == "error" and "a sampler's own error" in str(failed[1][1])
        assert ok[0] == expected and engine.totals.rebuilds == 0 and engine.snapshot["state"] != "down"
    finally:
        engine.close()


def test_a_speculating_engine_serves_the_same_text_and_counts_its_drafts(stories_weights, tokenizer):
    """serve --speculate K: each answer is plain decoding's (greedy), and /metrics counts drafted and accepted tokens
    and the passes they took."""
    from halo.generation.speculative import SpeculationSettings
    from halo.serve.metrics import Metrics

    prompt = "Once upon a time, there was a little girl named Lily. Once upon a time, there was a little"
    full = generate(Transformer(stories_weights, max_seq_len=512), tokenizer, prompt, 60).text
    engine = engine_for(stories_weights, tokenizer, speculation=(SpeculationSettings(max_drafts=4), None))
    try:
        async def run():
            return await collect(engine.submit(request(prompt, tokens=60), asyncio.get_running_loop()))

        text, (kind, outcome) = asyncio.run(run())
        engine._publish()
        metrics = Metrics(engine).exposition().decode()
    finally:
        engine.close()
    totals = engine.totals
    assert kind == "done" and text == full and outcome.completion_tokens == 60
    assert 0 < totals.speculative_accepted_tokens <= totals.speculative_drafted_tokens
    assert totals.speculative_passes < 59  # fewer passes than tokens after the first
    for name, value in (("halo_speculative_drafted_tokens_total", totals.speculative_drafted_tokens),
                        ("halo_speculative_accepted_tokens_total", totals.speculative_accepted_tokens),
                        ("halo_speculative_passes_total", totals.speculative_passes)):
        assert f"{name} {float(value)}" in metrics, name


def test_a_speculating_engine_counts_no_tokens_past_a_stop_string(stories_weights, tokenizer):
    """Drafts accepted in the pass that completed a stop string were counted in usage: 14 completion tokens with
    --speculate where plain decoding said 13, for the same text."""
    from halo.generation.speculative import SpeculationSettings

    prompt = "Lily and Tom went to the park. They played with a ball. " * 4
    outcomes = []
    for speculation in ((SpeculationSettings(), None), (SpeculationSettings(max_drafts=8), None)):
        engine = engine_for(stories_weights, tokenizer, speculation=speculation)
        try:
            async def run():
                return await collect(engine.submit(request(prompt, tokens=40, stop=("ball",)),
                                                   asyncio.get_running_loop()))
            outcomes.append(asyncio.run(run()))
        finally:
            engine.close()
    (plain_text, (_, plain)), (spec_text, (_, spec)) = outcomes
    assert spec_text == plain_text and plain.finish_reason == spec.finish_reason == "stop"
    assert spec.completion_tokens == plain.completion_tokens
