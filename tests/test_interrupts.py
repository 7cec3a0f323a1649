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


def test_sigterm_ends_a_master_as_ctrl_c_does(tmp_path):
    """systemctl stop, `timeout`: SIGTERM ended halo-master at once, its local agents' folder (the cluster key in
    it) left in /tmp; now it is an interrupt: agents stopped, folder removed, one line, exit 143."""
    import time

    master = subprocess.Popen([*module_command("halo.cli.master"), "generate", "--local-agents", "1", "--prompt", "Once"],
                              env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("halo-local-*")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(tmp_path.glob("halo-local-*")), "the master never started its agents"
        master.send_signal(signal.SIGTERM)  # (its agent is still loading: a second at least)
        _, err = master.communicate(timeout=60)
    finally:
        master.kill()
    assert master.returncode == 143 and err.strip().endswith("halo-master: terminated"), err
    assert not list(tmp_path.glob("halo-local-*")) and "Traceback" not in err


def test_agents_started_before_one_that_failed_are_stopped(monkeypatch):
    """LocalCluster kept its processes only once all had started: the first agents outlived a failed second."""
    import pytest

    from halo.runtime.local import LocalCluster

    started = []
    real = LocalCluster._start

    def start(self, i, listen):
        if i == 1:
            raise OSError(11, "Resource temporarily unavailable")
        started.append(real(self, i, listen))
        return started[-1]

    monkeypatch.setattr(LocalCluster, "_start", start)
    with pytest.raises(OSError):
        LocalCluster(2).__enter__()
    assert started and started[0].poll() is not None


def test_sigterm_ends_status_watch_as_terminated(tmp_path):
    """`status --watch` ends with Ctrl-C (exit 0, its normal end); SIGTERM (timeout, a supervisor) was taken for that
    too: it now ends as any SIGTERM does, exit 143."""
    import time

    watch = subprocess.Popen([*module_command("halo.cli.master"), "status", "--agents", "127.0.0.1:9", "--insecure", "--watch",
                              "--timeout", "0.2", "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        time.sleep(3)  # (imports, then the first table)
        watch.send_signal(signal.SIGTERM)
        _, err = watch.communicate(timeout=30)
    finally:
        watch.kill()
    assert watch.returncode == 143 and "halo-master: terminated" in err, err
