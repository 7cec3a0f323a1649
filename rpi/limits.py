"""Memory and storage limits of an emulated device (cgroup v1): a Pi's RAM and its SD card's read rate on one machine.

    with DeviceLimits("agent-1", memory_bytes=600 << 20, read_bps=40e6, model=path) as limits:
        p = subprocess.Popen(argv, preexec_fn=limits.join)   # the process (and what it starts) runs inside
        limits.usage()   # peak memory, limit hits, major faults, bytes read from the disk

memory.limit_in_bytes caps anonymous memory and page cache together, as a device's RAM does: reclaim evicts
clean file pages first (read again on use: a major fault), and a process whose own memory alone passes the
limit is killed by the cgroup's OOM killer. blkio.throttle.read_bps_device caps reads from the block device
that holds the model file; only reads that miss the page cache reach it, so `drop_cached(path)` first evicts
the file's cached pages (a copy just written is otherwise read from memory, however slow the "card").
Needs root and the cgroup-v1 memory (and blkio) controllers; `available()` says why not.
"""

from __future__ import annotations

import os
from pathlib import Path

MEMORY = Path("/sys/fs/cgroup/memory")
BLKIO = Path("/sys/fs/cgroup/blkio")


def available(storage: bool = False) -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "cgroups need root"
    for root in (MEMORY, BLKIO) if storage else (MEMORY,):
        if not (root / "cgroup.procs").exists():
            return False, f"no cgroup-v1 controller at {root}"
    return True, ""


def drop_cached(path: str | os.PathLike) -> None:
    """Evict a file's clean pages from the page cache (so the next reads go to the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_into_cache(path: str | os.PathLike) -> None:
    """Read a whole file once, so that its pages are in the page cache (charged to the caller's cgroup, not to a
    limited device's: the "fast storage" case, whatever ran before)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass


class DeviceLimits:
    def __init__(self, name: str, memory_bytes: int | None = None, read_bps: float | None = None,
                 model: str | os.PathLike | None = None):
        """memory_bytes None: no memory limit (usage is still measured); read_bps: reads per second from the
        block device holding `model`."""
        if read_bps is not None and model is None:
            raise ValueError("a read-rate limit needs the model file (its block device is throttled)")
        self.memory_bytes, self.read_bps = memory_bytes, read_bps
        self.memory = MEMORY / f"halo-{name}"
        self.blkio = BLKIO / f"halo-{name}" if read_bps is not None else None
        self.device = None
        if model is not None:
            st = os.stat(model)
            self.device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"

    def __enter__(self) -> "DeviceLimits":
        self.memory.mkdir(exist_ok=True)  # (a group left by a killed run is reused: every setting is written)
        (self.memory / "memory.limit_in_bytes").write_text(str(int(self.memory_bytes)) if self.memory_bytes else "-1")
        (self.memory / "memory.max_usage_in_bytes").write_text("0")
        (self.memory / "memory.failcnt").write_text("0")
        if self.blkio is not None:
            self.blkio.mkdir(exist_ok=True)
            (self.blkio / "blkio.throttle.read_bps_device").write_text(f"{self.device} {int(self.read_bps)}")
        return self

    def join(self) -> None:
        """Put the calling process in the groups (a Popen preexec_fn: the child, before it runs the program)."""
        pid = str(os.getpid())
        (self.memory / "cgroup.procs").write_text(pid)
        if self.blkio is not None:
            (self.blkio / "cgroup.procs").write_text(pid)

    def usage(self) -> dict:
        """Memory now and at its peak (page cache included) and whether the limit was reached, the process memory and page cache
        now, major faults, and bytes read from the model's disk."""
        stat = dict(line.split() for line in (self.memory / "memory.stat").read_text().splitlines())
        out = {"limit_bytes": self.memory_bytes, "usage_bytes": int((self.memory / "memory.usage_in_bytes").read_text()),
               "max_usage_bytes": int((self.memory / "memory.max_usage_in_bytes").read_text()),
               "limit_hits": int((self.memory / "memory.failcnt").read_text()),
               "rss_bytes": int(stat["rss"]), "cache_bytes": int(stat["cache"]), "major_faults": int(stat["pgmajfault"]),
               "oom_kills": int(dict(line.split() for line in (self.memory / "memory.oom_control").read_text()
                                     .splitlines()).get("oom_kill", 0))}
        if self.blkio is not None:
            out["read_bytes"] = sum(int(line.split()[2]) for line in
                                    (self.blkio / "blkio.throttle.io_service_bytes").read_text().splitlines()
                                    if line.startswith(self.device + " Read"))
        return out

    def __exit__(self, *exc) -> None:
        for group in (self.memory, self.blkio):
            if group is None:
                continue
            try:
                for pid in (group / "cgroup.procs").read_text().split():  # stragglers back to the root group
                    (group.parent / "cgroup.procs").write_text(pid)
                group.rmdir()
            except OSError:
                pass
