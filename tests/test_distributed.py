"""The tensor-parallel runtime over local agents: exactness, failures, and hostile input."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from halo.compute.neuron_groups import GroupLayout
from halo.compute.shares import Shares, shares_from_plan
from halo.compute.transformer import Transformer
from halo.distributed import AgentError, LocalCluster, cluster_model
from halo.errors import ConfigError
from halo.generation.generate import generate
from halo.model.loader import load_tokenizer, load_weights
from halo.scheduler.even import even_plan
from halo.transport.reliable import Message, decode, encode, generate_key

CONTEXT = 512


def distributed(weights, cluster, compute=None, **settings):
    return cluster_model(weights, cluster.endpoints, cluster.key, compute=compute, context=CONTEXT, **settings)


@pytest.mark.parametrize("n_agents, compute", [(1, None), (2, None), (3, None), (4, None), (6, None), (8, None),
                                               (2, [4.0, 1.0, 2.0]), (3, [1.0, 3.0, 0.5, 2.0])])
def test_known_answer_over_local_agents(stories_weights, known_answer, n_agents, compute):
    with LocalCluster(n_agents) as cluster:
        model = distributed(stories_weights, cluster, compute)
        try:
            result = generate(model, load_tokenizer(stories_weights), "", 256)
        finally:
            model.close()
    assert result.text == known_answer


def test_the_master_computes_its_share_on_the_threads_asked(stories_weights, known_answer):
    """halo-master --threads N beside agents: the master's own share runs on N kernel threads (it ran on one whatever
    was asked), the known answer holds, and a count the kernels cannot take is refused by name."""
    from halo.distributed.session import MasterSettings

    with LocalCluster(1) as cluster:
        model = distributed(stories_weights, cluster, threads=2)
        try:
            assert model.worker.threads == 2
            assert generate(model, load_tokenizer(stories_weights), "", 256).text == known_answer
        finally:
            model.close()
    for bad in (0, True, 1.5):
        with pytest.raises(ConfigError, match="the master's compute threads must be a whole number"):
            MasterSettings(threads=bad)


def test_serve_s_pipeline_head_sends_every_logit(monkeypatch, stories_weights):
    """serve's requests bring their own temperature: a pipeline's head must send the whole logits (it sent the argmax,
    so every request served by a pipeline was greedy whatever it asked); generate's greedy run sends the argmax."""
    from contextlib import ExitStack

    from halo.cli import master as cli

    seen = []
    monkeypatch.setattr("halo.distributed.connect", lambda *a, **kwargs: seen.append(kwargs["pipeline"]["head_top_k"]))
    for argv in (["serve", "--mode", "pipeline", "--local-agents", "1"],
                 ["generate", "--mode", "pipeline", "--local-agents", "1", "--temperature", "0"],
                 ["generate", "--mode", "pipeline", "--local-agents", "1", "--temperature", "0.8", "--top-k", "5"]):
        with ExitStack() as stack:
            cli.open_model(cli.build_parser().parse_args(argv), stories_weights, stack)
    assert seen == [0, 1, 5]


def test_local_agents_take_the_master_s_busy_poll(monkeypatch, stories_weights):
    """--busy-poll's help says agents take the same option; the agents --local-agents starts never got it."""
    import importlib
    from contextlib import ExitStack

    from halo.distributed import connect as package

    seen = []

    class Started(Exception):
        pass

    def local_cluster(n, model_path, predictors=None, extra_args=()):
        seen.append(tuple(extra_args))
        raise Started

    monkeypatch.setattr(importlib.import_module("halo.distributed.connect"), "LocalCluster", local_cluster)
    for busy_poll in ("on", "auto"):
        with ExitStack() as stack, pytest.raises(Started):
            package(stories_weights, stack, local_agents=2, busy_poll=busy_poll)
    assert seen == [("--busy-poll", "on"), ()]


def test_the_cli_gives_the_master_its_threads(monkeypatch):
    """generate --threads reaches the cluster's master (connect), and plan --threads its kernel benchmark."""
    import importlib

    from halo.cli import master as cli

    seen = {}

    class Stop(Exception):
        pass

    def connect(*args, **kwargs):
        seen["connect"] = kwargs["threads"]
        raise Stop

    def measured_plan(weights, layout, settings, *args, **kwargs):
        seen["plan"] = settings.threads
        raise Stop

    monkeypatch.setattr("halo.distributed.connect", connect)
    monkeypatch.setattr(importlib.import_module("halo.distributed.connect"), "measured_plan", measured_plan)
    monkeypatch.setattr("halo.runtime.local.LocalCluster.__enter__", lambda self: self)
    monkeypatch.setattr("halo.runtime.local.LocalCluster.__exit__", lambda self, *exc: None)
    for argv in (["generate", "--local-agents", "1", "--threads", "3"],
                 ["plan", "--local-agents", "1", "--threads", "3"]):
        with pytest.raises(Stop):
            cli.main(argv)
    assert seen == {"connect": 3, "plan": 3}


