"""An agent loads its share in a thread and reports how far it got: a slow load is not taken for a dead agent,
a stalled one is, and `halo-master status` shows the loading."""

import signal
import threading
import time

import numpy as np
import pytest

from halo.compute.transformer import Transformer
from halo.distributed import AgentError, cluster_model
from halo.distributed.remote import ask_status

CONTEXT = 64
PROMPT = [1, 403, 407, 261, 378, 282]


@pytest.fixture
def slow_agent(monkeypatch):
    """An in-process agent whose share builds `step_s` seconds per block (a device reading from slow storage);
    `stall_after` blocks built, the next one takes `stall_s`."""
    from halo.edge_agent import agent as agent_module

    monkeypatch.setattr(agent_module, "LOADING_REPORT_S", 0.1)
    pace = {"step_s": 0.0, "stall_after": None, "stall_s": 0.0}
    real_worker = agent_module.DeviceWorker

    def paced_worker(*args, progress=None, **kwargs):
        def slowed(done, total):
            if done and done == pace["stall_after"]:
                time.sleep(pace["stall_s"])
            elif done:
                time.sleep(pace["step_s"])
            progress(done, total)

        return real_worker(*args, progress=slowed, **kwargs)

    monkeypatch.setattr(agent_module, "DeviceWorker", paced_worker)
    sigterm = signal.getsignal(signal.SIGTERM)
    agent = agent_module.Agent(None, "tcp://127.0.0.1:0", None, insecure=True, name="slow")
    signal.signal(signal.SIGTERM, sigterm)  # the daemon takes SIGTERM for its drain: give it back to pytest
    server = threading.Thread(target=agent.serve, daemon=True)
    server.start()
    yield agent, pace
    agent.stop()
    server.join(5)


def test_a_slow_loading_agent_is_waited_for_while_it_reports_progress(slow_agent, stories_weights):
    agent, pace = slow_agent
    pace["step_s"] = 0.15  # 11 blocks (an even half of stories260K): ~1.7 s, past the 0.5 s hello timeout
    seen = []

    def watch():  # what `halo-master status` asks, while the master waits for the hello
        for _ in range(40):
            loading = ask_status([agent.endpoint], None, insecure=True)[agent.endpoint].get("loading")
            if loading:
                seen.append(loading)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t = time.perf_counter()
    model = cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT, hello_timeout_s=0.5)
    waited = time.perf_counter() - t
    watcher.join()
    try:
        assert waited > 1.0  # it did take longer than the hello timeout, and the master kept waiting
        reference = Transformer(stories_weights, max_seq_len=CONTEXT)
        assert np.argmax(model.forward(PROMPT)) == np.argmax(reference.forward(PROMPT))
    finally:
        model.close()
    assert {s["blocks"] for s in seen} <= {0, 11}  # 0: polled before the share's blocks were counted (still reading)
    counted = [s for s in seen if s["blocks"]]
    assert counted and counted[0]["master"] and 0 <= counted[0]["percent"] < 100
    assert [s["blocks_done"] for s in seen] == sorted(s["blocks_done"] for s in seen)  # it only goes forward
    assert ask_status([agent.endpoint], None, insecure=True)[agent.endpoint]["loading"] is None


def test_a_stalled_load_is_given_up_with_how_far_it_got(slow_agent, stories_weights):
    agent, pace = slow_agent
    pace["stall_after"], pace["stall_s"] = 3, 2.5  # alive (it reports) but builds nothing more for 2.5 s
    with pytest.raises(AgentError, match=r"built nothing of its share for 0.5 s \(at \d+(\.\d+)? % after"):
        cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT, hello_timeout_s=0.5)
    # the master said bye while it loaded: the agent drops what it built and takes the next hello
    pace["stall_after"] = None
    deadline = time.monotonic() + 10
    while agent.loading is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.loading is None and agent.session is None
    model = cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT)
    model.close()


def test_a_hello_after_an_abandoned_load_is_taken_at_once(slow_agent, stories_weights):
    """A build its master gave up on went on to the end of the share, and every hello meanwhile was refused as
    busy (a re-planning master that had said bye to a healthy agent then planned without it). The build stops at
    its next block; the hello waits for that."""
    agent, pace = slow_agent
    pace["step_s"], pace["stall_after"], pace["stall_s"] = 0.4, 2, 1.0
    with pytest.raises(AgentError, match="built nothing of its share"):
        cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT, hello_timeout_s=0.5)
    pace["step_s"] = 0.0
    model = cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT)
    model.close()


def test_a_hello_while_loading_is_refused_as_busy(slow_agent, stories_weights):
    agent, pace = slow_agent
    pace["step_s"] = 0.3
    first = threading.Thread(target=lambda: cluster_model(stories_weights, [agent.endpoint], insecure=True,
                                                          context=CONTEXT).close())
    first.start()
    deadline = time.monotonic() + 5
    while agent.loading is None and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(AgentError, match="busy: loading a share for master"):
        cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT)
    first.join(20)


