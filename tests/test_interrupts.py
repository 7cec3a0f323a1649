"""Ctrl-C: an agent drains as on SIGTERM, quietly; the agents a master starts are out of the terminal's reach (the
master stops them), so one Ctrl-C prints one line, not a KeyboardInterrupt traceback from every process."""

import os
import signal
import subprocess

from halo.runtime.local import AgentProcess, module_command


def test_ctrl_c_drains_an_agent_quietly():
    agent = AgentProcess("agent", [*module_command("halo.edge_agent"), "--listen", "tcp://127.0.0.1:0", "--insecure"],
                         popen=lambda argv, **kw: subprocess.Popen(argv, **kw))
    try:
        agent.wait_listening(60)
        agent.process.send_signal(signal.SIGINT)
        assert agent.process.wait(timeout=30) == 0
    finally:
        agent.kill()
    said = agent.said()  # (all of it: the relay is joined once the process has exited)
    assert "Traceback" not in said and "KeyboardInterrupt" not in said and "stopping" in said, said


def test_the_agents_a_master_starts_have_a_process_group_of_their_own():
    agent = AgentProcess("agent", [*module_command("halo.edge_agent"), "--listen", "tcp://127.0.0.1:0", "--insecure"])
    try:
        agent.wait_listening(60)
        assert os.getpgid(agent.process.pid) == agent.process.pid != os.getpgid(0)
    finally:
        agent.kill()