@pytest.mark.parametrize("plan,sync", [("even-mlp", "exact"), ("even-mlp", "tcp"), ("even-mlp-only", "exact"),
                                       ("paired-mlp", "exact"), ("paired-mlp", "halo")])
def test_blocks_on_the_master_take_their_rounds_away_and_keep_the_known_answer(stories_weights, known_answer, plan,
                                                                                sync):
    """--plan even-mlp: every head on the master (an agent then holds no attention and builds its share from MLP
    and LM-head groups alone), a token syncs L + 1 times, not 2L + 1; even-mlp-only: the whole LM head there too
    (no agent holds vocabulary, L rounds, the logits the master's alone); paired-mlp: each layer's MLP on the master
    and one agent, the agents in turn. The tokens are the same (halo mode's too: no loss here, nothing dropped)."""
    from halo.scheduler.even import EVEN_PLANS
    from halo.sync import SyncSettings

    with LocalCluster(3) as cluster:
        model = distributed(stories_weights, cluster, plan=plan, sync=SyncSettings(mode=sync))
        try:
            agents = list(model.agents.values())
            assert all(not any(a.share.attention) and any(a.share.mlp) for a in agents)
            assert any(a.share.lm_head for a in agents) == (plan == "even-mlp")
            assert model.planning["on_master"] == list(EVEN_PLANS[plan])
            holders = [[i for i, a in enumerate(agents) if a.share.mlp[l]] for l in range(len(agents[0].share.mlp))]
            assert holders == ([[l % 3] for l in range(len(holders))] if plan == "paired-mlp" else [[0, 1, 2]] * len(holders))
            result = generate(model, load_tokenizer(stories_weights), "", 256)
            breakdown = model.sync_report()["breakdown"]
        finally:
            model.close()
    assert result.text == known_answer
    layers, synced = stories_weights.config.n_layers, model.plan.sync_rounds()
    assert synced == layers + (plan == "even-mlp")
    listened = breakdown["sync_rounds_per_token"] - synced  # halo: attention inputs to agents that predict from them
    assert breakdown["rounds_per_token"] == 2 * layers + 1 and 0 <= listened <= (layers - 1 if sync == "halo" else 0)


def test_a_paired_plan_stays_paired_for_the_agents_left_until_the_scheduler_plans_instead(stories_weights):
    """The re-planner of --plan paired-mlp pairs the survivors again (one agent a layer, in turn); once a rebalance
    adopts the scheduler's plan it is neither even nor paired (survive.py then re-plans stickily again)."""
    from halo.distributed.connect import Replanner
    from halo.scheduler.even import EVEN_PLANS
    from halo.sync import SyncSettings

    layout = GroupLayout.for_model(stories_weights.config)
    first = even_plan(stories_weights, layout, 4, context=CONTEXT, on_master=EVEN_PLANS["paired-mlp"], paired=True)
    planner = Replanner(stories_weights, layout, first, True, False, SyncSettings(), CONTEXT, EVEN_PLANS["paired-mlp"],
                        True)
    plan, endpoints = planner.survivors(["tcp://a:1", "tcp://b:2"])
    mlp = plan.counts["mlp"]
    assert endpoints == ["tcp://a:1", "tcp://b:2"] and plan.n == 3 and plan.lm_head_on_master
    assert (mlp[0] > 0).all() and [int(np.flatnonzero(mlp[1:, l])[0]) for l in range(mlp.shape[1])] == \
        [l % 2 for l in range(mlp.shape[1])]
    with pytest.raises(ConfigError, match="relative compute figures do not apply"):
        even_plan(stories_weights, layout, 3, [1.0, 2.0, 1.0], CONTEXT, paired=True)
    planner.adopt(even_plan(stories_weights, layout, 3, context=CONTEXT))
    assert not planner.even and not planner.paired


