"""halo's C extensions for a Raspberry Pi, built and run on this x86 machine: a cross build with Debian's
aarch64-linux-gnu-gcc and an arm64 Python run under qemu-user, so that the Pi's kernels are tested for the same
bits as x86's without a Pi.

    python -m halo.rpi.arm64 root                 # the arm64 Python (Debian's, with numpy) in the cache, ~100 MB
    python -m halo.rpi.arm64 build --cpu cortex-a76 --out DIR
    python -m halo.rpi.arm64 run --cpu cortex-a72 --modules DIR -- script.py ARGS...
    python -m halo.rpi.arm64 wheel --out DIR      # halo_edge-...-cp311-cp311-linux_aarch64.whl for the Pis
    python -m halo.rpi.arm64 debian               # an arm64 Debian bookworm (debootstrap) to install it into

Needs: the packages gcc-aarch64-linux-gnu and qemu-user-static (apt-get install), and Debian's arm64 package lists
(dpkg --add-architecture arm64 && apt-get update) for the root, which is made from packages, not debootstrap:
python3.11 and the libraries it loads, unpacked with dpkg-deb, plus numpy's aarch64 wheel from the package index.
CPUs: cortex-a72 (the Pi 4: NEON) and cortex-a76 (the Pi 5: NEON with SDOT), as gcc's -mcpu and qemu's -cpu.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from halo.errors import ConfigError

CPUS = ("cortex-a72", "cortex-a76")
GCC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64-static"
PYTHON = "python3.11"
# the interpreter, its standard library and what they load; the -dev package for Python.h and pyconfig.h
DEBS = ("python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "libpython3.11-dev", "libc6",
        "libgcc-s1", "libgomp1", "libstdc++6", "zlib1g", "libexpat1", "libffi8", "libbz2-1.0", "liblzma5",
        "libuuid1", "libssl3", "libcrypt1")
# the extensions and the flags pyproject.toml builds them with (-ffp-contract=off: every path rounds alike)
EXTENSIONS = {"_nbits": "halo/_nbits.c", "_datagrams": "transport/_datagrams.c"}
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-Wall")
SOURCE_ROOT = Path(__file__).resolve().parents[1]


# a Pi's Raspberry Pi OS is Debian bookworm: what install-agent.sh's apt-get would install is included up front
DEBIAN_SUITE, DEBIAN_MIRROR = "bookworm", "http://deb.debian.org/debian"
DEBIAN_PACKAGES = ("python3", "python3-venv", "python3-dev", "gcc", "libc6-dev", "passwd", "ca-certificates")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "halo"


def default_root() -> Path:
    return cache_dir() / "arm64-root"


def missing_tools() -> list[str]:
    """The Debian packages whose commands are not on PATH."""
    return [package for command, package in ((GCC, "gcc-aarch64-linux-gnu"), (QEMU, "qemu-user-static"))
            if shutil.which(command) is None]


def _run(argv: list[str], what: str, cwd: Path | None = None, timeout_s: float = 600) -> str:
    try:
        out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"{what}: {e}") from None
    if out.returncode != 0:
        raise ConfigError(f"{what} failed ({' '.join(argv[:3])} ...): {(out.stderr or out.stdout).strip()[-800:]}")
    return out.stdout


def make_root(root: Path | None = None) -> Path:
    """The arm64 root (cached: made once): Debian's python3.11 for arm64 and numpy's aarch64 wheel in root/site."""
    root = root or default_root()
    if (root / "ready").exists():
        return root
    if missing := missing_tools():
        raise ConfigError(f"missing {', '.join(missing)}: apt-get install {' '.join(missing)}")
    debs, site = root / "debs", root / "site"
    for path in (debs, site):
        path.mkdir(parents=True, exist_ok=True)
    _run(["apt-get", "download", *(f"{name}:arm64" for name in DEBS)], "downloading Debian's arm64 Python "
         "(needs: dpkg --add-architecture arm64 && apt-get update)", cwd=debs)
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(root)], f"unpacking {deb.name}")
    wheels = root / "wheels"
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--platform",
          "manylinux_2_28_aarch64", "--platform", "manylinux2014_aarch64", "--python-version", "3.11",
          "--implementation", "cp", "--abi", "cp311", "numpy", "-d", str(wheels)], "downloading numpy for aarch64")
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    (root / "ready").write_text("\n".join(DEBS) + "\n")
    return root


def binfmt_ready() -> str | None:
    """None where the kernel runs aarch64 programs through qemu (binfmt_misc), else why not. A chroot into an arm64
    Debian needs it: every program there is aarch64."""
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not entry.exists() and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True, timeout=60)
    if not entry.exists():
        return ("no binfmt_misc handler for aarch64 (apt-get install qemu-user-static binfmt-support; in a container, "
                "mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc first)")
    if not entry.read_text().startswith("enabled"):
        return "the binfmt_misc handler qemu-aarch64 is disabled (update-binfmts --enable qemu-aarch64)"
    return None


def unmount_under(root: Path) -> None:
    """Every mount at or below `root`, deepest first (lazily: a process still inside does not stop it)."""
    root = str(Path(root).resolve())
    with open("/proc/self/mounts") as mounts:
        targets = [line.split()[1].encode().decode("unicode_escape") for line in mounts]
    for target in sorted((t for t in targets if t == root or t.startswith(root + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)


def debian_root(root: Path | None = None) -> Path:
    """An arm64 Debian bookworm (debootstrap, minbase plus Python and gcc; cached: made once, ~10 minutes under
    emulation), for installing the agent as on a Pi."""
    root = root or cache_dir() / "arm64-debian"
    if (root / "halo-ready").exists():
        return root
    if shutil.which("debootstrap") is None:
        raise ConfigError("missing debootstrap: apt-get install debootstrap")
    if why := binfmt_ready():
        raise ConfigError(why)
    if root.exists():  # a half-made root from an interrupted run: what it left mounted first, then the files
        unmount_under(root)
        shutil.rmtree(root)
    try:
        _run(["debootstrap", "--arch=arm64", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}",
              DEBIAN_SUITE, str(root), DEBIAN_MIRROR], "debootstrap of an arm64 Debian", timeout_s=3600)
    finally:
        unmount_under(root)  # debootstrap mounts /proc and /sys inside; killed, it leaves them
    (root / "halo-ready").write_text(f"{DEBIAN_SUITE} {' '.join(DEBIAN_PACKAGES)}\n")
    return root


def build(cpu: str, out: Path, root: Path | None = None) -> dict[str, Path]:
    """halo's extensions cross-compiled for `cpu` into `out` (module name -> shared object)."""
    if cpu not in CPUS:
        raise ConfigError(f"unknown CPU {cpu!r}: choose {' or '.join(CPUS)}")
    root = make_root(root)
    out.mkdir(parents=True, exist_ok=True)
    built = {}
    for name, source in EXTENSIONS.items():
        if not (SOURCE_ROOT / source).exists():
            raise ConfigError(f"{SOURCE_ROOT / source} is missing: cross builds run from a source checkout")
        target = out / f"{name}.cpython-311-aarch64-linux-gnu.so"
        _run([GCC, *CFLAGS, f"-mcpu={cpu}", f"-I{root}/usr/include/python3.11", f"-I{root}/usr/include",
              str(SOURCE_ROOT / source), "-o", str(target)], f"cross-compiling {source} for {cpu}")
        built[name] = target
    return built


