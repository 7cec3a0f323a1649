"""A key pair per device and allow-lists: whoever takes one device cannot act as master to the others, and a revoked
device is never used again (deleting its line is all it takes)."""

import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from halo.compute.transformer import Transformer
from halo.distributed import cluster_model
from halo.distributed.remote import ask_status
from halo.errors import ConfigError
from halo.transport.reliable import generate_key, load_authorized, load_key

CONTEXT = 64
PROMPT = [1, 403, 407, 261, 378, 282]


@pytest.fixture
def keys(tmp_path):
    return {name: generate_key(tmp_path / f"{name}.key", device=name) for name in ("master", "pi-1", "pi-2")}


def authorized(path, *lines) -> object:
    path.write_text("# revoking a device = deleting its line\n" + "\n".join(lines) + "\n")
    return load_authorized(path)


@pytest.fixture
def agent(keys, tmp_path):
    """pi-1 serving in-process with its own key, admitting only the master's."""
    from halo.edge_agent import agent as agent_module

    masters = authorized(tmp_path / "masters", f"{keys['master'].public.decode()} master")
    sigterm = signal.getsignal(signal.SIGTERM)
    served = agent_module.Agent(None, "tcp://127.0.0.1:0", keys["pi-1"], name="pi-1", masters=masters)
    signal.signal(signal.SIGTERM, sigterm)
    thread = threading.Thread(target=served.serve, daemon=True)
    thread.start()
    yield served
    served.stop()
    thread.join(5)


def test_a_master_with_its_own_key_uses_an_agent_that_lists_it(keys, agent, tmp_path, stories_weights):
    agents = authorized(tmp_path / "agents", f"{keys['pi-1'].public.decode()} pi-1 {agent.endpoint.split('://')[1]}")
    master = keys["master"].with_agents(agents)
    model = cluster_model(stories_weights, [agent.endpoint], master, context=CONTEXT)
    try:
        reference = Transformer(stories_weights, max_seq_len=CONTEXT)
        assert np.argmax(model.forward(PROMPT)) == np.argmax(reference.forward(PROMPT))
        assert np.argmax(model.forward([5])) == np.argmax(reference.forward([5]))  # datagrams under a session key
    finally:
        model.close()


def test_another_devices_key_cannot_act_as_master(keys, agent, tmp_path):
    """pi-2 stolen: its key pair, pointed at pi-1 as a master would, is refused in the handshake."""
    thief = keys["pi-2"].with_agents(
        authorized(tmp_path / "agents", f"{keys['pi-1'].public.decode()} pi-1 {agent.endpoint.split('://')[1]}"))
    answer = ask_status([agent.endpoint], thief, timeout_s=1.5)[agent.endpoint]
    assert "error" in answer and agent.refused_handshakes >= 1
    # said as generate says it, not as a timeout
    assert "security handshake" in answer["error"] and "another cluster key" in answer["error"], answer
    master = keys["master"].with_agents(thief.agents)
    assert "error" not in ask_status([agent.endpoint], master, timeout_s=5)[agent.endpoint]  # the master's works


def test_a_revoked_or_impersonated_agent_is_refused(keys, agent, tmp_path, stories_weights):
    where = agent.endpoint.split("://")[1]
    revoked = keys["master"].with_agents(authorized(tmp_path / "agents", f"{keys['pi-2'].public.decode()} pi-2 10.0.0.9:7070"))
    with pytest.raises(ConfigError, match=f"agent {agent.endpoint} is not in .*agents"):
        cluster_model(stories_weights, [agent.endpoint], revoked, context=CONTEXT)
    # the master expects pi-2's key at pi-1's address (a device swapped in): the handshake cannot complete
    impostor = keys["master"].with_agents(authorized(tmp_path / "agents2", f"{keys['pi-2'].public.decode()} pi-2 {where}"))
    assert "error" in ask_status([agent.endpoint], impostor, timeout_s=1.5)[agent.endpoint]


def test_a_device_key_alone_trusts_nobody(keys, tmp_path):
    key_file = tmp_path / "pi-1.key"
    out = subprocess.run([sys.executable, "-m", "halo.edge_agent", "--key", str(key_file), "--listen", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--authorized-masters" in out.stderr
    with pytest.raises(ConfigError, match="--authorized-agents"):
        keys["master"].server_key("tcp://127.0.0.1:7070")


@pytest.mark.parametrize("text, said", [("", "authorizes no device"), ("short pi-1\n", "40-character"),
                                        (f"{'~' * 40} pi-1\n", "40-character z85"),  # was ZeroMQ's Invalid argument
                                        (f"{'x' * 40} pi-1 10.0.0.1:99999\n", "port")])
def test_authorized_keys_files_are_checked(tmp_path, text, said):
    path = tmp_path / "authorized"
    path.write_text(text)
    with pytest.raises(ConfigError, match=said):
        load_authorized(path)


def test_keygen_for_a_device_prints_its_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "keygen", "--device", "pi-7", "--out", str(tmp_path / "k")],
                         capture_output=True, text=True, timeout=60, check=True)
    key = load_key(tmp_path / "k")
    assert key.device == "pi-7" and f"{key.public.decode()} pi-7" in out.stdout
    assert key.udp_key == bytes(32)  # no secret in common: sessions' datagram keys come from their nonces


def test_a_stage_worker_with_its_own_key_admits_only_its_masters(keys, tmp_path):
    from halo.edge_agent.stage_worker import StageWorker

    masters = authorized(tmp_path / "masters", f"{keys['master'].public.decode()} master")
    sigterm = signal.getsignal(signal.SIGTERM)
    worker = StageWorker(None, "tcp://127.0.0.1:0", keys["pi-1"], name="stage-1", masters=masters)
    signal.signal(signal.SIGTERM, sigterm)
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    try:
        where = worker.endpoint.split("://")[1]
        agents = authorized(tmp_path / "agents", f"{keys['pi-1'].public.decode()} stage-1 {where}")
        assert "error" not in ask_status([worker.endpoint], keys["master"].with_agents(agents), timeout_s=5)[worker.endpoint]
        assert "error" in ask_status([worker.endpoint], keys["pi-2"].with_agents(agents), timeout_s=1.5)[worker.endpoint]
    finally:
        worker.stop()
        thread.join(5)
