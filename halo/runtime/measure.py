"""What the scheduler plans from, measured on the device itself: kernel speed, message cost, memory.

Every device runs this (an agent when the master asks for its profile, the master on itself), in the
weight format and group sizes of the session, so the figures are those of the kernels it will run:

- kernels: attention heads, MLP groups and LM-head vocabulary groups, each at two sizes (held in every
  layer, the layers called in turn, one token per call: the weights stream as in a run), every point timed for `POINT_S` (the median of three batch means: a CPU quota
  or a throttling device shows up as the speed it really delivers over many calls, a preempted batch
  is ignored). A least-squares fit of
  time = overhead[kind] + FLOPs / compute gives `overhead_s` per kind of block (what a block costs
  whatever its size: Python, dispatch, the attention over the cache) and `compute_flops` (the device's
  speed on halo's matrix-vector work).
- message: the CPU time to take in one block input and send one partial over UDP (two endpoints on
  loopback: framing, tags, system calls), `message_s`.
- memory: what is available now (psutil; inside a cgroup with a memory limit, that limit).

About 0.5 s in all, cached for a day per model, format, group sizes, threads, device name and CPU quota
in `device_cache_dir()` (halo's cache, devices/: nothing else lives there) so a later session does not pay
again; a changed quota or halo version measures anew, and entries older than a day are removed when a
new one is written (`prune_cache`: only this module's device-*.json files, see halo/host/cache.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from pathlib import Path

import numpy as np

from halo.arguments import check_number
from halo.errors import ConfigError
from halo.host.cache import device_cache_dir, remove_files

log = logging.getLogger("halo.measure")
POINT_S = 0.06  # timing per (kind, size) point
MAX_SHARD_BYTES = 256e6  # a point's groups over all layers stay below this (big models: a few groups)
KERNEL_KINDS = ("attention", "mlp", "lm_head")
BENCHMARK_VERSION = 6  # part of the cache key: a changed benchmark measures anew
CACHE_MAX_AGE_S = 24 * 3600  # a day-old measurement is taken again (load, thermals and software change)
DEVICE_FILES = "device-*.json"


def prune_cache() -> int:
    """Remove device benchmarks older than CACHE_MAX_AGE_S (they would be measured anew anyway): only
    files named device-*.json directly in `device_cache_dir()`, whatever else shares it."""
    return remove_files(device_cache_dir(), DEVICE_FILES, older_than_s=CACHE_MAX_AGE_S)


def cpu_limit() -> float | None:
    """This process's CPU quota in cores (cgroup v1 or v2), None when unlimited or unknown."""
    from halo.host.memory import cgroups

    for controllers, path in cgroups():
        if "cpu" in controllers:
            base = Path("/sys/fs/cgroup/cpu") / path.lstrip("/")
            try:
                quota, period = (int((base / f).read_text()) for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
            except (OSError, ValueError):
                return None
            return quota / period if quota > 0 else None
        if controllers == [""]:
            try:
                quota, period = (Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.max").read_text().split()
            except (OSError, ValueError):
                continue
            return None if quota == "max" else int(quota) / int(period)
    return None


MEMORY_SHARE = 0.9  # of the memory available at start: the default budget (the rest: the process, buffers, the OS)


def default_memory_budget() -> int:
    """What a device's weights and KV caches may take unless told (halo-agent --memory-budget): MEMORY_SHARE of the
    memory available now. An agent refuses a share beyond it; in HALO mode the master and the agents keep their
    re-mappable MLP groups within it (halo/compute/remap.py: as kernels where they all fit, compact where not)."""
    return int(MEMORY_SHARE * memory_available())


def memory_available() -> int:
    """Bytes this process could still use: free memory, or what its cgroup's memory limit leaves (the cgroup this
    process is in, v1 or v2: a device's agent under a systemd MemoryMax or a test bed's limit)."""
    import psutil

    from halo.host.memory import memory_limit

    available = psutil.virtual_memory().available
    limit = memory_limit()
    if limit is not None and limit[0] - limit[1] < available:
        available = limit[0] - limit[1]
    return max(int(available), 0)


def _time_calls(call, seconds: float, batches: int = 3) -> float:
    """Seconds per call: the median over `batches` batches of the mean per call over seconds / batches
    each (two warm-up calls first). A batch mean sees a CPU quota's stalls; the median ignores a batch
    that another process preempted."""
    call(0)
    call(1)
    means, i = [], 2
    for _ in range(batches):
        n, start = 0, time.perf_counter()
        while True:
            call(i)
            n, i = n + 1, i + 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / batches and n >= 2:
                break
        means.append(elapsed / n)
    return float(np.median(means))


def _points(count: int, group_bytes: float, n_layers: int) -> tuple[tuple[int, ...], int]:
    """(group counts to time, layers to hold them in): one group and half the groups (at least two; no more
    than MAX_SHARD_BYTES hold), in as many layers as keep the larger point within MAX_SHARD_BYTES."""
    big = int(min(max(count // 2, 2), count, max(2, MAX_SHARD_BYTES // max(group_bytes, 1.0))))
    layers = int(min(n_layers, max(1, MAX_SHARD_BYTES // max(group_bytes * big, 1.0))))
    return tuple(sorted({1, big})), layers


def kernel_samples(weights, layout, fmt: str, threads: int = 1, seconds: float = POINT_S) -> list[dict]:
    """(kind, groups, FLOPs, seconds per call) at two sizes per kind. A point holds its groups in every layer
    (a big model: as many as MAX_SHARD_BYTES allows) and calls the layers in turn, as a token does: the
    weights stream through the caches as in a run (one layer's share alone would stay cache-hot and look
    several times faster than it is)."""
    from halo.compute.shares import Block, Shares
    from halo.compute.worker import DeviceWorker

    from halo.compute.shares import planning_format
    from halo.scheduler.profiles import model_profile

    c = weights.config
    profile = model_profile(c, planning_format(fmt, weights), mlp_group_size=layout.mlp_group_size,
                            vocab_group_size=layout.vocab_group_size)
    counts = {"attention": layout.n_heads, "mlp": layout.n_mlp_groups, "lm_head": layout.n_vocab_groups}
    x = np.random.default_rng(0).standard_normal((1, c.dim)).astype(np.float32)
    context = min(64, c.max_seq_len)
    samples = []
    for kind in KERNEL_KINDS:
        block = getattr(profile, kind)
        sizes, layers = _points(counts[kind], block.bytes, 1 if kind == "lm_head" else c.n_layers)
        for size in sizes:
            groups = list(range(size))
            every = [groups if l < layers else [] for l in range(c.n_layers)]
            nothing = [[] for _ in range(c.n_layers)]
            share = Shares(attention=every if kind == "attention" else nothing, mlp=every if kind == "mlp" else nothing,
                           lm_head=groups if kind == "lm_head" else [])
            worker = DeviceWorker(weights, layout, share, context, fmt, threads)
            blocks = [Block(kind, c.n_layers if kind == "lm_head" else l) for l in range(layers)]
            seconds_per_call = _time_calls(lambda i: worker.compute(blocks[i % layers], x, (i // layers) % context),
                                           seconds)
            samples.append({"kind": kind, "groups": size, "flops": block.flops * size, "seconds": seconds_per_call})
            worker.close()
    return samples


def fit_kernels(samples: list[dict]) -> tuple[tuple[float, float, float], float]:
    """(overhead per kind: attention, MLP, LM head; compute_flops) of time = overhead[kind] + FLOPs / compute,
    least squares. Where noise leaves no positive slope (tiny models: all overhead), the speed is the best
    any point showed (a lower bound: as if its whole time were compute) and the overheads what is left."""
    kinds = [KERNEL_KINDS.index(s["kind"]) for s in samples]
    flops = np.array([s["flops"] for s in samples], dtype=float)
    seconds = np.array([s["seconds"] for s in samples], dtype=float)
    design = np.zeros((len(samples), len(KERNEL_KINDS) + 1))
    design[np.arange(len(samples)), kinds] = 1.0
    design[:, -1] = flops
    solution, *_ = np.linalg.lstsq(design, seconds, rcond=None)
    per_flop = float(solution[-1]) if solution[-1] > 0 else float(np.min(seconds / flops))
    overheads = []
    for k in range(len(KERNEL_KINDS)):
        rest = [t - f * per_flop for t, f, kind in zip(seconds, flops, kinds) if kind == k]
        overheads.append(max(float(np.mean(rest)), 0.0) if rest else 0.0)
    return tuple(overheads), 1.0 / per_flop


def message_seconds(dim: int, seconds: float = POINT_S) -> float:
    """CPU time to receive one block input and send one partial of `dim` floats over UDP (loopback)."""
    from halo.sync.framing import PREFIX
    from halo.transport import wire
    from halo.transport.udp import GatherPolicy, UdpEndpoint

    key = bytes(wire.KEY_BYTES)
    a, b = UdpEndpoint(key, 1, 1), UdpEndpoint(key, 1, 2)
    values = np.zeros(PREFIX + dim, dtype=np.float32)
    policy = GatherPolicy(deadline_s=0.05)
    try:
        def one(epoch: int) -> None:
            a.send_vector({2: b.address}, epoch + 1, values, parity_group=8, parity_chunks=2)
            b.gather(epoch + 1, {1: len(values)}, wire.FLOAT32, policy)

        return _time_calls(one, seconds)  # both ends' CPU: one vector sent and one received
    finally:
        a.close()
        b.close()


def measure_device(weights, layout, fmt: str, threads: int = 1, name: str = "", fresh: bool = False) -> dict:
    """This device's kernels, message cost and available memory (kernels and message cost cached)."""
    from halo import __version__
    from halo.model.loader import model_fingerprint

    limit = cpu_limit()
    key = (f"device-{model_fingerprint(weights.source)[:16]}-{fmt}-m{layout.mlp_group_size}-v{layout.vocab_group_size}"
           f"-t{threads}-{''.join(ch for ch in name if ch.isalnum()) or 'x'}-cpu{limit or 0:.3f}-{__version__}"
           f"-b{BENCHMARK_VERSION}")
    path = device_cache_dir() / f"{key}.json"
    measured = None
    if not fresh:
        try:
            if time.time() - path.stat().st_mtime < CACHE_MAX_AGE_S:
                measured = json.loads(path.read_text())
        except (OSError, ValueError):
            measured = None
        if measured is not None and not usable_benchmark(measured, fmt, threads):
            log.warning("the cached device benchmark %s is damaged: measuring again", path)
            measured = None
    if measured is None:
        t = time.perf_counter()
        samples = kernel_samples(weights, layout, fmt, threads)
        overhead, compute = fit_kernels(samples)
        measured = {"compute_flops": compute, "overhead_s": overhead,
                    "message_s": message_seconds(weights.config.dim), "samples": samples, "cpu_limit": limit,
                    "benchmark_s": time.perf_counter() - t, "format": fmt, "threads": threads}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # whole or not at all (two agents at once)
            partial.write_text(json.dumps(measured))
            os.replace(partial, path)
            prune_cache()
        except OSError as e:
            log.warning("could not cache the device benchmark at %s: %s", path, e)
    return {**measured, "memory_available_bytes": memory_available()}


def usable_benchmark(measured, fmt: str, threads: int) -> bool:
    """A cached benchmark as measure_device writes it: a damaged one ({}, a list, a NaN, a string) failed every
    run for a day (a KeyError, or a master blaming an agent for the master's own file)."""
    def number(value, positive: bool = False) -> bool:
        try:
            check_number(value, "", 0, low_open=positive)
            return True
        except ConfigError:
            return False

    if not isinstance(measured, dict):
        return False
    overhead = measured.get("overhead_s")
    return (number(measured.get("compute_flops"), positive=True) and number(measured.get("message_s"))
            and isinstance(overhead, list) and len(overhead) == len(KERNEL_KINDS) and all(map(number, overhead))
            and measured.get("format") == fmt and measured.get("threads") == threads
            and (measured.get("cpu_limit") is None or number(measured["cpu_limit"], positive=True)))


class MedianWindow:
    """The median of the last `size` observations: a running estimate that ignores outliers."""

    def __init__(self, size: int = 15):
        self.values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self.values.append(float(value))

    def median(self) -> float | None:
        return float(np.median(self.values)) if self.values else None