def wheel(out: Path, root: Path | None = None) -> Path:
    """The aarch64 wheel (what rpi/install-agent.sh installs on a Pi), cross-built: setuptools reads the arm64
    Python's build configuration (its compiler, aarch64-linux-gnu-gcc, and its extension suffix) and tags the wheel
    linux_aarch64. Built from a copy of the source tree without this machine's compiled extensions, as the agent wheel
    (setup.py: HALO_WHEEL=agent, no benchmarks and no browser-worker page)."""
    import tempfile

    root = make_root(root)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="halo-arm64-wheel-") as tmp:
        source, config = Path(tmp) / "src", Path(tmp) / "sysconfig"
        shutil.copytree(SOURCE_ROOT, source, ignore=shutil.ignore_patterns(
            "*.so", "build", "*.egg-info", ".git", "node_modules", "__pycache__", ".pytest_cache"))
        config.mkdir()
        name = "_sysconfigdata__aarch64-linux-gnu"
        shutil.copy(root / "usr" / "lib" / "python3.11" / f"{name}.py", config)
        env = {**os.environ, "HALO_WHEEL": "agent", "_PYTHON_SYSCONFIGDATA_NAME": name, "_PYTHON_HOST_PLATFORM": "linux-aarch64",
               "PYTHONPATH": str(config), "CFLAGS": f"-I{root}/usr/include/python3.11 -I{root}/usr/include"}
        before = set(out.glob("*.whl"))
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                                   "-w", str(out), str(source)], capture_output=True, text=True, timeout=900, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ConfigError(f"building the aarch64 wheel: {e}") from None
        if done.returncode != 0:
            raise ConfigError(f"building the aarch64 wheel failed: {done.stderr.strip()[-1500:]}")
    built = sorted(set(out.glob("*linux_aarch64.whl")) - before) or sorted(out.glob("*linux_aarch64.whl"))
    if not built:
        raise ConfigError(f"pip made no linux_aarch64 wheel in {out}")
    return built[-1]


def run(cpu: str, modules: Path, argv: list[str], root: Path | None = None, timeout_s: float = 1800) -> str:
    """A Python script on emulated `cpu` (qemu-user), with numpy and `modules` (a build's output) importable;
    its standard output."""
    root = make_root(root)
    env = {**os.environ, "PYTHONPATH": f"{root / 'site'}:{modules}", "PYTHONHOME": str(root / "usr"),
           "OMP_NUM_THREADS": "2"}
    try:
        out = subprocess.run([QEMU, "-L", str(root), "-cpu", cpu, str(root / "usr" / "bin" / PYTHON), *argv],
                             capture_output=True, text=True, timeout=timeout_s, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"running {argv[:1]} on emulated {cpu}: {e}") from None
    if out.returncode != 0:
        raise ConfigError(f"{argv[:1]} on emulated {cpu} failed: {out.stderr.strip()[-2000:]}")
    return out.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None, help=f"the arm64 root (default {default_root()})")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("root", help="make the arm64 root (Debian's python3.11 and numpy)")
    sub.add_parser("debian", help="make the arm64 Debian (debootstrap) that install tests install into")
    b = sub.add_parser("build", help="cross-compile halo's extensions")
    b.add_argument("--cpu", choices=CPUS, required=True)
    b.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run", help="run a script under qemu-user with a build's extensions importable")
    r.add_argument("--cpu", choices=CPUS, required=True)
    r.add_argument("--modules", type=Path, required=True, help="a build's --out")
    r.add_argument("script", nargs=argparse.REMAINDER)
    w = sub.add_parser("wheel", help="cross-build the aarch64 wheel")
    w.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "root":
            print(make_root(args.root))
        elif args.command == "debian":
            print(debian_root())
        elif args.command == "build":
            for name, path in build(args.cpu, args.out, args.root).items():
                print(f"{name}: {path}")
        elif args.command == "wheel":
            print(wheel(args.out, args.root))
        else:
            script = args.script[1:] if args.script[:1] == ["--"] else args.script
            sys.stdout.write(run(args.cpu, args.modules, script, args.root))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
