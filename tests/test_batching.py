"""Continuous batching: several sequences in one pass (halo/compute/batch.py, halo/serve/batching.py), every sequence's tokens
those it gets alone, in one process, over a cluster, and through the serving engine under any interleaving."""

import asyncio
import contextlib
import mmap
import random

import numpy as np
import pytest

from halo.compute.batch import Rows, Segment
from halo.compute.transformer import Transformer
from halo.generation.generate import Continuation, encode_prompt
from halo.generation.sampling import Sampler, SamplingSettings
from halo.model.loader import load_tokenizer, load_weights
from halo.serve.batching import Running, next_pass, take_pass
from halo.sync.framing import FramingError, frame_broadcast, read_broadcast


@pytest.fixture(scope="module")
def q4_weights(tmp_path_factory):
    """A small random Q4_0 Llama: its blocks run through halo's C decode steps (the kernels batching relies on)."""
    from gguf_models import tiny_gguf

    return load_weights(tiny_gguf(tmp_path_factory.mktemp("batch") / "q4.gguf", "Q4_0", seed=5))


# ---- rows ------------------------------------------------------------------------------------------------------------
def test_rows_are_runs_of_one_slots_consecutive_positions():
    rows = Rows.from_table([2, 2, 2, 0, 5], [7, 8, 9, 3, 0])
    assert rows.segments == (Segment(0, 3, 2, 7), Segment(3, 4, 0, 3), Segment(4, 5, 5, 0))
    assert len(rows) == 5 and rows.last_rows.tolist() == [2, 3, 4]
    assert rows.last_only() == Rows.of([(2, 9, 1), (0, 3, 1), (5, 0, 1)])
    assert rows.table.tolist() == [[2, 7], [2, 8], [2, 9], [0, 3], [5, 0]] and rows.table.dtype == np.int32
    assert Rows.from_table(*rows.table.T.tolist()) == rows == Rows.of([(2, 7, 3), (0, 3, 1), (5, 0, 1)])
    for slots, positions in (([1, 0, 1], [0, 0, 1]), ([1, 1], [4, 6]), ([-1], [0]), ([0], [-2]), ([], [])):
        with pytest.raises(ValueError):  # a slot in two runs (or a gap in its positions), negatives, nothing
            Rows.from_table(slots, positions)
    rows.check(5, 10, 6)
    with pytest.raises(ValueError, match="slot 5 named; this model keeps 4 KV-cache slots"):
        rows.check(5, 10, 4)
    with pytest.raises(ValueError, match="position 9 exceeds the context length 9"):
        rows.check(5, 9, 6)
    with pytest.raises(ValueError, match="5 rows named for a pass of 4 tokens"):
        rows.check(4, 10, 6)


def test_a_batched_broadcast_carries_each_rows_slot_and_position_and_refuses_nonsense():
    x = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
    rows = Rows.of([(4, 10, 2), (1, 0, 1)])
    ranking = np.tile(np.arange(5), (3, 1))[:, ::-1]
    from halo.sync.framing import ranking_digest

    for kwargs in ({}, {"ranking": ranking}):
        digest = ranking_digest(kwargs["ranking"]) if kwargs else 0
        got = read_broadcast(frame_broadcast(x, rows, digest, 16, **kwargs), 8)
        assert got.start == rows and np.array_equal(got.x, x)
        assert (got.ranking is None) == (not kwargs) and (not kwargs or np.array_equal(got.ranking, ranking))
    plain = read_broadcast(frame_broadcast(x, 7, 0, 16), 8)
    assert plain.start == 7
    body = frame_broadcast(x, rows, 0, 16)
    table = 4 + 3 * 8
    for change, why in (((table, 1.5), "whole number"), ((table + 4, 4.0), "rows make no sense"),
                        ((table + 1, -3.0), "rows make no sense"), ((table, np.inf), "rows make no sense")):
        forged = body.copy()
        forged[change[0]] = change[1]
        with pytest.raises(FramingError, match=why):
            read_broadcast(forged, 8)
    forged = body.copy()
    forged[1] = -2  # a negative start other than the batched mark
    with pytest.raises(FramingError, match="claims 3 tokens at position -2"):
        read_broadcast(forged, 8)


