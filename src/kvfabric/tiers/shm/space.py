"""Space management: eviction and arena allocation for a writer that needs room for one more blob.

Contract (all with the writers' lock held, inside `_writing`):
- The byte budget (`capacity`) bounds the sum of stored blob sizes; least recently used entries (atime =
  CLOCK_MONOTONIC of the last read or write, shared by all processes) are evicted first. The arena is 25% larger
  than the budget so fragmentation rarely forces extra evictions; when it does, more LRU entries go.
- Pins are per process (`_pins`, a counter owned by this process): this process never evicts its pinned keys,
  other processes may. When only pinned entries are left to evict, `_make_room` returns None (the put fails).
- Used slots (READY + TOMBSTONE) stay within MAX_LOAD of the table: at the limit, LRU entries are evicted down to
  7/8 of it and the tombstones purged.
- Extents come only from the writers' extent table (layout.py), never from scanning the arena, and an extent is
  handed out only once no READY entry points into it.
- A mixin over `_PoolIndex`; the object provides `_pins`.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np

from kvfabric.tiers.shm.index import _PoolIndex
from kvfabric.tiers.shm.layout import _ENTRY, EMPTY, READY, _extent


class _PoolSpace(_PoolIndex):
    """Eviction in LRU order and first-fit allocation of arena extents."""

    _pins: Counter[bytes]

    def _lru_order(self) -> list[int]:
        """READY slots, least recently used first, without this process's pinned keys."""
        offsets, sizes = self._extents()
        ready = np.flatnonzero(sizes)
        del offsets, sizes
        index = self._index()
        order = ready[np.argsort(index["atime"][ready], kind="stable")].tolist()
        del index
        if self._pins:
            order = [slot for slot in order if self._pins[self._key_at(slot)] <= 0]
        return order

    def _make_room(self, size: int) -> int | None:
        """Evict LRU entries until `size` more bytes fit the table, the budget and the arena; return the offset
        of a free extent, or None when only pinned entries are left to evict. Lock held, inside _writing."""
        geo, stats = self._geo, self._stats
        need = _extent(size)
        # 1. the hash table's load: when full, evict LRU entries down to 7/8 of the limit and drop tombstones
        if stats[2] + 1 > geo.max_used:
            excess = stats[1] + 1 - max(1, geo.max_used - geo.num_slots // 8)
            for slot in self._lru_order()[:max(0, excess)]:
                self._delete_slot(slot)
                self.counters["evicted"] += 1
            self._purge_tombstones()
            if stats[2] + 1 > geo.max_used:
                return None
        # 2. the byte budget
        order: Iterator[int] | None = None

        def evict_next() -> int | None:
            nonlocal order
            if order is None:
                order = iter(self._lru_order())
            slot = next(order, None)
            if slot is not None:
                self._delete_slot(slot)
                self.counters["evicted"] += 1
            return slot

        while stats[0] + size > geo.capacity:
            if evict_next() is None:
                return None
        # 3. a free extent, first fit; else evict in LRU order, merging gaps (sorted extents as a linked list)
        offsets, sizes = self._extents()
        slots = np.flatnonzero(sizes)
        starts_arr = offsets[slots]
        stops_arr = starts_arr + sizes[slots]
        del offsets, sizes
        by_offset = np.argsort(starts_arr, kind="stable")
        slots, starts_arr, stops_arr = slots[by_offset], starts_arr[by_offset], stops_arr[by_offset]
        gap_starts = np.concatenate(([0], stops_arr))
        gap_stops = np.concatenate((starts_arr, [geo.data_bytes]))
        fits = np.flatnonzero(gap_stops - gap_starts >= need)
        if fits.size:
            return int(gap_starts[fits[0]])
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

    def _purge_tombstones(self) -> None:
        """Rebuild the table without tombstones (lock held). Readers racing with this see misses, never bad data."""
        index = self._index()
        ready = np.flatnonzero(index["state"] == READY).tolist()
        occupied = np.flatnonzero(index["state"] != EMPTY).tolist()
        del index
        live = []
        for slot in ready:
            base = self._base(slot)
            _, _, _, offset, length, atime, _ = _ENTRY.unpack_from(self._mm, base)
            live.append((self._key_at(slot), offset, length, atime))
        for slot in occupied:
            self._retire(slot, EMPTY)
        for key, offset, length, atime in live:
            slot = self._insert_slot(key)
            if slot is not None:
                self._publish(slot, key, offset, length, atime)
        self.counters["purges"] += 1
