"""Start and stop a `halo-master serve` subprocess for tests (it prints LISTENING URL once it listens)."""

import subprocess
import sys
import time

API_KEY = "test-key-0123456789"


def start_server(tmp_path, *extra, api_key=True):
    argv = [sys.executable, "-m", "halo.cli", "serve", "--port", "0", "--log-level", "warning", *extra]
    if api_key:
        key_file = tmp_path / "api.key"
        key_file.write_text(API_KEY + "\n")
        argv += ["--api-key-file", str(key_file)]
    err_path = tmp_path / "server.err"  # a file, not a pipe: a full pipe would block the server
    with open(err_path, "w") as err:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
    process.err_path = err_path
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.startswith("LISTENING "):
            return process, line.split()[1]
        if not line and process.poll() is not None:
            break
    process.kill()
    raise RuntimeError(f"the server did not start: {err_path.read_text()[-3000:]}")


def stop_server(process):
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
