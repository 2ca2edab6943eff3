"""The pool's index: a seqlocked open-addressing hash table of entries, with the writers' extent table and totals.

Contract:
- Readers (`_find`, `_read_entry`, `_index(snapshot)`) take no lock and work on one `(mmap, _Geometry)` snapshot
  for a whole operation: they return an entry only between two equal even seqs, so never a half-updated one.
  An entry left odd (busy, or by a dead writer) is skipped, not trusted.
- Every other method is a writer's: the writers' lock is held (pool.py), and entry changes happen inside
  `_writing`, which keeps the totals in `_stats` and the header's dirty flag. Each entry update is a seqlock:
  seq becomes odd, the fields change, seq becomes even again. `_publish` is called only once the blob is in
  the arena; `_retire` zeroes the entry's extent in the extent table, so the extent can be reused.
- A set dirty flag found by `_writing` means a writer died mid-change: odd entries are retired (`_repair`),
  the extent table rebuilt and the totals recounted before anything else changes.
- A mixin: the object provides `_map`, `_stats` and `counters` (set up by `_ShmPool.__init__`).
"""
from __future__ import annotations

import contextlib
import mmap
import os
from collections import Counter
from collections.abc import Iterator

import numpy as np
import xxhash

from kvfabric.tiers.shm.layout import (_ENTRY, _FIELDS, _SEQ, _STATE, _STATS, _U64, ALIGN, EMPTY, ENTRY_BYTES,
                                       ENTRY_DTYPE, KEY_AT, MAX_KEY_BYTES, READY, STATS_AT, TOMBSTONE, _Geometry,
                                       _entry_sum, _extent)

SEQ_SPINS = 50


