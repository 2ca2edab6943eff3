"""The allocator: room for one more blob in the pool, by evicting in LRU order, and a free arena extent.

Contract (`make_room` is called by a writer: the writers' lock held, inside `Index.writing()`):
- The byte budget (`geo.capacity`) bounds the sum of stored blob sizes; least recently used entries (atime =
  CLOCK_MONOTONIC of the last read or write, shared by all processes) are evicted first. The arena is 25% larger
  than the budget so fragmentation rarely forces extra evictions; when it does, more LRU entries go.
- Pins are per process (this object's counter; a pin stored in shared memory would leak when its process dies):
  this process never evicts its pinned keys, other processes may. When only pinned entries are left to evict,
  `make_room` returns None (the put fails).
- Used slots (READY + TOMBSTONE) stay within MAX_LOAD of the table: at the limit, LRU entries are evicted down to
  7/8 of it and the tombstones purged.
- Extents come only from the writers' extent table (layout.py), never from scanning the arena, and an extent is
  handed out only once no READY entry points into it.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from kvfabric.observe.counters import Counters
from kvfabric.tiers.shm.index import Index
from kvfabric.tiers.shm.layout import extent_bytes


class Allocator:
    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self._pins: Counter[bytes] = Counter()
        self._lock = threading.Lock()
        # fit.first_fit (imported on the first put) and its scratch, sized to the extent table
        self._fit: tuple[Callable[..., int], np.ndarray, np.ndarray] | None = None

    def pin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._pins.update(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._pins.subtract(keys)
            self._pins = +self._pins  # drop zero counts so the counter does not grow without bound

    def fit_scratch(self, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
        """first_fit's scratch for a table of `num_slots` (int64 starts and stops), kept for the next put."""
        if self._fit is None or len(self._fit[1]) != num_slots:
            from kvfabric.tiers.shm.fit import first_fit  # numba: loaded on the first put, not at import (fit.py)

            self._fit = (first_fit, np.empty(num_slots, dtype=np.int64), np.empty(num_slots, dtype=np.int64))
        return self._fit[1], self._fit[2]

    def _first_fit(self, offsets: np.ndarray, sizes: np.ndarray, num_live: int, need: int, data_bytes: int) -> int:
        """The lowest free extent of `need` bytes, or -1 (fit.first_fit, with this allocator's scratch)."""
        starts, stops = self.fit_scratch(len(sizes))
        assert self._fit is not None
        return int(self._fit[0](offsets, sizes, num_live, need, data_bytes, starts, stops))

    def _lru_order(self, index: Index) -> list[int]:
        """READY slots, least recently used first, without this process's pinned keys."""
        offsets, sizes = index.extents()
        ready = np.flatnonzero(sizes != 0)  # a bool mask first: numpy's nonzero over uint64 is much slower
        del offsets, sizes
        entries = index.entries()
        order = ready[np.argsort(entries["atime"][ready], kind="stable")].tolist()
        del entries
        with self._lock:
            if self._pins:
                order = [slot for slot in order if self._pins[index.key_at(slot)] <= 0]
        return order

    def make_room(self, index: Index, size: int) -> int | None:
        """Evict LRU entries until `size` more bytes fit the table, the budget and the arena; return the offset
        of a free extent, or None when only pinned entries are left to evict."""
        geo, stats = index.geo, index.stats
        need = extent_bytes(size)
        # 1. the hash table's load: when full, evict LRU entries down to 7/8 of the limit and drop tombstones
        if stats[2] + 1 > geo.max_used:
            excess = stats[1] + 1 - max(1, geo.max_used - geo.num_slots // 8)
            for slot in self._lru_order(index)[:max(0, excess)]:
                index.delete_slot(slot)
                self.counters.add("evicted")
            index.purge_tombstones()
            if stats[2] + 1 > geo.max_used:
                return None
        # 2. the byte budget
        order: Iterator[int] | None = None

        def evict_next() -> int | None:
            nonlocal order
            if order is None:
                order = iter(self._lru_order(index))
            slot = next(order, None)
            if slot is not None:
                index.delete_slot(slot)
                self.counters.add("evicted")
            return slot

        while stats[0] + size > geo.capacity:
            if evict_next() is None:
                return None
        # 3. a free extent, first fit (compiled: this runs on every put); else evict in LRU order, merging gaps
        # (sorted extents as a linked list)
        offsets, sizes = index.extents()
        # stats[1] (live entries) is the count of nonzero extents: publish and retire change both together
        at = self._first_fit(offsets, sizes, stats[1], need, geo.data_bytes)
        if at >= 0:
            return at
        slots = np.flatnonzero(sizes != 0)
        starts_arr = offsets[slots]
        stops_arr = starts_arr + sizes[slots]
        del offsets, sizes
        by_offset = np.argsort(starts_arr, kind="stable")
        slots, starts_arr, stops_arr = slots[by_offset], starts_arr[by_offset], stops_arr[by_offset]
        # nodes 0..n-1: extents by offset; n: start sentinel; n+1: end sentinel (n >= 1 here: an empty arena fits)
        n = len(slots)
        starts = starts_arr.tolist() + [0, geo.data_bytes]
        stops = stops_arr.tolist() + [0, geo.data_bytes]
        prev = [n] + list(range(n - 1)) + [n, n - 1]
        nxt = list(range(1, n)) + [n + 1] + [0, n + 1]
        node_of = {slot: node for node, slot in enumerate(slots.tolist())}
        while True:
            slot = evict_next()
            if slot is None:
                return None
            node = node_of[slot]
            p, q = prev[node], nxt[node]
            nxt[p], prev[q] = q, p
            if starts[q] - stops[p] >= need:
                return stops[p]
