"""Start and stop a `halo-master serve` subprocess for tests (it prints LISTENING URL once it listens)."""

import subprocess

from halo.errors import HaloError
from halo.runtime.local import AgentProcess, module_command

API_KEY = "test-key-0123456789"


def start_server(tmp_path, *extra, api_key=True):
    argv = [*module_command("halo.cli.master"), "serve", "--port", "0", "--log-level", "warning", *extra]
    if api_key:
        key_file = tmp_path / "api.key"
        key_file.write_text(API_KEY + "\n")
        key_file.chmod(0o600)  # the server refuses a key file others can read
        argv += ["--api-key-file", str(key_file)]
    process = AgentProcess("server", argv)
    try:
        return process, process.wait_listening(60)
    except HaloError as e:
        process.kill()
        raise RuntimeError(f"the server did not start: {e}") from None


def stop_server(process):
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