def test_uneven_plan_really_is_uneven(stories_weights):
    layout = GroupLayout.for_model(stories_weights.config)
    shares = shares_from_plan(even_plan(stories_weights, layout, 3, [4.0, 1.0, 2.0], CONTEXT), 5)
    heads = [sum(len(h) for h in s.attention) for s in shares]
    assert heads[0] > heads[2] > heads[1]


def test_random_hf_gqa_model_matches_the_reference(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import make_checkpoint

    make_checkpoint(tmp_path, seed=4, num_attention_heads=8, num_key_value_heads=2, intermediate_size=200)
    weights = load_weights(tmp_path)
    tokenizer = load_tokenizer(weights)
    expected = generate(Transformer(weights, max_seq_len=128), tokenizer, "Once upon a time", 24).token_ids
    for n in (1, 3):
        with LocalCluster(n, model_path=str(tmp_path)) as cluster:
            model = cluster_model(weights, cluster.endpoints, cluster.key, context=128)
            try:
                assert generate(model, tokenizer, "Once upon a time", 24).token_ids == expected
            finally:
                model.close()


def test_a_killed_agent_stops_the_master_quickly_and_the_others_stay_healthy(stories_weights, known_answer):
    tokenizer = load_tokenizer(stories_weights)
    with LocalCluster(2) as cluster:
        model = distributed(stories_weights, cluster, timeout_s=1.0)
        killed = []

        def kill_after_ten(piece):
            if len(killed) == 0 and model.step >= 10:
                cluster.processes[1].kill()
                cluster.processes[1].wait()
                killed.append(time.perf_counter())

        # a dead process is seen at once (its connection closed); a silent one after --timeout
        with pytest.raises(AgentError, match=r"local-2.*(did not (answer|deliver its partial of)|sent nothing for) .*"
                                             r"\(step \d+\).*(within 1\.0 s|connection closed)"):
            generate(model, tokenizer, "", 256, on_text=kill_after_ten)
        assert time.perf_counter() - killed[0] < 2.0
        model.close()
        # the surviving agent takes a new session, alone with the master
        fresh = cluster_model(stories_weights, cluster.endpoints[:1], cluster.key, context=CONTEXT)
        try:
            assert generate(fresh, tokenizer, "", 256).text == known_answer
        finally:
            fresh.close()


def raw_client(cluster, key=None):
    from halo.transport.reliable import client_socket

    context = zmq.Context()
    sock = client_socket(context, key or cluster.key)
    sock.connect(cluster.endpoints[0])
    return context, sock


def ask(sock, frames, timeout_ms=3000):
    sock.send_multipart(frames)
    assert sock.poll(timeout_ms), "the agent did not answer"
    return decode(sock.recv_multipart())


def hello_fields(weights, **overrides):
    from halo.model.loader import model_fingerprint
    from halo.transport.control import Hello

    fields = Hello(model_fingerprint(weights.source), 64, 22, 256, "test", "fp32", {"mode": "tcp"}, 0, ((0,),) * 5,
                   ((0,),) * 5, (0,)).to_fields()
    fields.update(overrides)
    return fields


def test_a_master_newer_than_its_agent_is_told_to_install_the_same_version(stories_weights):
    """A newer master's hello carries sync settings an older agent does not know (copies and loss_deviations came so):
    the agent refuses it with "unknown sync settings", and the master's error names the fix, not only the fields."""
    from halo.distributed.remote import RemoteAgent

    with LocalCluster(1) as cluster:
        context, sock = raw_client(cluster)
        try:
            later = hello_fields(stories_weights, sync={"mode": "tcp", "a_later_setting": 1})
            refusal = ask(sock, encode(Message("hello", later)))
            assert refusal.kind == "refused" and "unknown sync settings" in refusal.fields["reason"]
            router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)  # the master reads that refusal
            router.bind("inproc://older-agent")
            dealer.connect("inproc://older-agent")
            agent = RemoteAgent(1, "inproc://older-agent", Shares([], [], []), dealer, 2.0)
            dealer.send(b"hello")
            peer, _ = router.recv_multipart()
            router.send_multipart([peer, *encode(refusal)])
            with pytest.raises(AgentError, match=r"unknown sync settings.*a_later_setting.*older halo.*same halo vers"):
                agent.receive("hello")
        finally:
            context.destroy(linger=0)


