"""Domain errors. Every message says what is wrong *and* what to do about it."""

import contextlib
import signal
import sys


class HaloError(Exception):
    """Base class: anything halo raises on purpose."""


class ModelFormatError(HaloError):
    """A model or tokenizer file is missing, truncated, malformed or unsupported."""

    def __init__(self, path, problem: str, fix: str = ""):
        self.path = str(path)
        self.problem = problem
        self.fix = fix
        message = f"{self.path}: {problem}"
        if fix:
            message += f" ({fix})"
        super().__init__(message)


class ConfigError(HaloError):
    """A setting given by the user is out of range or inconsistent."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (systemctl stop, `timeout`, a closed terminal) raised where Ctrl-C's KeyboardInterrupt is, so a run
    cleans up as after Ctrl-C: local agents stopped, temporary folders (one holds a cluster key) and half-written
    files removed (Python's default for SIGTERM ends the process with none of that)."""

    exit_code = 143  # 128 + SIGTERM, as the shell reports a process the signal ended


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises Terminated in the main thread while inside; the handler before is put back on the way out."""
    def terminated(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted(program: str, e: KeyboardInterrupt) -> int:
    """The one line and exit code of a run ended by Ctrl-C (130) or SIGTERM (143)."""
    terminated = isinstance(e, Terminated)
    print(f"{program}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
    return Terminated.exit_code if terminated else 130
