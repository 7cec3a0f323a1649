"""A Raspberry Pi's install, emulated: the aarch64 wheel cross-builds (rpi/arm64.py), and rpi/install-agent.sh run in
an arm64 Debian bookworm (debootstrap; every program in it runs under qemu-user-static through binfmt_misc) installs
it with its dependencies from the package index; the agent it set up, started as the unit starts it (user halo, its
config), answers `halo-master status` from this machine.

Slow (the Debian root takes ~10 minutes the first time, the install a few more: every instruction is emulated) and
needs root, debootstrap, qemu-user-static with binfmt_misc, and the package index; where any is missing it skips and
says which, unless HALO_REQUIRE_ARM64=1 (the wheel) and HALO_REQUIRE_ARM64_INSTALL=1 (the install: CI sets it where
binfmt_misc runs aarch64 programs) make that a failure."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from halo.errors import ConfigError
from halo.model.loader import BUNDLED_MODEL
from halo.rpi import arm64

RPI = Path(arm64.__file__).parent
AARCH64 = b"\xb7\x00"  # e_machine of an aarch64 ELF file
HOST_CA = "/etc/halo-host-ca.crt"  # inside the root


def unavailable(reason: str, required_by: str = "HALO_REQUIRE_ARM64"):
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{required_by}=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if missing := arm64.missing_tools():
        unavailable(f"no cross toolchain: apt-get install {' '.join(missing)}")
    try:
        return arm64.wheel(tmp_path_factory.mktemp("wheel"))
    except ConfigError as e:
        unavailable(f"the aarch64 wheel could not be built here: {e}")


def test_the_aarch64_wheel_carries_both_extensions_built_for_aarch64(wheel):
    assert wheel.name.endswith("-cp311-cp311-linux_aarch64.whl")
    with zipfile.ZipFile(wheel) as archive:
        objects = {name: archive.read(name) for name in archive.namelist() if name.endswith(".so")}
    assert sorted(objects) == ["halo/_nbits.cpython-311-aarch64-linux-gnu.so",
                               "halo/transport/_datagrams.cpython-311-aarch64-linux-gnu.so"]
    assert all(data[:4] == b"\x7fELF" and data[18:20] == AARCH64 for data in objects.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Chroot:
    """/proc and /dev of this machine inside the root while it is used; its DNS settings for pip."""

    def __init__(self, root: Path):
        self.root = root

    def __enter__(self):
        shutil.copy("/etc/resolv.conf", self.root / "etc" / "resolv.conf")
        # the certificates this machine trusts (its way to the package index may pass a TLS proxy of its own)
        paths = ssl.get_default_verify_paths()
        shutil.copy(os.environ.get("PIP_CERT") or paths.cafile or paths.openssl_cafile, self.root / HOST_CA[1:])
        try:
            for source, target, args in (("proc", "proc", ["-t", "proc"]), ("/dev", "dev", ["--bind"])):
                subprocess.run(["mount", *args, source, str(self.root / target)], check=True, capture_output=True)
        except BaseException:
            arm64.unmount_under(self.root)
            raise
        return self

    def __exit__(self, *exc):
        arm64.unmount_under(self.root)

    def run(self, argv: list[str], timeout: float, **kwargs):
        return subprocess.run(["chroot", str(self.root), *argv], capture_output=True, text=True, timeout=timeout,
                              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "PIP_CERT": HOST_CA},
                              **kwargs)


def test_install_agent_sh_sets_up_an_agent_that_answers_status_on_arm64(wheel, tmp_path):
    if os.geteuid() != 0:
        unavailable("the arm64 install test needs root (debootstrap, chroot, mounts)", "HALO_REQUIRE_ARM64_INSTALL")
    try:
        root = arm64.debian_root()
    except ConfigError as e:
        unavailable(f"no arm64 Debian root here: {e}", "HALO_REQUIRE_ARM64_INSTALL")
    key = tmp_path / "cluster.key"
    subprocess.run([sys.executable, "-m", "halo.cli.master", "keygen", "--out", str(key)], check=True, capture_output=True)
    stage = root / "tmp" / "halo-install"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    for path in (wheel, key, Path(str(BUNDLED_MODEL)), *(RPI / name for name in ("install-agent.sh", "agent.example.toml",
                                                                                  "halo-agent.service"))):
        shutil.copy(path, stage)
    port = free_port()
    (root / "etc" / "halo" / "agent.toml").unlink(missing_ok=True)  # a fresh install's (the root is kept between runs)
    with Chroot(root) as chroot:
        out = chroot.run(["/bin/bash", "/tmp/halo-install/install-agent.sh", f"/tmp/halo-install/{wheel.name}",
                          "/tmp/halo-install/cluster.key", f"/tmp/halo-install/{Path(str(BUNDLED_MODEL)).name}"],
                         timeout=2400)
        assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
        assert "compact groups computed by halo._nbits" in out.stdout  # the C kernels, not numpy
        assert "systemd is not running here" in out.stdout
        assert (root / "etc" / "systemd" / "system" / "halo-agent.service").exists()
        config = tomllib.loads((root / "etc" / "halo" / "agent.toml").read_text())  # the model given, not the example's
        assert config["model"] == f"/opt/halo/models/{Path(str(BUNDLED_MODEL)).name}" and config["name"] == socket.gethostname()
        log = open(tmp_path / "agent.log", "w")  # a file, not a pipe nobody reads while the agent runs
        agent = subprocess.Popen(["chroot", "--userspec=halo:halo", str(root), "/usr/bin/env", "HOME=/tmp",
                                  "XDG_CACHE_HOME=/tmp/halo-cache", "/opt/halo/venv/bin/halo-agent", "--config",
                                  "/etc/halo/agent.toml", "--listen", f"tcp://127.0.0.1:{port}", "--threads", "1"],
                                 stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline, answer, status = time.monotonic() + 600, None, None
            while time.monotonic() < deadline and agent.poll() is None:
                status = subprocess.run([sys.executable, "-m", "halo.cli.master", "status", "--agents", f"127.0.0.1:{port}",
                                         "--key", str(key), "--json", "--timeout", "10"], capture_output=True,
                                        text=True, timeout=120)
                if status.returncode == 0:
                    answer = json.loads(status.stdout)
                    break
                if "protocol version" in status.stderr:  # an agent of another halo: waiting will not help
                    break
                time.sleep(5)
            assert answer is not None, (status and status.stderr[-1000:], (tmp_path / "agent.log").read_text()[-3000:])
        finally:
            agent.terminate()
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
            log.close()
    text = json.dumps(answer)
    assert "aarch64" in text and f'"{socket.gethostname()}"' in text, text[:2000]  # the installer names it after the host