def test_bad_input_is_refused_with_a_reason_and_the_agent_survives(stories_weights, tmp_path):
    with LocalCluster(1) as cluster:
        context, sock = raw_client(cluster)
        try:
            older = encode(Message("hello", hello_fields(stories_weights)))
            reply = ask(sock, [b"HALO\x01", *older[1:]])  # a master of control protocol 1
            assert reply.kind == "error" and "protocol version 1 but this halo speaks 2" in reply.fields["reason"]
            for bad, field in (({"context": "64"}, "context"), ({"attention": [[0], ["x"]]}, "attention[1]"),
                               ({"node_id": 300}, "node_id"), ({"model_sha256": "xyz"}, "model_sha256")):
                reply = ask(sock, encode(Message("hello", hello_fields(stories_weights, **bad))))
                assert reply.kind == "refused" and f"bad hello: {field}" in reply.fields["reason"], reply.fields
            for bad in ({"mlp": [[0]] * 4 + [[99]]}, {"attention": [[0, 0]] * 5}, {"lm_head": [10**6]}):
                reply = ask(sock, encode(Message("hello", hello_fields(stories_weights, **bad))))
                assert reply.kind == "refused" and "are not distinct groups of this model's" in reply.fields["reason"]
            reply = ask(sock, encode(Message("hello", hello_fields(stories_weights, model_sha256="0" * 64))))
            assert reply.kind == "refused" and "model mismatch" in reply.fields["reason"]
            reply = ask(sock, [b"garbage", b"\xff" * 10])
            assert reply.kind == "error" and "malformed" in reply.fields["reason"]
            reply = ask(sock, [b"HALO\x02", b"x" * (2 << 20)])
            assert reply.kind == "error" and "exceeds" in reply.fields["reason"]
            reply = ask(sock, encode(Message("block", {"kind": "mlp", "layer": 0}, [np.zeros((1, 64), np.float32)])))
            assert reply.kind == "error" and "before hello" in reply.fields["reason"]
            reply = ask(sock, encode(Message("hello", hello_fields(stories_weights))))
            assert reply.kind == "ready"
            reply = ask(sock, encode(Message("block", {"kind": "mlp", "layer": 0}, [np.zeros((1, 63), np.float32)])))
            assert reply.kind == "error" and "shape" in reply.fields["reason"]
            reply = ask(sock, encode(Message("block", {"kind": "mlp", "layer": 0}, [np.ones((1, 64), np.float32)])))
            assert reply.kind == "partial" and reply.arrays[0].shape == (1, 64)
            reply = ask(sock, encode(Message("block", {"kind": "mlp", "layer": 0, "start_pos": 0, "epoch": -1},
                                             [np.ones((1, 64), np.float32)])))  # logged as a bug, with a traceback
            assert reply.kind == "error" and "malformed message" in reply.fields["reason"], reply.fields
        finally:
            context.destroy(linger=0)
        assert cluster.processes[0].poll() is None  # still running
        assert "unexpected error" not in "\n".join(cluster.processes[0].stderr_tail)


def test_a_wrong_key_and_a_security_mismatch_are_named_at_once_not_taken_for_a_dead_device(stories_weights, tmp_path):
    """Within the timeout (here seconds before it), with the cause, both ways round; the agent logs the refusal."""
    other = generate_key(tmp_path / "other.key")
    with LocalCluster(1) as cluster:
        cases = [(other, False, "refused the security handshake: it holds another cluster key"),
                 (None, True, "disagree on security: this master runs plaintext")]
        for key, insecure, message in cases:
            start = time.monotonic()
            with pytest.raises(AgentError, match=message):
                cluster_model(stories_weights, cluster.endpoints, key, insecure=insecure, context=CONTEXT,
                              hello_timeout_s=5.0, timeout_s=5.0)
            assert time.monotonic() - start < 2.0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "\n".join(cluster.processes[0].stderr_tail).count("refused a connection") < 2:
            time.sleep(0.05)
        said = "\n".join(cluster.processes[0].stderr_tail)
        # the address is read from the connection while it is still open: usually, not always, in time
        assert said.count("refused a connection from ") >= 2 and "another cluster key" in said
    import subprocess as sp

    agent = sp.Popen([sys.executable, "-P", "-m", "halo.edge_agent", "--listen", "tcp://127.0.0.1:0", "--insecure",
                      "--log-level", "WARNING"], stdout=sp.PIPE, stderr=sp.PIPE, text=True)
    try:
        endpoint = agent.stdout.readline().split()[1]
        start = time.monotonic()
        with pytest.raises(AgentError, match="disagree on security: the agent runs plaintext|runs plaintext"):
            cluster_model(stories_weights, [endpoint], other, context=CONTEXT, hello_timeout_s=5.0)
        assert time.monotonic() - start < 2.0
    finally:
        agent.kill()
        agent.wait()


