"""Busy polling and the cores a process may use: a node with cores of its own spins for its datagrams instead of
sleeping (a sleeping vCPU wakes tens of microseconds late at both ends of every round), sizes its compute threads
from its CPU affinity, and never spins where it was left on every core."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from halo.host.cores import dedicated_cores, usable_cores
from halo.transport import udp, wire

needs_c = pytest.mark.skipif(wire._datagrams is None, reason="the C transport (transport/_datagrams.c) is not built")


@pytest.fixture
def busy_poll():
    """set_busy_poll for the test, off again afterwards (it is process-wide)."""
    yield udp.set_busy_poll
    udp.set_busy_poll("off")


@pytest.fixture
def pair():
    a, b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    a.bind(("127.0.0.1", 0))
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def test_the_modes_and_what_auto_picks(busy_poll):
    with pytest.raises(ValueError, match="auto, on, off"):
        busy_poll("sometimes")
    assert busy_poll("off") is False
    if wire._datagrams is not None:
        assert busy_poll("on") is True
        assert busy_poll("auto") is dedicated_cores()


@needs_c
def test_the_c_setting_is_bounded():
    for bad in (-0.001, 1.5, float("nan")):
        with pytest.raises(ValueError, match="0 to 1 second"):
            wire._datagrams.set_busy_poll(bad)


@needs_c
@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_spinning_wait_returns_on_arrival_and_gives_up_at_its_timeout(busy_poll, pair, mode):
    a, b = pair
    busy_poll(mode)
    t = time.perf_counter()
    assert udp.spin_readable(a, 0.05) is False  # nothing came: the whole timeout, spinning part of it or not
    assert 0.045 < time.perf_counter() - t < 1.0
    threading.Timer(0.02, lambda: b.sendto(b"x", a.getsockname())).start()
    t = time.perf_counter()
    assert udp.spin_readable(a, 2.0) is True
    assert time.perf_counter() - t < 1.0
    assert a.recv(16) == b"x"


@needs_c
def test_a_gather_that_spins_still_checks_every_datagram(busy_poll):
    """The spin only replaces the sleep before recvmmsg: what is read goes through the same checks."""
    import numpy as np

    busy_poll("on")
    key = bytes(range(32))
    master, agent = udp.UdpEndpoint(key, 7, 0), udp.UdpEndpoint(key, 7, 1)
    forger = udp.UdpEndpoint(bytes(32), 7, 1)  # another key: its datagrams must be refused
    try:
        values = np.arange(1000, dtype=np.float32)
        forger.send_vector({0: master.address}, 5, values + 1)
        agent.send_vector({0: master.address}, 5, values)
        result = master.gather(5, {1: len(values)}, wire.FLOAT32, udp.GatherPolicy(deadline_s=2.0, hard_deadline_s=2.0))
        assert result.complete and np.array_equal(result.values[1], values)
        assert master.rejections().get("bad_tag", 0) == wire.chunk_count(len(values), wire.FLOAT32)
    finally:
        for e in (master, agent, forger):
            e.close()


def child(code: str, cores: set[int]) -> str:
    """What `code` prints in a Python started on `cores` only."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                          preexec_fn=lambda: os.sched_setaffinity(0, cores)).stdout.strip()


def test_cores_follow_the_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0))
    one = {min(os.sched_getaffinity(0))}
    code = ("from halo.host.cores import usable_cores, dedicated_cores; from halo.edge_agent.profile import device_profile; "
            "print(usable_cores(), dedicated_cores(), device_profile()['cores'])")
    pinned = child(code, one).split()
    assert pinned[0] == "1" and pinned[2] == "1"  # the profile the scheduler plans with says one core too
    assert pinned[1] == str((os.cpu_count() or 1) > 1)  # on a one-core machine, one core is all of it


def test_a_pinned_agent_computes_on_the_cores_it_was_given():
    """Its default --threads: its affinity, not the machine (two OpenMP threads on one pinned core made a
    TinyLlama-shape agent's half of a token 12-14 ms instead of 8.7)."""
    from halo.distributed import AgentProcess, stop_processes
    from halo.distributed.remote import ask_status
    from halo.runtime.local import module_command

    one = {min(os.sched_getaffinity(0))}

    def pinned_popen(argv, preexec_fn=None, **kwargs):
        def before():
            os.sched_setaffinity(0, one)
            preexec_fn()
        return subprocess.Popen(argv, preexec_fn=before, **kwargs)

    argv = module_command("halo.edge_agent", "--listen", "tcp://127.0.0.1:0", "--insecure", "--log-level", "WARNING")
    agent = AgentProcess("pinned", argv, popen=pinned_popen)
    try:
        endpoint = agent.wait_listening(60)
        status = ask_status([endpoint], None, insecure=True, timeout_s=10)[endpoint]
        assert status["threads"] == 1, status
        assert status["busy_poll"] is (wire._datagrams is not None and (os.cpu_count() or 1) > 1)
    finally:
        stop_processes([agent])


def test_the_agent_spins_only_while_rounds_come(monkeypatch):
    """Agent.wait: busy polling on, a round served recently -> it spins on the UDP socket (then polls without
    waiting); idle, or busy polling off -> the plain 200 ms poll."""
    from halo.edge_agent import agent as agent_module

    sigterm = signal.getsignal(signal.SIGTERM)
    agent = agent_module.Agent(None, "tcp://127.0.0.1:0", None, insecure=True, name="spin", busy_poll="off")
    signal.signal(signal.SIGTERM, sigterm)
    spins, polls = [], []
    monkeypatch.setattr(agent_module, "spin_readable", lambda sock, timeout_s: spins.append(timeout_s) or True)

    class Poller:
        def poll(self, timeout_ms):
            polls.append(timeout_ms)
            return []

    try:
        agent.busy_poll, agent._last_round = True, time.monotonic()
        agent.wait(Poller())
        assert spins == [udp.BUSY_POLL_S] and polls == [0]
        agent._last_round = time.monotonic() - 2 * agent_module.BUSY_WINDOW_S  # no round for a while: sleep
        agent.wait(Poller())
        agent.busy_poll, agent._last_round = False, time.monotonic()
        agent.wait(Poller())
        assert spins == [udp.BUSY_POLL_S] and polls == [0, 200, 200]
    finally:
        agent.close()


def test_the_agent_config_file_takes_busy_poll_and_refuses_a_bad_value(tmp_path):
    from halo.edge_agent.__main__ import read_config
    from halo.errors import ConfigError

    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('busy_poll = "on"\n')
    bad.write_text('busy_poll = "sometimes"\n')
    assert read_config(str(good))["busy_poll"] == "on"
    with pytest.raises(ConfigError, match="busy_poll must be one of auto, on, off"):
        read_config(str(bad))
