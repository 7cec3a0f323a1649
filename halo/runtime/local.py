"""A cluster on this machine: N halo-agent processes on loopback, started and stopped by the master.

Agents run as `python -P -m halo.edge_agent`: `-P` keeps the working directory off the child's module
path, so the installed halo is the one it imports even when the master runs from a source checkout
(whose top-level halo/ folder would otherwise shadow the installed package and lack halo.edge_agent).
Each agent's stderr is relayed to ours line by line (prefixed with its name) and its tail kept, so an
agent that dies at start is reported at once with its own words, not after a timeout.

Children die with the master (PR_SET_PDEATHSIG), so a crash or Ctrl-C leaves no orphans. The N + 1
processes share this machine's cores: each (the master too, while the cluster runs) gets
cores // (N + 1) BLAS threads, because oversubscribed BLAS threads spin and slow everyone ~3x.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from halo.errors import HaloError

STDERR_TAIL_LINES = 20


class AgentProcess:
    """One local halo daemon (agent, stage worker, or `halo-master serve`): its address once it prints its
    LISTENING line, and the tail of what it said on stderr (relayed, so a full pipe never blocks it)."""

    def __init__(self, name: str, argv: list[str], popen=subprocess.Popen):
        """popen: how to start it (e.g. inside a network namespace of the test bed)."""
        self.name = name
        self.process = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_die_with_parent)
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._relay = threading.Thread(target=self._relay_stderr, name=f"{name}-stderr", daemon=True)
        self._relay.start()
        self.endpoint: str | None = None

    def _relay_stderr(self) -> None:
        for line in self.process.stderr:
            self.stderr_tail.append(line.rstrip("\n"))
            sys.stderr.write(f"[{self.name}] {line}")
        self.process.wait()  # its stderr closed: it is ending; reaped here, not a zombie until the master exits

    def wait_listening(self, timeout_s: float) -> str:
        """The agent's endpoint from its LISTENING line; a clear error with its stderr if it dies first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 0.1)
            if ready:
                line = self.process.stdout.readline()
                if line.startswith("LISTENING "):
                    self.endpoint = line.split()[1]
                    return self.endpoint
                if not line and self.process.poll() is not None:
                    break
        code = self.process.poll()
        if code is None:
            raise HaloError(f"local agent {self.name} did not start listening within {timeout_s:.0f} s")
        said = self.said().replace("\n", "\n  ") or "(nothing on stderr)"
        raise HaloError(f"local agent {self.name} exited with code {code} before it listened; it said:\n  {said}")

    def said(self) -> str:
        """The last lines it wrote to stderr (all of them once it has exited)."""
        if self.process.poll() is not None:
            self._relay.join(timeout=1.0)
        return "\n".join(self.stderr_tail)

    def __getattr__(self, name):  # poll, kill, wait, terminate, pid: the process's own
        return getattr(self.process, name)


class LocalCluster:
    """N daemons of `module` (halo-agent by default; pipeline mode's halo-stage-worker too) on loopback with a
    throwaway cluster key, stopped on exit. threads: BLAS threads per process (default cores // (N + 1):
    tensor-parallel agents and the master compute at the same time)."""

    def __init__(self, n: int, model_path: str | None = None, startup_timeout_s: float = 30.0,
                 predictors: str | None = None, extra_args: tuple = (), module: str = "halo.edge_agent",
                 name: str = "local", threads: int | None = None):
        if n < 1:
            raise HaloError(f"a local cluster needs at least one agent, got {n}")
        self.n, self.model_path, self.timeout = n, model_path, startup_timeout_s
        self.predictors, self.extra_args, self.module, self.name = predictors, tuple(extra_args), module, name
        self.threads = threads or max(1, (os.cpu_count() or 1) // (n + 1))
        self.processes: list[AgentProcess] = []
        self.endpoints: list[str] = []
        self._dir = None
        self._limits = None
        self.key = self.key_path = None

    def __enter__(self) -> "LocalCluster":
        from threadpoolctl import threadpool_limits

        from halo.transport.reliable import generate_key

        self._limits = threadpool_limits(self.threads)
        self._dir = tempfile.TemporaryDirectory(prefix="halo-local-")
        self.key_path = Path(self._dir.name) / "cluster.key"
        self.key = generate_key(self.key_path)
        try:
            self.processes = []
            for i in range(self.n):  # one by one: those started before one that failed are stopped too
                self.processes.append(self._start(i, "tcp://127.0.0.1:0"))
            self.endpoints = [p.wait_listening(self.timeout) for p in self.processes]
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self, i: int, listen: str) -> AgentProcess:
        name = f"{self.name}-{i + 1}"
        argv = agent_command(listen, self.key_path, name, self.threads, self.model_path, self.predictors,
                             module=self.module) + list(self.extra_args)
        return AgentProcess(name, argv)

    def restart(self, i: int) -> str:
        """Start daemon i again at its old address once its process has ended: a device that rebooted. Call it
        from a thread that lives as long as the cluster: a child dies with the thread that started it
        (PR_SET_PDEATHSIG)."""
        if self.processes[i].poll() is None:
            raise HaloError(f"{self.processes[i].name} is still running; stop it before restarting it")
        self.processes[i] = self._start(i, self.endpoints[i])
        return self.processes[i].wait_listening(self.timeout)

    def __exit__(self, *exc) -> None:
        stop_processes(self.processes)
        if self._dir:
            self._dir.cleanup()
        if self._limits is not None:
            self._limits.restore_original_limits()


def module_command(module: str, *args: str) -> list[str]:
    """`python -P -m module args`: every halo child process starts this way, so that from a source checkout's
    root the installed package, not the source folder halo/ (which lacks halo.edge_agent, halo.eval, ...), is
    the one it imports (see the module docstring)."""
    return [sys.executable, "-P", "-m", module, *map(str, args)]


def agent_command(listen: str, key_path, name: str, threads: int = 1, model_path=None, predictors=None,
                  log_level: str = "WARNING", module: str = "halo.edge_agent") -> list[str]:
    """The command line of a daemon started by this process."""
    argv = module_command(module, "--listen", listen, "--key", key_path, "--name", name, "--log-level", log_level,
                          "--threads", threads)
    if model_path:
        argv += ["--model", str(model_path)]
    if predictors:
        argv += ["--predictors", str(predictors)]
    return argv


def stop_processes(processes: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM (agents drain and leave), then SIGKILL whoever is still there after grace_s. SIGCONT after the
    SIGTERM: a stopped process (SIGSTOP, a debugger) takes neither until continued, and the master waited the whole
    grace for one the survival layer had long planned around."""
    import signal

    for p in processes:
        if p.poll() is None:
            p.terminate()
            p.send_signal(signal.SIGCONT)
    for p in processes:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies; a process group of its own, so a Ctrl-C at the terminal reaches
    the parent alone, which stops its children itself (each relayed a KeyboardInterrupt traceback)."""
    import ctypes

    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
