"""The master's reading of its control connection's security handshake (halo/distributed/remote.py): a lossy radio
link breaks one off now and then, which zmq's next reconnect completes; a wrong key fails every one. Only repeated
failures (or a plaintext/CURVE mismatch, which the first says) are named as a refusal."""

import pytest
import zmq

from halo.compute.shares import Shares
from halo.distributed import remote
from halo.distributed.remote import HANDSHAKE_ATTEMPTS, AgentError, RemoteAgent

BROKEN = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32)  # EPIPE: what the master sees of a wrong key, or a broken exchange


class Monitor:
    """A monitor socket's events, as recv_monitor_message gives them."""

    def __init__(self, events):
        self.events = list(events)

    def poll(self, timeout=0):
        return bool(self.events)


def agent_reading(events, monkeypatch) -> RemoteAgent:
    monkeypatch.setattr("zmq.utils.monitor.recv_monitor_message",
                        lambda monitor: dict(zip(("event", "value"), monitor.events.pop(0))))
    return RemoteAgent(1, "tcp://10.0.0.1:7070", Shares([], [], []), None, 1.0, monitor=Monitor(events))


def test_a_handshake_broken_off_once_is_retried_not_named(monkeypatch):
    agent = agent_reading([BROKEN, (zmq.EVENT_DISCONNECTED, 9), (zmq.EVENT_CONNECT_RETRIED, 100),  # scheduled
                           (zmq.EVENT_CONNECT_DELAYED, 0), (zmq.EVENT_CONNECTED, 9),
                           (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)], monkeypatch)
    agent._read_monitor()
    assert agent.link == "secured" and agent.handshake_failures == 0 and not agent.gone()


def test_a_disconnect_after_a_failed_handshake_is_no_departure_unless_nobody_listens_any_more(monkeypatch):
    agent = agent_reading([BROKEN, (zmq.EVENT_DISCONNECTED, 9), (zmq.EVENT_CONNECT_RETRIED, 100)], monkeypatch)
    assert not agent.gone() and agent.link == "reconnecting"  # zmq connects again: the hello may still come
    dead = agent_reading([BROKEN, (zmq.EVENT_DISCONNECTED, 9), (zmq.EVENT_CONNECT_RETRIED, 100),
                          (zmq.EVENT_CONNECT_DELAYED, 0), (zmq.EVENT_CONNECT_RETRIED, 200)], monkeypatch)
    assert dead.gone() and dead.link == "refused"  # the reconnect failed: the agent went away


def test_failures_in_a_row_are_named_as_the_key_and_a_mechanism_mismatch_at_once(monkeypatch):
    agent = agent_reading([BROKEN, (zmq.EVENT_DISCONNECTED, 9)] * HANDSHAKE_ATTEMPTS, monkeypatch)
    with pytest.raises(AgentError, match="refused the security handshake: it holds another cluster key"):
        agent._read_monitor()
    assert agent.handshake_failures == HANDSHAKE_ATTEMPTS
    mismatch = agent_reading([(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)],
                             monkeypatch)
    with pytest.raises(AgentError, match="disagree on security"):
        mismatch._read_monitor()
    assert remote.HANDSHAKE_ATTEMPTS >= 2  # one broken exchange alone is never named