# ---- one process -----------------------------------------------------------------------------------------------------
def _alone(weights, prompt, tokens, fmt="native"):
    """Greedy tokens of one sequence run alone in slot 0 (its prompt in one batched pass)."""
    model = Transformer(weights, fmt=fmt, max_seq_len=64)
    logits = model.forward_rows(prompt, Rows.of([(0, 0, len(prompt))]))[0]
    out = []
    for _ in range(tokens):
        out.append(int(np.argmax(logits)))
        logits = model.forward_rows([out[-1]], Rows.of([(0, len(prompt) + len(out) - 1, 1)]))[0]
    return out


@pytest.mark.parametrize("fmt", ["native", "int8"])
def test_a_sequences_logits_are_the_same_bits_in_any_batch(q4_weights, fmt):
    """Prompt pieces and decode rows of several slots in one pass: each sequence's logits are bit for bit those of
    the same rows alone (C decode steps; the int8 kernels row by row)."""
    model = Transformer(q4_weights, fmt=fmt, max_seq_len=64, slots=3)
    rng = np.random.default_rng(0)
    a, b = rng.integers(1, 200, 7).tolist(), rng.integers(1, 200, 12).tolist()
    both = model.forward_rows(a + b[:5], Rows.of([(2, 0, 7), (0, 0, 5)]))
    rest = model.forward_rows([9] + b[5:], Rows.of([(2, 7, 1), (0, 5, 7)]))
    alone = Transformer(q4_weights, fmt=fmt, max_seq_len=64)
    assert np.array_equal(alone.forward_rows(a, Rows.of([(0, 0, 7)]))[0], both[0])
    assert np.array_equal(alone.forward_rows([9], Rows.of([(0, 7, 1)]))[0], rest[0])
    alone.reset()
    alone.forward_rows(b[:5], Rows.of([(0, 0, 5)]))
    assert np.array_equal(alone.forward_rows(b[5:], Rows.of([(0, 5, 7)]))[0], rest[1])
    with pytest.raises(ValueError, match="slot 3 named; this model keeps 3 KV-cache slots"):
        model.forward_rows([1], Rows.of([(3, 0, 1)]))


def test_kv_cache_pages_become_resident_as_positions_are_written():
    """16 slots of a 2,048-position cache: a token in each makes kilobytes resident, not the budget (transparent huge
    pages made 2 MB per slot and layer resident at its first position)."""
    from halo.host.memory import zeros_by_page

    cache = zeros_by_page((16, 2048, 3, 64))  # 25 MB
    before = _resident(cache)
    cache[:, 0] = 1.0
    assert _resident(cache) - before <= 16 * 2 * mmap.PAGESIZE
    assert cache.flags.writeable and cache.flags.c_contiguous and not cache[:, 1:].any()


def _resident(array: np.ndarray) -> int:
    """Bytes of the array's mapping resident now (/proc/self/smaps Rss of the mapping that holds it)."""
    address, rss, inside = array.ctypes.data, 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                rss = int(line.split()[1]) * 1024
    return rss


# ---- the scheduler: any interleaving -----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_every_request_gets_its_alone_tokens_under_any_interleaving(q4_weights, seed):
    """Requests join at random passes into random free slots, with random prompt budgets a pass: each one's greedy
    tokens are those it gets alone."""
    tokenizer = load_tokenizer(q4_weights)
    rng = random.Random(seed)
    prompts = [[1, *(rng.randrange(3, 250) for _ in range(rng.randrange(1, 20)))] for _ in range(6)]
    budgets = [rng.randrange(1, 9) for _ in prompts]
    expected = [_alone(q4_weights, p, n) for p, n in zip(prompts, budgets)]
    model = Transformer(q4_weights, fmt="native", max_seq_len=64, slots=3)
    waiting, running, done = list(range(len(prompts))), [], {}
    while waiting or running:
        free = sorted(set(range(3)) - {r.slot for r in running})
        while waiting and free and rng.random() < 0.6:
            i = waiting.pop(0)
            going = Continuation(tokenizer, prompts[i], budgets[i], 64, stop_at_eos=False)
            running.append(Running(free.pop(rng.randrange(len(free))), prompts[i], going, Sampler(SamplingSettings()), i))
        step = next_pass(running, rng.randrange(1, 12))
        if step is None:
            continue
        for member in take_pass(step, model.forward_rows(step.tokens, step.rows)):
            running.remove(member)
            done[member.owner] = member.going.finish().token_ids
    assert [done[i] for i in range(len(prompts))] == expected