def test_an_agent_on_throttled_storage_is_waited_for_while_it_loads(tmp_path):
    """A device reading its model from SD-card-slow storage: its own GGUF copy (read lazily, block by block), evicted
    from the page cache, read through a cgroup-v1 blkio throttle of 8 MB/s. Its half of a 3-layer, 40 MB Q8_0 model
    takes seconds to build, past the hello timeout; it reports progress, so the master waits, and its logits are the
    single process's."""
    import os
    import shutil
    import subprocess

    from gguf_models import tiny_gguf
    from halo.distributed import AgentProcess, agent_command, stop_processes
    from halo.model.loader import load_weights, model_fingerprint
    from halo.rpi.limits import DeviceLimits, available, drop_cached
    from halo.transport.reliable import generate_key, load_key

    ok, why = available(storage=True)
    if not ok:
        pytest.skip(f"throttled storage needs cgroup-v1 blkio: {why}")
    original = tiny_gguf(tmp_path / "model.gguf", "Q8_0", hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8)
    model = tmp_path / "sd-card" / "model.gguf"  # the device's own copy: the master's reads do not cache its pages
    model.parent.mkdir()
    shutil.copyfile(original, model)
    weights = load_weights(original)
    model_fingerprint(model)  # cached on disk: the agent does not hash the file through the throttle at start
    key = tmp_path / "cluster.key"
    generate_key(key)
    with DeviceLimits(f"test-{os.getpid()}", None, 8e6, model) as limits:

        def popen(argv, preexec_fn=None, **kwargs):
            def both():
                preexec_fn()
                limits.join()
            return subprocess.Popen(argv, preexec_fn=both, **kwargs)

        agent = AgentProcess("sd-card", agent_command("tcp://127.0.0.1:0", key, "sd-card", 1, model), popen=popen)
        try:
            endpoint = agent.wait_listening(120.0)
            drop_cached(model)
            start = time.monotonic()
            distributed = cluster_model(weights, [endpoint], load_key(key), context=CONTEXT, hello_timeout_s=2.0,
                                        plan="even", fmt="native")
            loaded_s = time.monotonic() - start
            got = distributed.forward([1, 17, 42, 99, 250])
            read = ask_status([endpoint], load_key(key))[endpoint]["memory"]["storage_read_bytes"]
            distributed.close()
        finally:
            stop_processes([agent])
    expected = Transformer(weights, fmt="native", max_seq_len=CONTEXT).forward([1, 17, 42, 99, 250])
    assert loaded_s > 2.0 and read > 10e6, (loaded_s, read)  # slower than the hello timeout, from the disk
    assert np.argmax(got) == np.argmax(expected) and np.allclose(got, expected, atol=5e-3)  # partials summed in two


def test_a_hello_with_bad_sync_settings_is_refused_and_the_agent_lives_on(slow_agent, stories_weights, monkeypatch):
    """A hello whose sync seed made the loss injector raise (seed -5000, inject_plr 0.1) ended the agent's process:
    the settings were checked for their names only, and the failure came between messages, outside every guard."""
    from dataclasses import asdict

    from halo.errors import HaloError
    from halo.sync import SyncSettings

    agent, _ = slow_agent
    for bad in ({"seed": -5000, "inject_plr": 0.1}, {"seed": "x", "inject_plr": 0.1}, {"predict": 1}):
        monkeypatch.setattr(SyncSettings, "to_json", lambda self, bad=bad: {**asdict(self), **bad})  # the master's side
        with pytest.raises(HaloError, match=f"sync setting {next(iter(bad))}|--seed must be an integer"):
            cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT, hello_timeout_s=2.0)
        monkeypatch.undo()
        assert agent.running and agent.session is None
    model = cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT)  # still serving
    model.close()


def test_a_failure_between_messages_ends_the_session_not_the_agent(slow_agent, stories_weights, monkeypatch):
    agent, _ = slow_agent

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in joining the UDP session")

    monkeypatch.setattr(agent, "_join_udp", broken)
    with pytest.raises(AgentError):
        cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT, hello_timeout_s=1.0)
    assert agent.session is None and agent.served["errors"] >= 1
    monkeypatch.undo()
    model = cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT)  # still serving
    model.close()


def test_an_agent_set_to_one_weight_format_refuses_another_with_the_fix(slow_agent, stories_weights):
    """halo-agent --weights int8 (or weights in agent.toml) did nothing: the master's format was used, so a device set
    to int8 for its memory held float32 without a word. It now serves that format only and says how to match it."""
    agent, _ = slow_agent
    agent.only_format = "int8"
    with pytest.raises(AgentError, match="serves int8 weights only .* start the master with --weights int8"):
        cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT)  # the master's native: fp32
    model = cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT, fmt="int8")
    model.close()


def test_a_halo_agent_in_float32_is_held_to_its_budget(slow_agent, stories_weights):
    """HALO mode holds every MLP group of its layers, but the budget check counted the share's: with fp32 weights an
    agent of a 0.3 MB budget took 0.7 MB."""
    from halo.sync import SyncSettings

    agent, _ = slow_agent
    agent.memory_budget = 300_000
    with pytest.raises(AgentError, match=r"HALO mode in float32 holds them all.*memory budget is 0.3 MB"):
        cluster_model(stories_weights, [agent.endpoint], insecure=True, context=CONTEXT, plan="even-mlp-only",
                      sync=SyncSettings(mode="halo-tcp", predict=False))
