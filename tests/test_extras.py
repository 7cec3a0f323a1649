"""Each install says what it lacks: a command whose packages belong to an extra names the extra (they were
ModuleNotFoundError tracebacks), and what an edge device's core install runs needs none of them."""

import subprocess
import sys

import pytest

from halo.errors import ConfigError

WITHOUT = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None  # as if not installed\n"


def run_without(names: tuple, code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT.format(names=names) + code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def test_halo_master_without_the_coordinator_s_packages_names_the_extra(monkeypatch, capsys, tmp_path):
    from halo.cli.master import main

    monkeypatch.setitem(sys.modules, "rich.console", None)
    cluster = tmp_path / "c.toml"
    cluster.write_text('[[device]]\nname = "me"\nmemory_mb = 1000\ncompute_gflops = 10\nmaster = true\n')
    assert main(["plan", "--cluster", str(cluster)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("halo-master: error: this command needs rich, one of the coordinator's packages: "
                           "pip install 'halo-edge[master]'")


def test_halo_lm_eval_without_lm_eval_names_the_extra(tmp_path):
    done = run_without(("lm_eval", "lm_eval.api", "lm_eval.api.model"),
                       "from halo.eval.lm_eval_plugin import main\nsys.exit(main(['--help']))", tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "lm-eval is not installed: pip install 'halo-edge[eval]'" in done.stderr


def test_halo_agent_prepare_runs_on_a_core_install(tmp_path):
    """prepare imported rich for its progress bar: on a Pi's core install it failed, and the installer only said
    "no prepared groups"."""
    done = run_without(("rich", "rich.progress"), "from halo.edge_agent.__main__ import main\n"
                       "sys.exit(main(['prepare', '--weights', 'int8', '--out', 'prepared']))", tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "prepared" / "groups.bin").is_file() and "/5 layers" in done.stderr


def test_training_without_torch_is_refused_before_profiling(monkeypatch, tmp_path):
    import importlib.util

    from halo.predictors.cli import train_predictors

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(ConfigError, match=r"training needs torch, which is not installed: pip install 'halo-edge\[train\]'"):
        train_predictors(None, "/nonexistent.txt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