def test_a_pass_reads_prompts_within_its_budget_and_decodes_everyone():
    class Going:
        max_new_tokens = 5

    a = Running(0, [1, 2, 3, 4, 5], Going(), None, "a", read=5, chosen=7)
    b = Running(1, list(range(20)), Going(), None, "b", read=4)
    c = Running(2, list(range(9)), Going(), None, "c")
    step = next_pass([a, b, c], pass_rows=10)  # a's decode row, then 9 of b's prompt
    assert step.rows == Rows.of([(0, 5, 1), (1, 4, 9)]) and step.tokens == [7, *range(4, 13)]
    assert [m.owner for m in step.members] == ["a", "b"]  # c's prompt waits for the next pass's budget
    assert next_pass([Running(0, [1], Going(), None, "idle", read=1)], 10) is None


# ---- a cluster ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "tcp"])
def test_a_cluster_computes_each_sequence_of_a_batch_as_alone(q4_weights, mode):
    """Over local agents (UDP inputs with the rows' table; the control connection's second array): a batch's logits
    are those of each sequence's rows in a pass of their own, bit for bit."""
    from halo.distributed import connect
    from halo.sync import SyncSettings

    with contextlib.ExitStack() as stack:
        model = connect(q4_weights, stack, model_path=str(q4_weights.source), local_agents=2, context=64,
                        timeout=5.0, plan="even", slots=4, fmt="native", sync=SyncSettings(mode=mode), survive=None)
        a, b = [1, 5, 9, 11, 3], [1, 8, 7]
        first = model.forward_rows(a + b, Rows.of([(3, 0, 5), (1, 0, 3)]))
        both = model.forward_rows([11, 12], Rows.of([(3, 5, 1), (1, 3, 1)]))
        model.reset()
        assert np.array_equal(model.forward_rows(a, Rows.of([(0, 0, 5)]))[0], first[0])
        assert np.array_equal(model.forward_rows([11], Rows.of([(0, 5, 1)]))[0], both[0])
        assert np.array_equal(model.forward_rows(b, Rows.of([(2, 0, 3)]))[0], first[1])
        assert np.array_equal(model.forward_rows([12], Rows.of([(2, 3, 1)]))[0], both[1])


def test_an_agent_refuses_a_batched_block_whose_rows_make_no_sense(q4_weights):
    from halo.distributed import AgentError, LocalCluster, cluster_model
    from halo.sync import SyncSettings

    with LocalCluster(1, model_path=str(q4_weights.source)) as cluster:
        model = cluster_model(q4_weights, cluster.endpoints, cluster.key, plan="even", context=64, fmt="native",
                              slots=2, sync=SyncSettings(mode="tcp"))
        try:
            agent = model.agents[1]
            x = np.zeros((2, q4_weights.config.dim), np.float32)
            for table, why in ((np.array([[0, 0], [0, 2]]), "rows make no sense"),
                               (np.array([[0, 0]]), "rows make no sense"),
                               (np.array([[0.0, 0.0], [1.0, 0.0]], np.float32), "rows make no sense"),
                               (np.array([[5, 0], [1, 0]], np.int32), "slot 5 named; this model keeps 2"),
                               (np.array([[0, 63], [0, 64]], np.int32), "position 64 exceeds the context length 64")):
                agent.send("block", {"kind": "attention", "layer": 0, "start_pos": -1, "epoch": 1, "reply": "tcp"},
                           [x, table])
                with pytest.raises(AgentError, match=why):
                    agent.receive("a batched block")
            agent.send("block", {"kind": "attention", "layer": 0, "start_pos": -1, "epoch": 1, "reply": "tcp"},
                       [x, np.array([[1, 0], [0, 0]], np.int32)])
            assert agent.receive("a batched block").arrays[0].shape == x.shape  # and it goes on
        finally:
            model.close()


