"""Deployment files: the systemd unit, the install script and the example agent config."""

import configparser
import subprocess
import sys
import tomllib
from pathlib import Path

from halo.transport.reliable import generate_key

RPI = Path(__file__).resolve().parents[1] / "rpi"


def test_unit_restarts_runs_unprivileged_and_reads_etc_halo():
    unit = configparser.ConfigParser(strict=False)
    unit.read(RPI / "halo-agent.service")
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    assert service["User"] not in ("root", "") and service["KillSignal"] == "SIGTERM"
    assert "/etc/halo/agent.toml" in service["ExecStart"]


def test_install_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(RPI / "install-agent.sh")]).returncode == 0


def test_example_config_starts_an_agent(tmp_path):
    config = tomllib.loads((RPI / "agent.example.toml").read_text())
    assert set(config) == {"listen", "key", "model", "name", "weights", "threads"}
    generate_key(tmp_path / "cluster.key")
    mine = tmp_path / "agent.toml"
    mine.write_text(f'listen = "tcp://127.0.0.1:0"\nkey = "{tmp_path / "cluster.key"}"\nname = "t"\n')
    process = subprocess.Popen([sys.executable, "-m", "halo.edge_agent", "--config", str(mine)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("LISTENING tcp://127.0.0.1:")
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0  # SIGTERM drains and exits cleanly
