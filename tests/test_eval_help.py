"""Every eval script answers --help with its usage and runs nothing (bench_compression read no arguments: --help ran
the benchmark and wrote its results over the committed ones)."""

import contextlib
import importlib
import io
import os
from pathlib import Path

import pytest

import halo.eval

SCRIPTS = sorted(p.stem for p in Path(halo.eval.__file__).parent.glob("*.py")
                 if p.stem not in ("__init__", "random_checkpoint", "dllama_files", "lm_eval_plugin")
                 and "def main(" in p.read_text())


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_prints_usage_and_writes_nothing(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (results go under the working directory by default)
    module = importlib.import_module(f"halo.eval.{name}")
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            code = module.main(["--help"])
        except SystemExit as e:
            code = e.code
    assert code in (0, None) and "usage" in said.getvalue().lower(), said.getvalue()[-500:]
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_script_s_halo_error_is_one_line(name):
    """`python -m halo.eval.accuracy_halo --model stories260K` (its docstring's own example) ended in a
    ModelFormatError traceback: every script's exit goes through report.run_script."""
    source = (Path(halo.eval.__file__).parent / f"{name}.py").read_text()
    assert "sys.exit(run_script(main))" in source


def test_a_bad_model_name_ends_an_eval_script_in_one_line(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "halo.eval.accuracy_halo", "--model", "stories260K"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("accuracy_halo: error: stories260K: no such file or directory")