class _PoolIndex:
    """Reads and updates of the index and the extent table in the current mapping."""

    _map: tuple[mmap.mmap, _Geometry] | None  # replaced as one object: readers snapshot it
    _stats: list[int]  # live_bytes, live_count, used_slots: valid while writing (see _writing)
    counters: Counter[str]

    @property
    def _mm(self) -> mmap.mmap:
        """The current mapping (writers, lock held; readers use one `_map` snapshot for a whole operation)."""
        return self._map[0]  # type: ignore[index]

    @property
    def _geo(self) -> _Geometry:
        return self._map[1]  # type: ignore[index]

    # ---- index access --------------------------------------------------------------------------------------
    def _index(self, snapshot: tuple[mmap.mmap, _Geometry] | None = None) -> np.ndarray:
        mm, geo = snapshot or self._map  # type: ignore[misc]
        return np.frombuffer(mm, dtype=ENTRY_DTYPE, count=geo.num_slots, offset=geo.index_offset)

    def _base(self, slot: int) -> int:
        return self._geo.index_offset + slot * ENTRY_BYTES

    def _read_entry(self, mm: mmap.mmap, base: int) -> tuple[int, int, bytes, int, int, int] | None:
        """A consistent (seq, state, key, offset, length, esum) snapshot, or None while a writer holds it."""
        for _ in range(SEQ_SPINS):
            seq, state, key_len, offset, length, _, esum = _ENTRY.unpack_from(mm, base)
            if not seq & 1:
                key = mm[base + KEY_AT:base + KEY_AT + min(key_len, MAX_KEY_BYTES)]
                if _SEQ.unpack_from(mm, base)[0] == seq:
                    if key_len > MAX_KEY_BYTES:
                        key = b""
                    return seq, state, key, offset, length, esum
            os.sched_yield()
        return None

    def _find(self, key: bytes, snapshot: tuple[mmap.mmap, _Geometry] | None = None
              ) -> tuple[int, int, int, int] | None:
        """(slot, seq, offset, length) of the READY entry for `key` in one mapping, without locking."""
        snapshot = snapshot or self._map
        if snapshot is None or len(key) > MAX_KEY_BYTES:
            return None
        mm, geo = snapshot
        start = xxhash.xxh3_64_intdigest(key) & geo.mask
        for i in range(geo.num_slots):
            slot = (start + i) & geo.mask
            base = geo.index_offset + slot * ENTRY_BYTES
            entry = self._read_entry(mm, base)
            if entry is None:
                continue  # busy (or left odd by a dead writer): not provably ours, keep probing
            seq, state, entry_key, offset, length, esum = entry
            if state == EMPTY:
                return None
            if state == READY and entry_key == key:
                if offset + length > geo.data_bytes or esum != _entry_sum(seq, state, len(key), offset, length, key):
                    self.counters["bad_entries"] += 1
                    return None
                return slot, seq, offset, length
        return None

    def _key_at(self, slot: int) -> bytes:
        base = self._base(slot)
        key_len = min(_ENTRY.unpack_from(self._mm, base)[2], MAX_KEY_BYTES)
        return self._mm[base + KEY_AT:base + KEY_AT + key_len]

    # ---- index changes (lock held) -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Bracket index changes (lock held). The header's dirty flag stays set if this process dies (or raises)
        mid-change; the next writer then retires entries left mid-update and recounts the stats."""
        mm = self._mm
        dirty, live_bytes, live_count, used = _STATS.unpack_from(mm, STATS_AT)
        if dirty:
            self._repair()
            self._rebuild_extents()
            live_bytes, live_count, used = self._recount()
            self.counters["recovered"] += 1
        self._stats = [live_bytes, live_count, used]
        _STATS.pack_into(mm, STATS_AT, 1, live_bytes, live_count, used)
        yield
        _STATS.pack_into(mm, STATS_AT, 0, *self._stats)

    def _extents(self) -> tuple[np.ndarray, np.ndarray]:
        """The writers' extent table: offsets and extent sizes by slot (0: not READY). Lock held."""
        mm, geo = self._map  # type: ignore[misc]
        return (np.frombuffer(mm, dtype="<u8", count=geo.num_slots, offset=geo.ext_offset),
                np.frombuffer(mm, dtype="<u8", count=geo.num_slots, offset=geo.ext_len_offset))

    def _rebuild_extents(self) -> None:
        index = self._index()
        ready = np.flatnonzero(index["state"] == READY)
        offsets, sizes = self._extents()
        sizes[:] = 0
        offsets[ready] = index["offset"][ready]
        sizes[ready] = (np.maximum(index["length"][ready], 1) + (ALIGN - 1)) // ALIGN * ALIGN
        del index, offsets, sizes

    def _recount(self) -> tuple[int, int, int]:
        index = self._index()
        ready = index["state"] == READY
        counts = int(index["length"][ready].sum()), int(np.count_nonzero(ready)), \
            int(np.count_nonzero(index["state"] != EMPTY))
        del index, ready
        return counts

    def _retire(self, slot: int, state: int = TOMBSTONE) -> None:
        """Mark an entry EMPTY/TOMBSTONE under the seqlock (lock held)."""
        mm, base = self._mm, self._base(slot)
        seq, prev, _, _, length = _FIELDS.unpack_from(mm, base)
        seq |= 1  # odd while it changes; also fixes an entry left odd by a dead writer
        _SEQ.pack_into(mm, base, seq)
        _STATE.pack_into(mm, base + 8, state)
        _SEQ.pack_into(mm, base, seq + 1)
        stats = self._stats
        if prev == READY:
            stats[0] -= length
            stats[1] -= 1
            _U64.pack_into(mm, self._geo.ext_len_offset + slot * 8, 0)
        if (state == EMPTY) != (prev == EMPTY):
            stats[2] += 1 if prev == EMPTY else -1

    def _delete_slot(self, slot: int) -> None:
        """Retire a READY entry: EMPTY when it ends its probe chain, else TOMBSTONE (lock held)."""
        nxt = (slot + 1) & self._geo.mask
        nxt_state = _STATE.unpack_from(self._mm, self._base(nxt) + 8)[0]
        self._retire(slot, EMPTY if nxt_state == EMPTY else TOMBSTONE)

    def _publish(self, slot: int, key: bytes, offset: int, length: int, atime: int) -> None:
        """Make a (non-READY) slot the READY entry for key (lock held, data already in place)."""
        mm, base = self._mm, self._base(slot)
        seq, prev = _SEQ.unpack_from(mm, base)[0] | 1, _STATE.unpack_from(mm, base + 8)[0]
        stats = self._stats
        stats[0] += length
        stats[1] += 1
        stats[2] += prev == EMPTY
        _SEQ.pack_into(mm, base, seq)
        final = seq + 1
        esum = _entry_sum(final, READY, len(key), offset, length, key)
        mm[base + KEY_AT:base + KEY_AT + len(key)] = key
        _ENTRY.pack_into(mm, base, seq, READY, len(key), offset, length, atime, esum)
        _SEQ.pack_into(mm, base, final)
        geo = self._geo
        _U64.pack_into(mm, geo.ext_offset + slot * 8, offset)
        _U64.pack_into(mm, geo.ext_len_offset + slot * 8, _extent(length))

    def _repair(self) -> None:
        """Retire entries a dead writer left mid-update (odd seq). Lock held, so no live writer is mid-update."""
        index = self._index()
        odd = np.flatnonzero(index["seq"] & 1).tolist()
        del index
        for slot in odd:
            self._retire(slot, TOMBSTONE)
            self.counters["repaired_entries"] += 1

    def _remove_key(self, key: bytes) -> bool:
        """Retire every READY entry for `key`, damaged ones included (lock held: no entry is mid-update)."""
        geo, mm, removed = self._geo, self._mm, False
        start = xxhash.xxh3_64_intdigest(key) & geo.mask
        for i in range(geo.num_slots):
            slot = (start + i) & geo.mask
            base = self._base(slot)
            state = _STATE.unpack_from(mm, base + 8)[0]
            if state == EMPTY:
                break
            if state == READY and self._key_at(slot) == key:
                self._delete_slot(slot)
                removed = True
        return removed

    def _insert_slot(self, key: bytes) -> int | None:
        geo = self._geo
        start = xxhash.xxh3_64_intdigest(key) & geo.mask
        for i in range(geo.num_slots):
            slot = (start + i) & geo.mask
            if _STATE.unpack_from(self._mm, self._base(slot) + 8)[0] != READY:
                return slot
        return None