def test_nothing_listening_is_said_as_such(stories_weights):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(AgentError, match="nothing accepted a connection there"):
        cluster_model(stories_weights, [f"tcp://127.0.0.1:{port}"], None, insecure=True, context=CONTEXT,
                      hello_timeout_s=1.0)


def test_an_agent_that_says_nothing_is_named(stories_weights):
    context = zmq.Context()
    silent = context.socket(zmq.DEALER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(AgentError, match=rf"127.0.0.1:{port}.*did not answer hello within 0.5 s"):
            cluster_model(stories_weights, [f"tcp://127.0.0.1:{port}"], None, insecure=True, context=CONTEXT,
                          hello_timeout_s=0.5)
    finally:
        context.destroy(linger=0)


def processes_marked(mark: str) -> list[int]:
    """Running processes whose environment holds HALO_TEST_MARK=mark (children inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"HALO_TEST_MARK={mark}".encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_cli_local_cluster_runs_and_leaves_no_processes(known_answer):
    import json
    import os
    import uuid

    mark = uuid.uuid4().hex
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--prompt", "", "--local-agents", "2", "--json"],
                         capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "HALO_TEST_MARK": mark})
    assert json.loads(out.stdout)["text"] == known_answer
    assert processes_marked(mark) == []


def test_the_master_chooses_the_weight_format_for_the_whole_cluster(stories_weights):
    with LocalCluster(2) as cluster:
        sizes = {}
        for fmt in ("fp32", "int8"):
            model = distributed(stories_weights, cluster, fmt=fmt)
            try:
                text = generate(model, load_tokenizer(stories_weights), "Once upon a time", 8).text
                sizes[fmt] = [r["weight_bytes"] for r in model.report()]
            finally:
                model.close()
            assert text.startswith(", there was")
    assert all(i < 0.5 * f for i, f in zip(sizes["int8"], sizes["fp32"]))


def test_the_hello_timeout_grows_with_the_share_an_agent_must_load():
    """A 1/5 share of the TinyLlama shape is ~0.9 GB of float32 to read and quantize: far more than the 10 s
    floor allows on a busy core; a share of stories260K stays at the floor."""
    from halo.compute.shares import everything, share_float32_bytes
    from halo.distributed.session import LOAD_BYTES_PER_S, hello_timeout_s
    from halo.model.config import ModelConfig

    tiny = ModelConfig(dim=2048, hidden_dim=5632, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000,
                       max_seq_len=2048)
    layout = GroupLayout.for_model(tiny)
    whole = share_float32_bytes(everything(tiny, layout), layout, tiny.dim)
    assert 4.0e9 < whole < 4.6e9  # TinyLlama-1.1B's 1.1e9 parameters, less the embedding table (the master's)
    fifth = Shares([a[: len(a) // 5] for a in everything(tiny, layout).attention],
                   [m[: len(m) // 5] for m in everything(tiny, layout).mlp], [])
    assert hello_timeout_s(fifth, layout, tiny.dim, 10.0) == pytest.approx(
        share_float32_bytes(fifth, layout, tiny.dim) / LOAD_BYTES_PER_S) and hello_timeout_s(fifth, layout, tiny.dim, 10.0) > 30
    stories = ModelConfig(dim=64, hidden_dim=172, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, max_seq_len=512)
    stories_layout = GroupLayout.for_model(stories)
    assert hello_timeout_s(everything(stories, stories_layout), stories_layout, stories.dim, 10.0) == 10.0


def test_a_negative_position_is_refused_on_every_path(stories_weights):
    """numpy would wrap it: a cache slice of [-2:-1] writes the context's last positions. The single process, the
    master and a device's worker (what every agent computes through, UDP or TCP) each refuse it."""
    from halo.compute.shares import Block
    from halo.errors import HaloError

    model = Transformer(stories_weights, max_seq_len=CONTEXT)
    model.forward([1, 403, 407])
    with pytest.raises(ValueError, match="negative"):
        model.forward([1], start_pos=-2)
    x = np.zeros((1, stories_weights.config.dim), np.float32)
    for start in (-2, CONTEXT):
        with pytest.raises(HaloError, match="outside the context"):
            model.worker.compute(Block("attention", 0), x, start)
    with LocalCluster(1) as cluster:
        master = cluster_model(stories_weights, cluster.endpoints, cluster.key, context=CONTEXT)
        try:
            with pytest.raises(ValueError, match="negative"):
                master.forward([1], start_pos=-1)
        finally:
            master.close()


def test_a_local_agent_that_dies_is_reaped_at_once():
    """A killed local agent (during a re-plan, say) stayed a zombie until the master exited."""
    import os
    import signal

    with LocalCluster(1) as cluster:
        pid = cluster.processes[0].pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}"), "the dead agent is still a zombie"
        assert cluster.processes[0].returncode == -signal.SIGKILL


