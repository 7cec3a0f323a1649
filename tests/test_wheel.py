"""A wheel built from the repo installs and runs in a fresh virtualenv (the Pi agent's core deps only)."""

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_and_generates_in_a_fresh_venv(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path / "dist")],
                   check=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("halo_edge-*.whl"))
    venv.EnvBuilder(with_pip=True).create(tmp_path / "venv")
    bin_dir = tmp_path / "venv" / "bin"
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=900)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    probe = ("import halo, halo.scheduler, halo.transport, halo.predictors, halo.edge_agent, halo.rpi, halo.eval;"
             "from halo.eval.lm_eval_tasks import TASKS_DIR;"
             "assert (TASKS_DIR / 'tinystories_ppl.yaml').is_file() and (TASKS_DIR / 'data' / 'tinystories_cloze.jsonl').is_file();"
             "print(halo.__file__)")
    out = subprocess.run([str(bin_dir / "python"), "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env=env, check=True, timeout=120)
    assert str(tmp_path / "venv") in out.stdout  # the installed copy, not the source tree
    out = subprocess.run([str(bin_dir / "halo-master"), "generate", "--prompt", "Once upon a time",
                          "--max-new-tokens", "8", "--json"], capture_output=True, text=True, cwd=tmp_path, env=env,
                         check=True, timeout=120)
    assert json.loads(out.stdout)["text"] == ", there was a little girl"
