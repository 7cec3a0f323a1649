"""A bounded set of built MLP groups: what a memory-bounded device keeps of HALO's re-mappable groups.

In HALO mode any MLP group of a layer where a device holds ranks can land on it in a token (the ranking
decides), so holding every candidate built costs the whole MLP of those layers on every device, whatever
its share. A `GroupCache` keeps at most `capacity_bytes` of built groups (their compact bytes), evicting those
needed again furthest ahead in layer order (`_victim`), and builds a missing group (prepared bytes or the model
file) when a ranking needs it.
The load thread builds the next layer's predicted groups while this layer computes (Load-Comp); a group the
compute thread needs and nobody built yet is built in line (a stall, counted).

A group being built by one thread is waited for by the other (never built twice); a group the compute thread
took stays alive until it is computed even if evicted meanwhile, so memory can exceed the capacity by the
groups of one layer in flight: the caller leaves room for that (`minimum_capacity`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable, Hashable

from halo.host.memory import BufferPool


@dataclass
class CacheStats:
    hits: int = 0  # wanted and already built
    stalls: int = 0  # wanted by the computation and built in line (not ahead)
    prefetched: int = 0  # built ahead by the load thread
    evicted: int = 0
    built_bytes: int = 0  # compact weight bytes built after the initial fill
    build_ms: float = 0.0  # time spent building them (either thread)
    stall_ms: float = 0.0  # of which the computation waited (in-line builds, waits for the load thread)

    def to_json(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


class GroupCache:
    def __init__(self, capacity_bytes: int | None = None):
        """capacity_bytes None: unbounded (every group built stays). Keys are (layer, group)."""
        self.capacity_bytes = capacity_bytes
        self.computing = None  # the layer of the computation's last request
        self._visits: dict[Hashable, int] = {}  # layer -> how many times the computation came to it
        self._used: dict[Hashable, int] = {}  # key -> the visit of its layer it was last used in (or is loaded for)
        self.stats = CacheStats()
        self.held_bytes = 0
        self._entries: OrderedDict[Hashable, object] = OrderedDict()  # least recently used first
        self._building: dict[Hashable, threading.Event] = {}
        self._lock = threading.Lock()
        self.filling = True  # builds during the initial fill are not counted as loads
        self.buffers = BufferPool()  # what evicted compact groups were read into, for the next ones

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def begin_pass(self) -> None:
        """A new forward pass: its first request of a layer is a new visit of it, even where it is the layer of the
        last request (a device with one layer of ranks)."""
        with self._lock:
            self.computing = None

    def clear(self) -> None:
        """Drop every built group (a device that measured its kernels too large for its budget starts over compact)."""
        with self._lock:
            self._entries.clear()
            self._used.clear()
            self.held_bytes = 0
        self.buffers.clear()

    def shrink(self, capacity_bytes: int) -> None:
        """Lower the capacity, evicting down to it now."""
        with self._lock:
            self.capacity_bytes = capacity_bytes
            while self.held_bytes > capacity_bytes and self._entries:
                self._evict(self._victim((None, None)))
        self.buffers.clear()

    def room_for(self, nbytes: int) -> bool:
        """Whether a group of nbytes fits without evicting anything (the initial fill stops when it does not)."""
        return self.capacity_bytes is None or self.held_bytes + nbytes <= self.capacity_bytes

    def get(self, key: Hashable, build: Callable[[], object], ahead: bool = False):
        """The built group for `key`, building it (build() -> an object with .nbytes) if absent; ahead: the load
        thread asking (counted as a prefetch, not a stall)."""
        waited = time.perf_counter()
        while True:
            with self._lock:
                if not ahead and self.computing != key[0]:
                    self.computing = key[0]
                    self._visits[key[0]] = self._visits.get(key[0], 0) + 1
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    self._used[key] = self._visits.get(key[0], 0) + (ahead and key[0] != self.computing)
                    if not ahead:
                        self.stats.hits += 1
                    return entry
                pending = self._building.get(key)
                if pending is None:
                    self._building[key] = threading.Event()
                    break
            pending.wait()  # the other thread is building it
            if not ahead:
                self.stats.stall_ms += 1e3 * (time.perf_counter() - waited)
        t = time.perf_counter()
        try:
            entry = build()
        finally:
            with self._lock:
                self._building.pop(key).set()
        with self._lock:
            self._insert(key, entry)
            if not self.filling:
                ms = 1e3 * (time.perf_counter() - t)
                self.stats.build_ms += ms
                self.stats.built_bytes += entry.nbytes
                if ahead:
                    self.stats.prefetched += 1
                else:
                    self.stats.stalls += 1
                    self.stats.stall_ms += ms
        return entry

    def _insert(self, key: Hashable, entry) -> None:
        self._entries[key] = entry
        self._used[key] = self._visits.get(key[0], 0) + (key[0] != self.computing)  # loaded ahead: the next visit's
        self.held_bytes += entry.nbytes
        while self.capacity_bytes is not None and self.held_bytes > self.capacity_bytes and len(self._entries) > 1:
            self._evict(self._victim(key))  # (never `key` itself)

    def _evict(self, key: Hashable) -> None:
        self.held_bytes -= self._entries.pop(key).nbytes
        self._used.pop(key, None)
        self.stats.evicted += 1

    def _victim(self, key: Hashable) -> Hashable:
        """What to evict for `key`: the group needed again furthest in the future, as far as the rankings and layer
        order tell. First groups the last visit of their layer did not use (the ranking moved away from them: the
        groups a token used are the likeliest its next token uses), then by layer order: layers are visited in turn
        every token, so with the computation at layer c the layers before c come back only next token (the closer
        to c, the later) and those after c come this token (the further, the later): first c-1, c-2, .., 0, then
        the last layer down to c+1. Never key's layer (being loaded) nor c (in use). Least recently used instead,
        once the groups do not all fit, evicts exactly the layers that come next and nothing ever hits; "most
        recently used" evicted the next layer's groups the load thread had just built when it went on to the layer
        after; layer order alone evicts the groups of the layers just computed even where the next token needs them
        again (one swap a token in tests/test_group_cache.py: 59 builds instead of 33; SmolLM2's rankings churn more:
        69 -> 66 builds per token)."""
        c, best, best_rank = self.computing, None, None
        for k in self._entries:  # least recently used first: it wins ties
            if k[0] == key[0] or k[0] == c:
                continue
            rank = (self._used.get(k, 0) < self._visits.get(k[0], 0), c is not None and k[0] < c, k[0])
            if best_rank is None or rank > best_rank:
                best, best_rank = k, rank
        return best if best is not None else next(k for k in self._entries if k != key)


def minimum_capacity(largest_layer_bytes: int) -> int:
    """The least a bounded cache may hold: one layer's groups being computed and the next layer's being loaded."""
    return 2 * largest_layer_bytes