# ---- the serving engine ---------------------------------------------------------------------------------------------
def test_the_engine_serves_concurrent_requests_with_their_alone_text(stories_weights):
    """Eight requests at once into four slots (others wait for a slot): each text is the one it gets served alone."""
    from halo.serve.engine import Engine, GenerationRequest

    tokenizer = load_tokenizer(stories_weights)
    prompts = ["Once upon a time", "Lily and Tom", "The dog", "One day, a big", "She was happy", "The sun",
               "A little bird", "Tim had a red ball and"]

    def serve(requests):
        engine = Engine(lambda stack: Transformer(stories_weights, max_seq_len=256, slots=4), tokenizer,
                        stories_weights, model_name="stories260K").start()
        try:
            async def run():
                loop = asyncio.get_running_loop()
                jobs = [engine.submit(GenerationRequest(p, 0, n, SamplingSettings()), loop) for p, n in requests]
                outcomes = []
                for job in jobs:
                    while True:
                        kind, value = await job.events.get()
                        if kind != "text":
                            assert kind == "done", value
                            outcomes.append(value.text)
                            break
                return outcomes
            outcomes = asyncio.run(run())
        finally:
            engine.close()
        return outcomes, engine.queue_state()  # (a request's slot is given back just after its last event)

    requests = [(p, 10 + 3 * i) for i, p in enumerate(prompts)]
    together, state = serve(requests)
    assert state == {"waiting": 0, "limit": 32, "running": False, "slots": 4, "slots_busy": 0}
    for request, text in zip(requests, together):
        assert serve([request])[0] == [text], request
    assert encode_prompt(tokenizer, prompts[0], 256)[0] == tokenizer.bos_id


def test_full_slots_queue_then_refuse_and_a_cancelled_request_frees_its_slot_at_once(stories_weights):
    """--slots 2 --max-queue 1: two requests run, a third waits, a fourth gets QueueFull (HTTP 429); the client of a
    running one leaves: its slot goes to the waiting one at the next pass, and /metrics shows the slots."""
    from halo.serve.engine import Cancelled, Engine, GenerationRequest
    from halo.serve.metrics import Metrics
    from halo.serve.protocol import QueueFull

    tokenizer = load_tokenizer(stories_weights)
    tokenizer.eos_ids = ()  # the long requests run their whole budget (the story's end, at 345 tokens, raced the cancel)
    engine = Engine(lambda stack: Transformer(stories_weights, max_seq_len=512, slots=2), tokenizer, stories_weights,
                    model_name="stories260K", max_queue=1).start()
    counted = []
    engine.on_tokens = lambda prompt, completion: counted.append(completion)  # (set before a request: the engine's)
    try:
        async def run():
            loop = asyncio.get_running_loop()
            long = [engine.submit(GenerationRequest("", 0, 400, SamplingSettings()), loop) for _ in range(2)]
            for job in long:
                assert (await job.events.get())[0] == "text"  # both run
            waiting = engine.submit(GenerationRequest("Once upon a time", 0, 5, SamplingSettings()), loop)
            assert engine.queue_state() == {"waiting": 1, "limit": 1, "running": True, "slots": 2, "slots_busy": 2}
            with pytest.raises(QueueFull, match="--max-queue 1"):
                engine.submit(GenerationRequest("x", 0, 5, SamplingSettings()), loop)
            metrics = Metrics(engine).exposition().decode()
            assert "halo_slots 2.0" in metrics and "halo_slots_busy 2.0" in metrics
            engine.cancel(long[0])
            events = [await waiting.events.get() for _ in range(2)]
            assert events[0][0] == "text"
            while (event := await long[0].events.get())[0] == "text":
                pass
            assert event[0] == "error" and isinstance(event[1], Cancelled)
            while (event := await waiting.events.get())[0] == "text":
                pass
            assert event[0] == "done" and event[1].completion_tokens == 5
            engine.cancel(long[1])
            while (event := await long[1].events.get())[0] == "text":
                pass
            assert event[0] == "error" and isinstance(event[1], Cancelled)
        asyncio.run(run())
    finally:
        engine.close()
    assert engine.totals.requests["cancelled"] == 2 and engine.totals.requests["completed"] == 1
    # the cancelled requests' tokens count as generated (halo_generated_tokens_total counted completed ones alone)
    assert len(counted) == 2 and all(n > 0 for n in counted)


