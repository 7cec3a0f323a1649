"""Replays recorded calls of halo's C kernels on whatever machine runs it, on every vector path that machine has,
and computes a fixed set of transport operations: what tests/test_arm64_kernels.py runs on x86 and, under qemu-user,
on emulated Cortex-A72 and A76 (rpi/arm64.py), to show that every path gives x86's bits.

    python kernel_probe.py CALLS.pkl OUT.pkl MODULE_DIR

Standalone on purpose: it imports numpy, pickle and the two extensions found in MODULE_DIR (an arm64 root has no
halo installed). CALLS.pkl: a list of recorded calls {function, args, kwargs, after} (tests/test_arm64_kernels.py
records them from halo's own decode steps and projections); `after` holds the bytes of every array argument after the
call on x86. OUT.pkl: {paths, calls: [{path: [bytes of every array argument after the call]}], datagrams: [...]}.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import pickle
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np

Header = namedtuple("Header", "kind dtype sender session epoch counter index count length")


def load(name: str, directory: Path):
    """The extension `name` from `directory` (any ABI-tagged file name), imported under its own name."""
    (path,) = [p for p in directory.iterdir() if p.name.startswith(name + ".") and p.suffix == ".so"]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def copied(value):
    """A fresh copy of a call's arguments (arrays copied; tuples and lists rebuilt)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (tuple, list)):
        return type(value)(copied(v) for v in value)
    return value


def arrays(value) -> list[np.ndarray]:
    """Every array in a call's arguments, depth first (what a kernel writes is among them)."""
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in arrays(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in arrays(v)]
    return []


def replay(nbits, call: dict) -> dict:
    """The call on every path this CPU runs (matmul takes a path; the decode steps use the best one)."""
    function = getattr(nbits, call["function"])
    paths = nbits.paths() if call["function"] == "matmul" else (None,)
    out = {}
    for path in paths:
        args, kwargs = copied(call["args"]), copied(call["kwargs"])
        if path is not None:
            kwargs["path"] = path
        function(*args, **kwargs)
        out[path or "best"] = [a.tobytes() for a in arrays([args, kwargs])]
    return out


def datagrams(module) -> list:
    """Keyed BLAKE2b tags, packed datagrams, parities and the receive checks on fixed inputs."""
    rng = np.random.default_rng(7)
    key = rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
    state = module.keyed(key)
    out = [state]
    for size in (1, 63, 64, 65, 127, 128, 129, 1000, 1400):
        out.append(module.tag(state, rng.integers(0, 256, size, dtype=np.uint8).tobytes()))
    payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (1392, 1392, 1392, 400)]
    packed = module.pack_many(state, 0, 0, 3, 12345, 2, 1000, len(payloads), payloads)
    out.append(packed)
    out.append(module.pack(state, 1, 1, 2, 12345, 2, 77, 0, 1, payloads[3]))
    for count in (1, 2):
        out.append(module.parities(payloads, count))
    forged = bytearray(packed[1])
    forged[40] ^= 1
    for datagram in (packed[0], bytes(forged), packed[2][:30], packed[3]):
        result = module.unpack(state, datagram, 12345, Header)
        out.append(result if isinstance(result, str) else (tuple(result[0]), bytes(result[1])))
    return out


def main(argv: list[str]) -> int:
    calls_path, out_path, directory = Path(argv[0]), Path(argv[1]), Path(argv[2])
    nbits, transport = load("_nbits", directory), load("_datagrams", directory)
    calls = pickle.loads(calls_path.read_bytes())
    result = {"paths": list(nbits.paths()), "calls": [replay(nbits, call) for call in calls],
              "datagrams": datagrams(transport)}
    out_path.write_bytes(pickle.dumps(result))
    print(f"{len(calls)} calls on {', '.join(result['paths'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
