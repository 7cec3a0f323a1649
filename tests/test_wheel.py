"""A wheel built from the repo installs and runs in a fresh virtualenv (the Pi agent's core deps only)."""

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_and_generates_in_a_fresh_venv(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path / "dist")],
                   check=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("halo_edge-*.whl"))
    with zipfile.ZipFile(wheel) as contents:  # bench_round_floor builds its compiled floor from these, installed
        assert {"halo/_nbits.c", "halo/eval/round_floor.c"} <= set(contents.namelist())
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
    if shutil.which("cc"):  # the wheel carries the compact-group C kernel and the C datagram path where they build
        subprocess.run([str(bin_dir / "python"), "-c", "from halo import _nbits; from halo.transport import _datagrams"],
                       cwd=tmp_path, env=env, check=True, timeout=60)
    out = subprocess.run([str(bin_dir / "halo-master"), "generate", "--prompt", "Once upon a time",
                          "--max-new-tokens", "8", "--json"], capture_output=True, text=True, cwd=tmp_path, env=env,
                         check=True, timeout=120)
    assert json.loads(out.stdout)["text"] == ", there was a little girl"


def build_wheel(out: Path, kind: str) -> Path:
    env = {**os.environ, "HALO_WHEEL": kind}
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(out)], check=True,
                   timeout=600, env=env)
    return next(out.glob("halo_edge-*.whl"))


@pytest.mark.slow
def test_the_agent_wheel_leaves_out_benchmarks_and_the_browser_page_and_still_runs(tmp_path):
    """HALO_WHEEL=agent (what rpi/install-agent.sh installs): the runtime without halo.eval and the browser-worker
    page. Installed fresh, it runs the known answer from the repository root, and an agent starts from it."""
    # a module an earlier build left in build/lib (as moved modules were left): no wheel may carry it
    import sysconfig

    tag = f"lib.{sysconfig.get_platform()}-cpython-{sys.version_info.major}{sys.version_info.minor}"
    for lib in {*(ROOT / "build").glob("lib*"), ROOT / "build" / tag}:
        (lib / "halo" / "transport").mkdir(parents=True, exist_ok=True)
        (lib / "halo" / "transport" / "_stale_probe.py").write_text("")
    full, agent = build_wheel(tmp_path / "full", "full"), build_wheel(tmp_path / "agent", "agent")
    with zipfile.ZipFile(full) as f, zipfile.ZipFile(agent) as a:
        full_names, agent_names = set(f.namelist()), set(a.namelist())
    left_out = {n for n in full_names - agent_names}
    assert any(n.startswith("halo/eval/") for n in left_out) and "halo/_nbits.c" in left_out
    assert not any(n.startswith(("halo/eval/", "halo/pipeline/web_assets/")) for n in agent_names)
    assert {"halo/edge_agent/agent.py", "halo/compute/worker.py", "halo/assets/stories260K/stories260K.bin"} <= agent_names
    assert all(n.startswith(("halo/eval/", "halo/pipeline/web_assets/", "halo/_nbits.c", "halo_edge-")) for n in left_out)
    # what the tree holds, no more: build/lib keeps whatever an earlier build put there (modules since moved)
    folders = {"halo/predictors/": "predictors/", "halo/scheduler/": "scheduler/", "halo/transport/": "transport/",
               "halo/edge_agent/": "edge_agent/", "halo/rpi/": "rpi/", "halo/eval/": "eval/"}

    def source_of(name: str) -> Path:
        for package, folder in folders.items():
            if name.startswith(package):
                return ROOT / folder / name[len(package):]
        return ROOT / name

    stale = {n for n in full_names | agent_names if n.endswith(".py") and not source_of(n).is_file()}
    assert stale == set()
    if any(n.startswith("halo/pipeline/web_assets/") for n in full_names):  # the page built (npm): 28 MB of wasm
        assert agent.stat().st_size <= full.stat().st_size / 2, (agent.stat().st_size, full.stat().st_size)
    venv.EnvBuilder(with_pip=True).create(tmp_path / "venv")
    bin_dir = tmp_path / "venv" / "bin"
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", str(agent)], check=True, timeout=900)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    out = subprocess.run([str(bin_dir / "halo-master"), "generate", "--prompt", "Once upon a time", "--local-agents",
                          "1", "--max-new-tokens", "8", "--json"], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["text"] == ", there was a little girl"
    missing = subprocess.run([str(bin_dir / "python"), "-P", "-c", "import halo.eval"], capture_output=True, text=True,
                             cwd=ROOT, env=env, timeout=60)
    assert missing.returncode != 0 and "No module named 'halo.eval'" in missing.stderr
    refused = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w",
                              str(tmp_path / "bogus")], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "HALO_WHEEL": "pi"})
    assert refused.returncode != 0 and "HALO_WHEEL='pi': choose one of full, agent" in refused.stdout + refused.stderr


def readme_commands() -> list[str]:
    """The bash blocks under the README's "Two commands" heading, in order: install+run, then test."""
    section = (ROOT / "README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [block.split("\n", 1)[1].strip() for block in section.split("```")[1::2] if block.startswith("bash")]


@pytest.mark.slow
def test_readme_main_command_works_from_the_repository_root(tmp_path, known_answer):
    """What a newcomer does: a fresh virtualenv, the README's first command verbatim, from the repository
    root, with a plain (non-editable) install. The source folder halo/ sits on the working directory there:
    local agents must still import the installed package (halo.edge_agent lives only there)."""
    command = readme_commands()[0]
    assert command.startswith("pip install '.[master]'") and "--local-agents 2" in command
    venv.EnvBuilder(with_pip=True).create(tmp_path / "venv")
    bin_dir = tmp_path / "venv" / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", VIRTUAL_ENV=str(tmp_path / "venv"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    out = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    # after pip's output: the prompt's 4 tokens + 256 new ones, i.e. the known answer (256 tokens from BOS)
    # and a few tokens more
    generated = out.stdout[out.stdout.rfind("Once upon a time"):]
    assert generated.startswith(known_answer) and len(generated) < len(known_answer) + 40
    known = subprocess.run([str(bin_dir / "halo-master"), "generate", "--prompt", "", "--local-agents", "2", "--json"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert known.returncode == 0, known.stderr[-3000:]
    assert json.loads(known.stdout)["text"] == known_answer


def test_a_local_agent_that_dies_at_start_is_reported_at_once_with_its_own_words(tmp_path):
    """An agent that crashes at start (here: a model file that does not exist) is named with its stderr,
    within seconds, not after the start-up timeout."""
    import time

    from halo.distributed import LocalCluster
    from halo.errors import HaloError

    start = time.monotonic()
    with pytest.raises(HaloError, match=r"(?s)local-1 exited with code 2 before it listened.*no such (model )?file"):
        with LocalCluster(1, model_path=str(tmp_path / "missing.bin"), startup_timeout_s=60):
            pass
    assert time.monotonic() - start < 15
