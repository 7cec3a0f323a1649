"""Two wheels from one tree. `pip wheel .` builds the whole product; `HALO_WHEEL=agent pip wheel .` builds what an
edge device installs (rpi/install-agent.sh): the runtime, without the benchmarks, fuzzing and result renderers
(halo.eval: run them from a checkout or the full wheel; its `halo-lm-eval` script and lm-eval plugin entry point stay
declared and say "No module named 'halo.eval'" there) and without the coordinator's browser-worker page (28 MB of
onnxruntime-web). Everything else (metadata, extensions, entry points) is pyproject.toml's. Each build starts from an
empty build/lib/halo: setuptools never clears it, and a module moved or removed since the last build went on being
packaged from there."""

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

WHEELS = ("full", "agent")
AGENT_LEAVES_OUT = ("halo/eval", "halo/pipeline/web_assets", "halo/_nbits.c")  # under the build's lib directory


class BuildPy(build_py):
    def run(self):
        wheel = os.environ.get("HALO_WHEEL", "full")
        if wheel not in WHEELS:
            raise SystemExit(f"HALO_WHEEL={wheel!r}: choose one of {', '.join(WHEELS)}")
        shutil.rmtree(Path(self.build_lib) / "halo", ignore_errors=True)
        super().run()
        if wheel == "agent":
            for relative in AGENT_LEAVES_OUT:
                path = Path(self.build_lib) / relative
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()


setup(cmdclass={"build_py": BuildPy})