def test_a_batch_survives_a_killed_agent_every_slot_replayed(stories_weights):
    """Three sequences decoding together over three local agents; one agent is killed mid-batch: the master re-plans,
    replays every slot's history into the new assignment and goes on; each sequence's greedy tokens are those of an
    uninterrupted run (one process)."""
    from halo.distributed import LocalCluster, connect
    from halo.distributed.survive import SurvivalSettings

    tokenizer = load_tokenizer(stories_weights)
    prompts = [encode_prompt(tokenizer, p, 128) for p in ("Once upon a time", "The cat", "Lily had a big red")]

    def decode(model, kill_at=None, kill=None):
        running = [Running(slot, p, Continuation(tokenizer, p, 40, 128, stop_at_eos=False), Sampler(SamplingSettings()),
                           slot) for slot, p in enumerate(prompts)]
        out, passes = {}, 0
        while running:
            if passes == kill_at:
                kill()
            step = next_pass(running, 64)
            for member in take_pass(step, model.forward_rows(step.tokens, step.rows)):
                running.remove(member)
                out[member.owner] = member.going.finish().token_ids
            passes += 1
        return [out[i] for i in range(len(prompts))]

    expected = decode(Transformer(stories_weights, max_seq_len=128, slots=3))
    with LocalCluster(3) as cluster, contextlib.ExitStack() as stack:
        model = connect(stories_weights, stack, agents=cluster.endpoints, key=str(cluster.key_path), plan="even",
                        timeout=1.0, context=128, slots=3, survive=SurvivalSettings(rejoin_after_s=60.0))

        def kill():
            cluster.processes[1].kill()
            cluster.processes[1].wait()

        assert decode(model, kill_at=17, kill=kill) == expected
        assert len(model.recoveries) == 1 and cluster.endpoints[1] in model.recoveries[0].lost
        # every slot's positions so far (its prompt and the tokens decoded), not 0 (the re-plan's own prefix)
        assert model.recoveries[0].replayed_tokens >= sum(len(p) for p in prompts) + 3 * 10


def test_batched_serving_gives_generates_greedy_text_for_long_prompts(q4_weights):
    """A prompt far longer than a verification pass, served in a batch with another: its greedy text is
    `halo-master generate`'s (halo's C steps compute every position of any pass as a decode step of its own)."""
    from halo.generation.generate import generate
    from halo.serve.engine import Engine, GenerationRequest

    tokenizer = load_tokenizer(q4_weights)
    prompts = ["once upon a time there was a little girl who lived in a village near the forest " * 2, "the cat sat"]
    ids = encode_prompt(tokenizer, prompts[0], 256)
    assert len(ids) > 20
    alone = Transformer(q4_weights, fmt="native", max_seq_len=256).forward(ids)  # a prompt's pass
    beside = Transformer(q4_weights, fmt="native", max_seq_len=256, slots=2).forward_rows(
        [5, *ids], Rows.of([(1, 0, 1), (0, 0, len(ids))]))[1]
    assert np.array_equal(alone, beside)
    expected = [generate(Transformer(q4_weights, fmt="native", max_seq_len=256), tokenizer, p, 12).text
                for p in prompts]
    engine = Engine(lambda stack: Transformer(q4_weights, fmt="native", max_seq_len=256, slots=4), tokenizer,
                    q4_weights, model_name="q4").start()
    try:
        async def run():
            loop = asyncio.get_running_loop()
            jobs = [engine.submit(GenerationRequest(p, 0, 12, SamplingSettings()), loop) for p in prompts]
            texts = []
            for job in jobs:
                while (event := await job.events.get())[0] == "text":
                    pass
                assert event[0] == "done", event
                texts.append(event[1].text)
            return texts
        assert asyncio.run(run()) == expected
    finally:
        engine.close()
