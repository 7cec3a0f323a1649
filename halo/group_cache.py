"""A bounded set of built MLP group kernels: what a memory-bounded device keeps of HALO's re-mappable groups.

In HALO mode any MLP group of a layer where a device holds ranks can land on it in a token (the ranking
decides), so holding every candidate built costs the whole MLP of those layers on every device, whatever
its share. A `GroupCache` keeps at most `capacity_bytes` of built groups (compact kernels), evicting those of
the layer computed last (`_victim`), and builds a missing group from the model file when a ranking needs it.
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
        self.stats = CacheStats()
        self.held_bytes = 0
        self._entries: OrderedDict[Hashable, object] = OrderedDict()  # least recently used first
        self._building: dict[Hashable, threading.Event] = {}
        self._lock = threading.Lock()
        self.filling = True  # builds during the initial fill are not counted as loads

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def room_for(self, nbytes: int) -> bool:
        """Whether a group of nbytes fits without evicting anything (the initial fill stops when it does not)."""
        return self.capacity_bytes is None or self.held_bytes + nbytes <= self.capacity_bytes

    def get(self, key: Hashable, build: Callable[[], object], ahead: bool = False):
        """The built group for `key`, building it (build() -> an object with .nbytes) if absent; ahead: the load
        thread asking (counted as a prefetch, not a stall)."""
        waited = time.perf_counter()
        while True:
            with self._lock:
                if not ahead:
                    self.computing = key[0]
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
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
        self.held_bytes += entry.nbytes
        while self.capacity_bytes is not None and self.held_bytes > self.capacity_bytes and len(self._entries) > 1:
            old = self._entries.pop(self._victim(key))  # (never `key` itself)
            self.held_bytes -= old.nbytes
            self.stats.evicted += 1

    def _victim(self, key: Hashable) -> Hashable:
        """What to evict for `key`: the most recently used group of a layer other than the one being loaded (key's)
        and the one being computed. Layers are visited in turn every token, so the groups used last are the ones
        needed last again (a token later): evicting them keeps the layers coming next, which hit where the ranking
        repeats. Least recently used instead, once they do not all fit, evicts exactly the layers that come next and
        nothing ever hits."""
        busy = (key[0], self.computing)
        for k in reversed(self._entries):
            if k[0] not in busy:
                return k
        return next(k for k in self._entries if k != key)


def minimum_capacity(largest_layer_bytes: int) -> int:
    """The least a bounded cache may hold: one layer's groups being computed and the next layer's being loaded."""
    return 2 * largest_layer_bytes
