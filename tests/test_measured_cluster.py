"""Measured plans over local agents: the profile request, the plan `generate` uses by default, running
estimates in --json and status, and `halo-master plan --local-agents` saying why."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import zmq

from halo.distributed import LocalCluster, cluster_model
from halo.generation.generate import generate
from halo.model.loader import load_tokenizer, model_fingerprint
from halo.sync import SyncSettings
from halo.transport import wire
from halo.transport.control import ProfileRequest, UdpSession
from halo.transport.reliable import Message, client_socket, decode, encode

CONTEXT = 256


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HALO_DEVICE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))  # agents inherit it: fresh benchmarks
        with LocalCluster(2) as local:
            yield local


def test_a_measured_plan_keeps_the_known_answer_and_says_what_it_measured(stories_weights, known_answer, cluster):
    model = cluster_model(stories_weights, cluster.endpoints, cluster.key, plan="measured", select=False,
                          context=CONTEXT, sync=SyncSettings(mode="exact"))
    try:
        text = generate(model, load_tokenizer(stories_weights), "", 60).text
        planning, estimates = model.planning, model.estimates.to_json()
    finally:
        model.close()
    assert known_answer.startswith(text)
    assert planning["source"] == "measured" and planning["mode"] == "exact"
    devices = {d["name"].split("#")[0]: d for d in planning["devices"]}
    assert set(devices) == {"master", "local-1", "local-2"} and all(d["participant"] for d in devices.values())
    for name in ("local-1", "local-2"):
        assert devices[name]["plr"] == 0.0 and 0 < devices[name]["latency_ms"] < 50 and devices[name]["gflops"] > 0
        assert devices[name]["address"] in cluster.endpoints
    assert estimates["ms_per_token"] > 0
    rows = {r["node_id"]: r for r in estimates["devices"]}
    assert set(rows) == {0, 1, 2} and all(r["tokens"] > 0 for r in rows.values())
    held = [r for r in rows.values() if r["groups"]]
    assert held and all(r["compute_ms_per_token"] > 0 for r in held)


def test_local_agents_take_the_masters_kernel_benchmark_and_all_get_work(stories_weights, known_answer, cluster):
    """--local-agents N: the agents run on the master's hardware; one benchmark per agent on a busy machine only
    adds noise (a skewed one once gave an agent nothing in several tests of one CI run)."""
    model = cluster_model(stories_weights, cluster.endpoints, cluster.key, plan="measured", select=False,
                          same_machine=True, context=CONTEXT, sync=SyncSettings(mode="exact"))
    try:
        text = generate(model, load_tokenizer(stories_weights), "", 20).text
        devices = {d["name"].split("#")[0]: d for d in model.planning["devices"]}
        shares = [a.share for a in model.agents.values()]
    finally:
        model.close()
    assert known_answer.startswith(text)
    assert devices["local-1"]["gflops"] == devices["local-2"]["gflops"] == devices["master"]["gflops"]
    assert all(sum(map(len, s.attention + s.mlp)) > 0 for s in shares)


def test_the_scheduler_may_leave_agents_out_and_they_are_not_used(stories_weights, known_answer, cluster):
    model = cluster_model(stories_weights, cluster.endpoints, cluster.key, plan="measured", context=CONTEXT)
    try:
        text = generate(model, load_tokenizer(stories_weights), "", 30).text
        used = [d["address"] for d in model.planning["devices"][1:] if d["participant"]]
        assert sorted(a.endpoint for a in model.agents.values()) == sorted(used)
    finally:
        model.close()
    assert known_answer.startswith(text)


def ask(endpoint, key, kind, fields):
    context = zmq.Context()
    try:
        sock = client_socket(context, key)
        sock.connect(endpoint)
        sock.send_multipart(encode(Message(kind, fields)))
        assert sock.poll(20000), f"no answer to {kind}"
        return decode(sock.recv_multipart())
    finally:
        context.destroy(linger=0)


def test_profile_requests_are_validated_and_a_busy_agent_is_not_taken_over(stories_weights, cluster):
    request = ProfileRequest(model_fingerprint(stories_weights.source), "fp32", 22, 256, "test", False, False, 1,
                             UdpSession(7, "ab" * wire.NONCE_BYTES, 9)).to_fields()
    reply = ask(cluster.endpoints[0], cluster.key, "profile", request)
    assert reply.kind == "profile" and reply.fields["measured"]["compute_flops"] > 0
    assert isinstance(reply.fields["udp_port"], int)
    for bad, reason in (({"model_sha256": "0" * 64}, "model mismatch"),
                        ({"weights": "fp8"}, "unknown weight format"), ({"mlp_group_size": "x"}, "bad profile request"),
                        ({"udp_session": -1}, "udp_session must be an integer within 1..4294967295"),
                        ({"node_id": 255}, "node_id must be an integer within 1..254"),
                        ({"udp_wire": 2}, f"UDP wire version 2 but this agent speaks {wire.VERSION}"),
                        ({"udp_nonce": "ab"}, "udp_nonce"), ({"udp_nonce": None}, "udp_nonce"),
                        ({"take_over": 1}, "take_over must be true or false")):
        reply = ask(cluster.endpoints[0], cluster.key, "profile", {**request, **bad})
        assert reply.kind == "refused" and reason in reply.fields["reason"]
    model = cluster_model(stories_weights, cluster.endpoints[:1], cluster.key, context=CONTEXT)
    try:
        busy = ask(cluster.endpoints[0], cluster.key, "profile", request)
        assert busy.kind == "refused" and "busy" in busy.fields["reason"]
        assert "s ago; a session silent for 60 s ends, this one in" in busy.fields["reason"]  # (it said neither)
        model.forward([1, 2])
        model.forward([3])
        status = ask(cluster.endpoints[0], cluster.key, "status", {})
        assert 0 <= status.fields["session"]["idle_s"] < 30
        estimates = status.fields["session"]["estimates"]
        assert estimates["attention"]["blocks"] > 0 and estimates["attention"]["ms_per_block"] > 0
    finally:
        model.close()


def test_plan_command_measures_local_agents_and_writes_a_usable_plan(tmp_path):
    from halo.scheduler import plan_io

    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "plan", "--local-agents", "1", "--sync", "tcp", "--all-devices",
                          "--out", str(tmp_path / "plan.json")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "measured tensor-parallel plan" in out.stdout and "local-1#1" in out.stdout
    assert "estimate, tcp sync" in out.stdout
    plan = plan_io.load(tmp_path / "plan.json")
    assert [d.name for d in plan.profiles()] == ["master", "local-1#1"]
    assert plan.profiles()[1].address.startswith("tcp://127.0.0.1:")
    assert np.isclose(sum(plan.counts["lm_head"]), plan.model.lm_head.count)


def test_plan_measured_named_keeps_every_local_agent_as_the_default_does():
    """--help calls 'measured' the default, with which --local-agents N keeps every agent: named, it left both
    agents out ("left out: local-1#1, local-2#2") on the tiny model, where the master alone is faster."""
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--local-agents", "2", "--plan", "measured",
                          "--max-new-tokens", "2", "--json"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["planning"]["source"] == "measured"
    assert [a["name"] for a in result["agents"]] == ["local-1#1", "local-2#2"], result["agents"]
    assert "left out" not in out.stderr


def test_an_agent_of_one_format_refuses_a_profile_in_another_before_benchmarking(stories_weights, tmp_path,
                                                                                  monkeypatch):
    """halo-agent --weights int8 benchmarked the master's other format, was planned for, and only refused at the
    hello; a model mismatch named no fix."""
    monkeypatch.setenv("HALO_DEVICE_CACHE_DIR", str(tmp_path))  # (the agent inherits it: its benchmarks land here)
    request = ProfileRequest(model_fingerprint(stories_weights.source), "fp32", 22, 256, "test", False, False, 1,
                             UdpSession(7, "ab" * wire.NONCE_BYTES, 9)).to_fields()
    with LocalCluster(1, extra_args=["--weights", "int8"]) as cluster:
        reply = ask(cluster.endpoints[0], cluster.key, "profile", request)
        assert reply.kind == "refused" and "this agent serves int8 weights only" in reply.fields["reason"]
        assert not list(tmp_path.iterdir())  # nothing benchmarked
        reply = ask(cluster.endpoints[0], cluster.key, "profile", {**request, "model_sha256": "0" * 64})
        assert reply.kind == "refused" and "start this agent with the master's model" in reply.fields["reason"]


def test_a_master_whose_agent_another_master_took_is_told_so(stories_weights):
    """Two masters on one agent: the first was told "not in session" or "before hello", took the agent for dead,
    and took it back; it is now told who took it over and that its session is over."""
    from halo.distributed import AgentError

    with LocalCluster(1) as cluster:
        first = cluster_model(stories_weights, cluster.endpoints, cluster.key, context=CONTEXT, sync=SyncSettings(mode="tcp"))
        try:
            first.forward([1, 2])
            second = cluster_model(stories_weights, cluster.endpoints, cluster.key, context=CONTEXT,
                                   sync=SyncSettings(mode="tcp"))  # its hello takes the agent over
            try:
                with pytest.raises(AgentError, match=r"took this agent over \d+ s ago: this session is over"):
                    first.forward([3])
                second.forward([1, 2])
            finally:
                second.close()
        finally:
            first.close()
