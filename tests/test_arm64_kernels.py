"""The Raspberry Pi's kernels give x86's bits: halo's C extensions cross-built for Cortex-A72 (the Pi 4: NEON) and
Cortex-A76 (the Pi 5: NEON with SDOT) and run under qemu-user (rpi/arm64.py) replay the calls x86 made in decode
steps, prefill, shards and projections of every kernel block type (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, int8), on every
path each CPU has, and must write the same bytes; the transport's tags, datagrams and parities must be the same
bytes too (rpi/kernel_probe.py).

Needs gcc-aarch64-linux-gnu, qemu-user-static and Debian's arm64 package lists (.ci/run installs them); where they
are missing the test skips and says which, unless HALO_REQUIRE_ARM64=1 (CI) makes that a failure."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from halo.compute import linear
from halo.compute.neuron_groups import GroupLayout
from halo.compute.shares import Block, shares_from_plan
from halo.compute.transformer import Transformer
from halo.compute.worker import DeviceWorker
from halo.errors import ConfigError
from halo.model.loader import load_weights
from halo.model.quant import KERNEL_CODECS, QuantizedMatrix
from halo.rpi import arm64
from halo.rpi.kernel_probe import arrays, copied
from halo.scheduler.even import even_plan

from gguf_models import tiny_gguf

PROBE = Path(arm64.__file__).with_name("kernel_probe.py")
RECORDED = ("matmul", "attention_step", "mlp_step")


def unavailable(reason: str):
    if os.environ.get("HALO_REQUIRE_ARM64") == "1":
        pytest.fail(f"HALO_REQUIRE_ARM64=1 but {reason}")
    pytest.skip(reason)


def recording(monkeypatch) -> list[dict]:
    """Every call halo makes into halo._nbits from here on: its arguments before, every array argument after."""
    calls: list[dict] = []
    for name in RECORDED:
        real = getattr(linear._nbits, name)

        def record(*args, _real=real, _name=name, **kwargs):
            before = {"function": _name, "args": copied(args), "kwargs": copied(kwargs)}
            _real(*args, **kwargs)
            calls.append({**before, "after": [a.tobytes() for a in arrays([args, kwargs])]})

        monkeypatch.setattr(linear._nbits, name, record)
    return calls


def random_k_blocks(qtype: str, rows: int, k: int, seed: int) -> QuantizedMatrix:
    """K-quant super-blocks of random bytes with sane float16 scales."""
    codec = KERNEL_CODECS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, k // 256, codec.type_size), dtype=np.uint8)
    for at in ((0, 2) if qtype == "Q4_K" else (208,)):
        blocks[..., at:at + 2] = (rng.random((rows, k // 256, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return QuantizedMatrix(codec, blocks, name="k.weight")


def run_models(tmp: Path) -> None:
    """Decode steps, a short (stepwise) pass, prefill and 3-way shards of tiny GGUF models in each block type."""
    rng = np.random.default_rng(0)
    for qtype in ("Q4_0", "Q4_1", "Q8_0"):
        weights = load_weights(tiny_gguf(tmp / f"tiny-{qtype}.gguf", qtype, seed=1))
        for fmt in ("native", "int8") if qtype == "Q4_0" else ("native",):
            model = Transformer(weights, fmt, max_seq_len=64)
            model.forward([1, 5, 9, 12, 3, 40, 41, 42, 43, 44, 45, 46])  # prefill (the C steps take any pass's length)
            model.forward([7])
            model.forward([8, 9, 10])  # a verification pass: each position a decode step's bits
            layout = GroupLayout.for_model(weights.config)
            x = rng.standard_normal((1, weights.config.dim)).astype(np.float32)
            for share in shares_from_plan(even_plan(weights, layout, 3), weights.config.n_layers):
                worker = DeviceWorker(weights, layout, share, 64, fmt)
                for l in worker.attention:
                    worker.compute(Block("attention", l), x, 0)
                for l in worker.mlp:
                    worker.compute(Block("mlp", l), x, 0)
                if share.lm_head:
                    worker.compute(Block("lm_head", weights.config.n_layers), x, 0)


def run_projections() -> None:
    """Wide projections of every kernel block type (several tiles, rows past a tile's 16, two threads), tokens 1 and
    3, and row and column shards of the K-quants."""
    rng = np.random.default_rng(1)
    import gguf.quants

    for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"):
        if qtype in ("Q4_K", "Q6_K"):
            m = random_k_blocks(qtype, 40, 512, seed=2)
        else:
            w = rng.standard_normal((300, 512)).astype(np.float32)
            codec = KERNEL_CODECS[qtype]
            data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
            m = QuantizedMatrix(codec, data.reshape(300, -1, codec.type_size), name="w.weight")
        parts = [m, m.take_rows(list(range(3, 40, 2)))]
        unit = m.codec.unit
        parts.append(m.take_cols(np.r_[unit:3 * unit]))
        for part in parts:
            for tokens in (1, 3):
                x = rng.standard_normal((tokens, part.shape[1])).astype(np.float32)
                for threads in (1, 2):
                    linear.make_projection([part], "native", threads=threads)(x)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    if linear._nbits is None:
        pytest.skip("halo._nbits is not built here: nothing to compare with")
    tmp = tmp_path_factory.mktemp("arm64")
    monkeypatch = pytest.MonkeyPatch()
    try:
        calls = recording(monkeypatch)
        run_models(tmp)
        run_projections()
    finally:
        monkeypatch.undo()
    assert {c["function"] for c in calls} == set(RECORDED) and len(calls) > 100
    (tmp / "calls.pkl").write_bytes(pickle.dumps(calls))
    return tmp, calls


def probe(tmp: Path, name: str, run) -> dict:
    out = tmp / f"{name}.pkl"
    run([str(PROBE), str(tmp / "calls.pkl"), str(out)])
    return pickle.loads(out.read_bytes())


def x86_result(tmp: Path) -> dict:
    """The probe on this machine, with the installed extensions (every x86 path this CPU has)."""
    from halo.transport import wire

    modules = tmp / "x86"
    modules.mkdir(exist_ok=True)
    for module in (linear._nbits, wire._datagrams):
        link = modules / Path(module.__file__).name
        if not link.exists():
            link.symlink_to(module.__file__)
    return probe(tmp, "x86", lambda argv: subprocess.run([sys.executable, *argv, str(modules)], check=True,
                                                           capture_output=True, timeout=600))


def assert_same_bits(result: dict, calls: list[dict], where: str) -> None:
    for i, (call, got) in enumerate(zip(calls, result["calls"])):
        for path, arrays in got.items():
            assert arrays == call["after"], f"{where}: call {i} ({call['function']}) differs on path {path}"


def test_every_x86_path_gives_the_recorded_bits(recorded):
    tmp, calls = recorded
    result = x86_result(tmp)
    assert len(result["calls"]) == len(calls)
    assert_same_bits(result, calls, "x86")


@pytest.mark.parametrize("cpu, paths", [("cortex-a72", ["scalar", "neon"]),
                                        ("cortex-a76", ["scalar", "neon", "neon_dotprod"])])
def test_the_pis_kernels_give_x86s_bits_under_emulation(recorded, cpu, paths):
    tmp, calls = recorded
    if missing := arm64.missing_tools():
        unavailable(f"no cross toolchain or emulator: apt-get install {' '.join(missing)}")
    try:
        arm64.make_root()
    except ConfigError as e:
        unavailable(f"no arm64 Python here: {e}")
    modules = tmp / cpu
    arm64.build(cpu, modules)  # a compile error in the Arm code fails the test
    result = probe(tmp, cpu, lambda argv: arm64.run(cpu, modules, [*argv, str(modules)]))
    assert result["paths"] == paths  # picked at load: SDOT where the CPU has it
    assert len(result["calls"]) == len(calls)
    assert_same_bits(result, calls, cpu)
    assert result["datagrams"] == x86_result(tmp)["datagrams"]
