"""Process memory: peak RSS, dropping pages of memory-mapped weights once converted, and the cgroup's limit.

A checkpoint is memory-mapped; converting it to int8 touches every float32 page, and touched pages
of a mapping count in this process's RSS until released. `release_pages` hands them back (the
file stays in the kernel's page cache and re-reads transparently), so converting a model never
holds its float32 copy and its int8 copy at once. Under a cgroup memory limit (a systemd MemoryMax, the
test bed's per-device limit) `memory_limit` and `memory_headroom` say what the process may still take.
"""

from __future__ import annotations

import ctypes
import mmap
import resource
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE


def _mapping_of(array: np.ndarray):
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "_mmap", None) or base.base
    return base


def _advise(array: np.ndarray, advice: int, whole_pages_only: bool) -> bool:
    """madvise the pages a memory-mapped array spans; False for ordinary arrays (nothing to do)."""
    mapping = _mapping_of(array)
    if mapping is None or not hasattr(mapping, "madvise") or array.size == 0:
        return False
    start_address = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    begin = array.ctypes.data - start_address
    span = array.strides[0] * (array.shape[0] - 1) + array.strides[-1] * array.shape[-1] if array.ndim else array.nbytes
    if whole_pages_only:
        first, last = -(-begin // PAGE) * PAGE, (begin + span) // PAGE * PAGE
    else:
        first, last = begin // PAGE * PAGE, min(len(mapping), -(-(begin + span) // PAGE) * PAGE)
    if last > first:
        mapping.madvise(advice, first, last - first)
    return True


def release_pages(array: np.ndarray) -> None:
    """madvise(DONTNEED) the whole pages that a memory-mapped array spans; no-op for ordinary arrays."""
    _advise(array, mmap.MADV_DONTNEED, whole_pages_only=True)


def release_mapping(array: np.ndarray) -> None:
    """madvise(DONTNEED) the whole file mapping a memory-mapped array belongs to. Reading one tensor makes the
    kernel map its neighbours too (fault-around, readahead); releasing only the tensor's span leaves those."""
    mapping = _mapping_of(array)
    if mapping is not None and hasattr(mapping, "madvise") and len(mapping):
        mapping.madvise(mmap.MADV_DONTNEED, 0, len(mapping) // PAGE * PAGE)


def load_pages(array: np.ndarray) -> int:
    """madvise(WILLNEED) the pages a memory-mapped array spans: the kernel starts reading them from the
    file now (asynchronously), so a later computation finds them in memory. Returns the bytes covered."""
    return array.nbytes if _advise(array, mmap.MADV_WILLNEED, whole_pages_only=False) else 0


def release_freed_heap() -> None:
    """Return freed heap memory to the OS (glibc keeps large freed blocks otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


def own_pages(nbytes: int) -> np.ndarray:
    """A zeroed uint8 buffer in a private anonymous mapping of its own (its pages populated at once: the caller fills
    all of them), unmapped when the last array viewing it goes. Buffers of ~1 MB freed to the heap stay in the
    allocator (glibc raises its mmap threshold after the first such free, and each thread has its own arena), so a
    cache that keeps evicting groups and reading others in grew the process past its budget; these leave nothing
    behind."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, max(1, nbytes), flags=flags), dtype=np.uint8)[:nbytes]


def zeros_by_page(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array of zeros whose memory becomes resident 4 kB page by page as it is written: a private anonymous
    mapping with transparent huge pages declined. A KV cache: with huge pages ("always", as on this project's hosts)
    the first position written into each layer's cache of a slot made 2 MB resident, so 16 slots of SmolLM2 at 2,048
    positions held 1.5 GB after one token each."""
    count = int(np.prod(shape))
    mapping = mmap.mmap(-1, max(1, 4 * count), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mapping, dtype=np.float32, count=count).reshape(shape)


HUGE_PAGE = 2 << 20
FIRST_CHUNK, ARENA_CHUNK = 8 << 20, 64 << 20


class _WeightArena:
    """Consecutive kernels' weights in consecutive memory, in transparent huge pages where the kernel has them (Linux,
    THP `madvise` or `always`): a decode step reads a device's matrices one after the other, and in 4 KB pages each
    small matrix (SmolLM2's are 0.2-1.1 MB) starts cold (a TLB miss per page, a hardware prefetcher that stops at
    every page boundary). Read that way a SmolLM2 token's 121 kernels back to back took 2.98 ms instead of 3.66 here,
    a whole decoded token 3.59 instead of 3.85 (7 alternating runs).

    Chunks of FIRST_CHUNK then ARENA_CHUNK, 2 MB aligned, bump-allocated in 64-byte aligned slices; a chunk is unmapped
    when the last array viewing it goes (a kernel dropped while others in its chunk live keeps its bytes: a re-plan's
    old shards leave at most their chunks' space). Untouched pages of a chunk are never resident; a touched huge page
    is resident whole, so the first chunk stays in 4 KB pages (a device holding a few MB of weights under a memory
    budget of a few MB counts every page) and the huge pages start once a process holds more; each chunk's last one
    may then hold up to 2 MB that no kernel uses (a mapping per matrix left TinyLlama's shape 107 MB over its 591)."""

    def __init__(self):
        self._chunk: np.ndarray | None = None
        self._used = 0
        self._lock = threading.Lock()

    @staticmethod
    def _mapping(nbytes: int, huge: bool = True) -> np.ndarray:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # no THP on this kernel: 4 KB pages, same contents
        whole = np.frombuffer(mapping, dtype=np.uint8)
        start = -whole.ctypes.data % HUGE_PAGE
        return whole[start:start + nbytes]

    def take(self, nbytes: int) -> np.ndarray:
        if nbytes > ARENA_CHUNK // 2:  # a large matrix (a big vocabulary's LM head): huge pages of its own
            return self._mapping(nbytes)
        with self._lock:
            if self._chunk is None or self._used + nbytes > len(self._chunk):
                # the process's first few MB of weights: 4 KB pages (see above); a first matrix larger than that
                # chunk (an agent holding no attention but a share of a big LM head) starts the huge pages at once
                first = self._chunk is None and nbytes <= FIRST_CHUNK
                self._chunk, self._used = self._mapping(FIRST_CHUNK if first else ARENA_CHUNK, huge=not first), 0
            buffer = self._chunk[self._used:self._used + nbytes]
            self._used += -(-nbytes // 64) * 64
            return buffer


_ARENA = _WeightArena()


def weight_pages(nbytes: int) -> np.ndarray:
    """A uint8 buffer for a kernel's weights that the caller fills at once and keeps (`_WeightArena`): contents
    undefined until written."""
    return _ARENA.take(nbytes)


class BufferPool:
    """Buffers reused for the groups a bounded cache reads and evicts (halo/compute/group_cache.py): a group's buffers go back
    to the pool when the group is garbage (evicted and no longer computed), and the next group read of that size
    takes them. Mapping fresh pages per read cost 0.4 ms of a SmolLM2 group's 0.45 ms (the page faults of a new
    mapping, then unmapping it at eviction); a reused buffer costs the copy alone (0.05 ms). Buffers are `own_pages`,
    so what the pool holds is exactly its buffers, and `clear` gives the idle ones back to the system."""

    def __init__(self):
        self._idle: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of nbytes (its old contents, or zeros): an idle one, or new pages."""
        with self._lock:
            idle = self._idle.get(nbytes)
            if idle:
                return idle.pop()
        return own_pages(nbytes)

    def return_with(self, owner: object, *buffers: np.ndarray) -> None:
        """Take `buffers` back once `owner` (what was built on them) is garbage."""
        weakref.finalize(owner, self._put, buffers)

    def _put(self, buffers: tuple[np.ndarray, ...]) -> None:
        with self._lock:
            for buffer in buffers:
                self._idle.setdefault(buffer.nbytes, []).append(buffer)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for idle in self._idle.values() for b in idle)

    def clear(self) -> None:
        """Give the idle buffers back to the system (a cache that shrank needs fewer)."""
        with self._lock:
            self._idle.clear()


def read_mapped_files_at_random() -> int:
    """madvise(MADV_RANDOM) every file-backed mapping of this process (the interpreter and its libraries' code, the
    model file): under a memory limit their pages are evicted and fault back in, and with the default read-around
    each fault reads the disk's whole read-ahead window (8 MB on this machine's disk: TinyLlama-shape agents read
    1.7 GB per token at 40 MB/s), which pushes out still more of them. Returns the bytes advised."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return 0
    advised = 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue  # anonymous memory, the stack, [vdso]...
        start, end = (int(a, 16) for a in fields[0].split("-"))
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_RANDOM) == 0:
            advised += end - start
    return advised


def resident_bytes() -> int:
    """This process's resident set now (after returning freed heap to the OS, so that it measures what is held)."""
    release_freed_heap()
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def cgroups() -> list[tuple[list[str], str]]:
    """This process's cgroups: (controllers, path) per hierarchy (v2: controllers [""]); [] when unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    return [(controllers.split(","), path) for _, controllers, path in (line.split(":", 2) for line in lines)]


CGROUP_V1, CGROUP_V2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryCgroup:
    """A memory cgroup's files (v1 or v2): its limit, its usage, and the memory.stat fields of what it holds that
    reclaim cannot take back without a process reading it again: `in_use` (anonymous and shared memory, mapped file
    pages) and, where the kernel reports them, `kernel` (v2: page tables, kernel stacks, sockets, unreclaimable slab)."""

    path: Path
    limit_file: str
    usage_file: str
    in_use: tuple[str, ...]
    kernel: tuple[str, ...] = ()

    def limited(self) -> bool:
        try:
            cap = (self.path / self.limit_file).read_text().strip()
            return cap != "max" and int(cap) < 1 << 60  # v1 writes "unlimited" as a huge number
        except (OSError, ValueError):
            return False


def memory_cgroup() -> MemoryCgroup | None:
    """This process's own memory cgroup (a systemd service's, the test bed's per-device group), limited or not; the
    root group only where it is limited (a container's own namespace: its limit is the root's), since the root's
    counts are otherwise the whole machine's; None where unknown."""
    for controllers, path in cgroups():
        if "memory" in controllers:
            found = MemoryCgroup(CGROUP_V1 / path.lstrip("/"), "memory.limit_in_bytes",
                                 "memory.usage_in_bytes", ("total_rss", "total_shmem", "total_mapped_file"))
        elif controllers == [""]:  # (on a v1 machine the unified line names a group /sys/fs/cgroup does not hold)
            found = MemoryCgroup(CGROUP_V2 / path.lstrip("/"), "memory.max", "memory.current",
                                 ("anon", "shmem", "file_mapped"),
                                 ("pagetables", "kernel_stack", "sock", "slab_unreclaimable"))
        else:
            continue
        if (found.path / found.limit_file).exists() and (path.strip("/") or found.limited()):
            return found
    return None


def memory_limit() -> tuple[int, int] | None:
    """This process's cgroup memory limit and the cgroup's usage (bytes), None when unlimited or unknown."""
    cgroup = memory_cgroup()
    if cgroup is None or not cgroup.limited():
        return None
    try:
        return tuple(int((cgroup.path / name).read_text().strip()) for name in (cgroup.limit_file, cgroup.usage_file))
    except (OSError, ValueError):
        return None


def charged_bytes() -> int:
    """What this process holds as its cgroup counts it (after returning freed heap to the OS): the cgroup's anonymous
    and shared memory and mapped file pages, not the clean page cache it merely read through. This, not the resident
    set, is what meets a limit: the resident set also counts library pages another cgroup was charged for (an agent
    started after others: ~50 MB of Python's and onnxruntime's code). The resident set outside a cgroup of its own."""
    cgroup = memory_cgroup()
    release_freed_heap()  # (freed heap the allocator keeps is charged too)
    try:
        stat = dict(line.split() for line in (cgroup.path / "memory.stat").read_text().splitlines())
        return sum(int(stat[field]) for field in cgroup.in_use) + sum(int(stat.get(f, 0)) for f in cgroup.kernel)
    except (AttributeError, OSError, ValueError, KeyError):
        return resident_bytes()


HEADROOM_MARGIN = 0.10  # of a cgroup limit, and at least HEADROOM_MIN: transient memory of building a kernel,
HEADROOM_MIN = 24 << 20  # the page cache its weights pass through, the heap's own slack


GROUPS_HEADROOM_MARGIN = 0.02  # HALO's re-mapped groups: buffers of their own, returned at eviction, and the
GROUPS_HEADROOM_MIN = 2 << 20  # cache shrinks each pass where the limit runs short (halo/compute/remap.py)


def memory_headroom(margin: float = HEADROOM_MARGIN, least: int = HEADROOM_MIN) -> int | None:
    """What this process may still grow by under its cgroup's memory limit, less a margin (`margin` of the limit,
    at least `least` bytes; None: no limit). The limit counts the page cache too; what reclaim cannot take back
    is what the cgroup holds in use (`charged_bytes`)."""
    limit = memory_limit()
    if limit is None:
        return None
    return int(limit[0] - charged_bytes() - max(least, margin * limit[0]))


def groups_headroom() -> int | None:
    """memory_headroom for HALO's bounded group cache (a smaller margin: a SmolLM2 agent at its share + 10 % had no
    room left at the general one)."""
    return memory_headroom(GROUPS_HEADROOM_MARGIN, GROUPS_HEADROOM_MIN)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far.

    Reads VmHWM on Linux: getrusage's ru_maxrss survives exec, so a child started by a big parent
    would report the parent's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