def test_a_long_prompt_goes_in_passes_whose_vectors_stay_small_and_keep_the_single_process_bits(tmp_path):
    """A prompt's passes take prefill_chunk(dim) tokens each (a [T, dim] float32 vector within 512 KB: 64 tokens at
    width 2048), on the cluster and in the single process alike, so no round carries a whole long prompt's partial
    sums (the Llama-3.1-8B shape's 512-token prompt overflowed the master's receive buffer with 8.4 MB partials from
    every agent at once) and exact sync's next token is the single process's."""
    from gguf_models import tiny_gguf

    from halo.generation.generate import prefill, prefill_chunk
    from halo.sync import SyncSettings

    path = tiny_gguf(tmp_path / "wide.gguf", "Q4_0", seed=3, hidden_size=2048, num_attention_heads=16,
                     num_key_value_heads=4)
    weights = load_weights(path)
    assert prefill_chunk(weights.config.dim) == 64
    prompt = [1, *np.random.default_rng(1).integers(3, weights.config.vocab_size, 149).tolist()]
    single = Transformer(weights, fmt="native", max_seq_len=256)
    passes = []
    forward = single.forward
    single.forward = lambda tokens, *a, **k: passes.append(len(tokens)) or forward(tokens, *a, **k)
    expected = prefill(single, prompt)
    assert passes == [64, 64, 22]
    with LocalCluster(2, model_path=str(path)) as cluster:
        model = cluster_model(weights, cluster.endpoints, cluster.key, context=256, fmt="native",
                              sync=SyncSettings(mode="exact"))
        sizes = []
        forward = model.forward
        model.forward = lambda tokens, *a, **k: sizes.append(len(tokens)) or forward(tokens, *a, **k)
        try:
            got = prefill(model, prompt)
        finally:
            model.close()
    assert sizes == [64, 64, 22] and int(np.argmax(got)) == int(np.argmax(expected))
    np.testing.assert_allclose(got, expected, atol=5e-3)  # (partial sums merged in another order: rounding)


def test_a_control_reply_held_back_by_tcp_is_waited_for_while_the_agent_echoes_probes(monkeypatch):
    """TCP's retransmissions can hold a reset's reply back past timeout_s on a lossy radio link: the master waits on
    while the agent still answers UDP link probes, and names it stopped at once when it does not."""
    from types import SimpleNamespace

    from halo.distributed.remote import AgentSilent
    from halo.distributed.session import Session

    def agent_answering_after(failures: int):
        calls = []

        def receive(what):
            calls.append(what)
            if len(calls) <= failures:
                raise AgentSilent(f"agent did not answer {what} within 0.1 s")
            return "ready"

        return SimpleNamespace(receive=receive, gone=lambda: False, calls=calls, timeout_s=0.1)

    session = Session.__new__(Session)
    monkeypatch.setattr(Session, "_echoes_probes", lambda self, agent: True)
    late = agent_answering_after(2)
    assert session.receive_control(late, "reset") == "ready" and late.calls == ["reset"] * 3
    monkeypatch.setattr(Session, "_echoes_probes", lambda self, agent: False)
    stopped = agent_answering_after(2)
    with pytest.raises(AgentError, match="did not answer reset"):
        session.receive_control(stopped, "reset")
    assert stopped.calls == ["reset"]
    gone = SimpleNamespace(receive=agent_answering_after(1).receive, gone=lambda: True, timeout_s=0.1)
    monkeypatch.setattr(Session, "_echoes_probes", lambda self, agent: True)
    with pytest.raises(AgentError):  # its connection closed: no probe can make it answer
        session.receive_control(gone, "reset")

    def refusing(what):
        calls.append(what)
        raise AgentError(f"agent refused {what}: its model changed")

    calls = []
    with pytest.raises(AgentError, match="refused reset"):  # an answer, not silence: final at once
        session.receive_control(SimpleNamespace(receive=refusing, gone=lambda: False, timeout_s=0.1), "reset")
    assert calls == ["reset"]
