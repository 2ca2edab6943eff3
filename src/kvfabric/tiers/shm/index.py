"""The index of one mapping of the pool: a seqlocked open-addressing hash table of entries, the writers' extent
table and running totals (layout.py has the bytes).

Contract:
- An `Index` wraps one mapping (`mm`, `geo`) and is replaced with it (arena.py): a reader takes the current
  index once and uses it for a whole operation, so it never mixes two mappings.
- Readers (`find`, `is_current`, `touch`, `entries`, `ready_keys`) take no lock: they return an entry only
  between two equal even seqs, so never a half-updated one. An entry left odd (busy, or by a dead writer) is
  skipped, not trusted.
- Every other method is a writer's: the writers' lock is held (arena.py), and entry changes happen inside
  `writing()`, which keeps the totals in `stats` and the header's dirty flag. Each entry update is a seqlock:
  seq becomes odd, the fields change, seq becomes even again. `publish` is called only once the blob is in the
  arena; `retire` zeroes the entry's extent in the extent table, so the extent can be reused.
- A set dirty flag found by `writing()` means a writer died mid-change: odd entries are retired (`repair`),
  the extent table rebuilt and the totals recounted before anything else changes.
- `validate()` (on open, lock held) retires damaged entries and says what makes the whole index unusable.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Iterator
from types import ModuleType
from typing import NamedTuple

import numpy as np
import xxhash

from kvfabric.observe.counters import Counters
from kvfabric.tiers.shm.coherence import CacheOps
from kvfabric.tiers.shm.layout import (
    ALIGN,
    ATIME_AT,
    EMPTY,
    ENTRY,
    ENTRY_BYTES,
    ENTRY_DTYPE,
    FIELDS,
    KEY_AT,
    MAX_KEY_BYTES,
    READY,
    SEQ,
    STATE,
    STATS,
    STATS_AT,
    SUPERSEDED_AT,
    TOMBSTONE,
    U64,
    Geometry,
    entry_sum,
    extent_bytes,
)

SEQ_SPINS = 50


class EntryRef(NamedTuple):
    """A READY entry as a reader saw it: its blob is arena bytes [offset, offset + length) while seq holds.
    A NamedTuple, not a frozen dataclass: made on every read and lookup, where a frozen dataclass's __init__
    (object.__setattr__ per field) costs more than the rest of a lookup."""
    slot: int
    seq: int
    offset: int
    length: int


class Index:
    def __init__(self, mm: mmap.mmap, geo: Geometry, counters: Counters, ops: CacheOps | None = None) -> None:
        self.ops = ops or CacheOps()  # cache maintenance: no-ops on coherent memory (coherence.py)
        # the fast path: with the plain no-op primitives a writer skips the calls (8 a put, about a tenth of a
        # put's index work in Python) and puts and reads take index_kernel.py; a subclass (non-coherent memory,
        # the tests' recorders) is always called
        self.is_plain = type(self.ops) is CacheOps
        self.mm = mm
        self.geo = geo
        self.counters = counters
        self.stats = [0, 0, 0]  # live_bytes, live_count, used_slots: valid while writing (see writing())
        self._words: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._kernel: ModuleType | None = None

    def words(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The mapping's bytes [0, data_offset) as uint64, uint32 and uint8 views (index_kernel.py's w64, w32, w8),
        made once per mapping; `release` drops them so that the mapping can be closed."""
        if self._words is None:
            w8 = np.frombuffer(self.mm, dtype=np.uint8, count=self.geo.data_offset)
            self._words = (w8.view(np.uint64), w8.view(np.uint32), w8)
        return self._words

    def release(self) -> None:
        self._words = None

    # ---- readers (no lock) ---------------------------------------------------------------------------------
    def entries(self) -> np.ndarray:
        """A structured view [num_slots] of the entries (a snapshot only under the lock)."""
        return np.frombuffer(self.mm, dtype=ENTRY_DTYPE, count=self.geo.num_slots, offset=self.geo.index_offset)

    def _base(self, slot: int) -> int:
        return self.geo.index_offset + slot * ENTRY_BYTES

    def _read_entry(self, base: int) -> tuple[int, int, bytes, int, int, int] | None:
        """A consistent (seq, state, key, offset, length, esum) snapshot, or None while a writer holds it."""
        mm = self.mm
        for _ in range(SEQ_SPINS):
            self.ops.invalidate(mm, base, ENTRY_BYTES)
            seq, state, key_len, offset, length, _, esum = ENTRY.unpack_from(mm, base)
            if not seq & 1:
                key = mm[base + KEY_AT:base + KEY_AT + min(key_len, MAX_KEY_BYTES)]
                if SEQ.unpack_from(mm, base)[0] == seq:
                    if key_len > MAX_KEY_BYTES:
                        key = b""
                    return seq, state, key, offset, length, esum
            os.sched_yield()
        return None

    def kernel(self) -> ModuleType:
        """index_kernel.py, imported on first use (numba: never when kvfabric is imported, see fit.py)."""
        if self._kernel is None:
            from kvfabric.tiers.shm import index_kernel
            self._kernel = index_kernel
        return self._kernel

    def find(self, key: bytes) -> EntryRef | None:
        """The READY entry for `key`, without locking."""
        if len(key) > MAX_KEY_BYTES:
            return None
        geo = self.geo
        start = xxhash.xxh3_64_intdigest(key) & geo.mask
        if self.is_plain:  # the compiled R1 (index_kernel.find); the checksum here
            w64, w32, w8 = self.words()
            slot, seq, offset, length, esum = self.kernel().find(w64, w32, w8, key, start, geo.num_slots,
                                                                 geo.index_offset, geo.data_bytes)
            if slot == -1:
                return None
            if slot == -2 or esum != entry_sum(seq, READY, len(key), offset, length, key):
                self.counters.add("bad_entries")
                return None
            return EntryRef(slot, seq, offset, length)
        for i in range(geo.num_slots):
            slot = (start + i) & geo.mask
            entry = self._read_entry(geo.index_offset + slot * ENTRY_BYTES)
            if entry is None:
                continue  # busy (or left odd by a dead writer): not provably ours, keep probing
            seq, state, entry_key, offset, length, esum = entry
            if state == EMPTY:
                return None
            if state == READY and entry_key == key:
                if offset + length > geo.data_bytes or esum != entry_sum(seq, state, len(key), offset, length, key):
                    self.counters.add("bad_entries")
                    return None
                return EntryRef(slot, seq, offset, length)
        return None

    def is_superseded(self) -> bool:
        """Whether a process that replaced this pool file marked it (arena.py follows the new one)."""
        self.ops.invalidate(self.mm, SUPERSEDED_AT, U64.size)
        return U64.unpack_from(self.mm, SUPERSEDED_AT)[0] != 0

    def is_current(self, ref: EntryRef) -> bool:
        """Whether the entry is still the one `find` saw (not retired or reused since)."""
        self.ops.invalidate(self.mm, self._base(ref.slot), SEQ.size)
        return SEQ.unpack_from(self.mm, self._base(ref.slot))[0] == ref.seq

    def recheck(self, ref: EntryRef) -> bool:
        """`is_current(ref)`, then, if it is, `touch(ref.slot)`: a read's last step."""
        if self.is_plain:
            return self.kernel().recheck(self.words()[0], ref.slot, ref.seq, time.monotonic_ns(), self.geo.index_offset)
        if not self.is_current(ref):
            return False
        self.touch(ref.slot)
        return True

    def touch(self, slot: int) -> None:
        """LRU touch: atime = now (CLOCK_MONOTONIC, shared by all processes); a lost race only reorders."""
        SEQ.pack_into(self.mm, self._base(slot) + ATIME_AT, time.monotonic_ns())

    def ready_keys(self) -> list[bytes]:
        ready = np.flatnonzero(self.entries()["state"] == READY).tolist()
        out = []
        for slot in ready:
            entry = self._read_entry(self._base(slot))
            if entry is not None and entry[1] == READY:
                out.append(entry[2])
        return out

    # ---- writers (the writers' lock held) ------------------------------------------------------------------
    def key_at(self, slot: int) -> bytes:
        base = self._base(slot)
        key_len = min(ENTRY.unpack_from(self.mm, base)[2], MAX_KEY_BYTES)
        return self.mm[base + KEY_AT:base + KEY_AT + key_len]

    @contextlib.contextmanager
    def writing(self, resumed: bool = False) -> Iterator[None]:
        """Bracket index changes. The header's dirty flag stays set if this process dies (or raises) mid-change;
        the next writer then retires entries left mid-update and recounts the stats. `resumed`: this writer set
        the flag itself (index_kernel.reserve, lock held since) and goes on with the change."""
        self.ops.invalidate(self.mm, STATS_AT, STATS.size)
        dirty, live_bytes, live_count, used = STATS.unpack_from(self.mm, STATS_AT)
        if dirty and not resumed:
            self.repair()
            self.rebuild_extents()
            live_bytes, live_count, used = self.recount()
            self.counters.add("recovered")
        self.stats = [live_bytes, live_count, used]
        STATS.pack_into(self.mm, STATS_AT, 1, live_bytes, live_count, used)
        self._flush(STATS_AT, STATS.size)
        yield
        STATS.pack_into(self.mm, STATS_AT, 0, *self.stats)
        self._flush(STATS_AT, STATS.size)

    def _flush(self, start: int, length: int) -> None:
        """Write back and order: what was stored before is in memory before anything stored after."""
        if self.is_plain:
            return
        self.ops.flush(self.mm, start, length)
        self.ops.fence()

    def extents(self) -> tuple[np.ndarray, np.ndarray]:
        """The writers' extent table: offsets and extent sizes by slot (0: not READY)."""
        geo = self.geo
        return (np.frombuffer(self.mm, dtype="<u8", count=geo.num_slots, offset=geo.ext_offset),
                np.frombuffer(self.mm, dtype="<u8", count=geo.num_slots, offset=geo.ext_len_offset))

    def rebuild_extents(self) -> None:
        index = self.entries()
        ready = np.flatnonzero(index["state"] == READY)
        offsets, sizes = self.extents()
        sizes[:] = 0
        offsets[ready] = index["offset"][ready]
        sizes[ready] = (np.maximum(index["length"][ready], 1) + (ALIGN - 1)) // ALIGN * ALIGN
        del index, offsets, sizes

    def recount(self) -> tuple[int, int, int]:
        """(live bytes, live entries, used slots), counted from the entries."""
        index = self.entries()
        ready = index["state"] == READY
        counts = int(index["length"][ready].sum()), int(np.count_nonzero(ready)), \
            int(np.count_nonzero(index["state"] != EMPTY))
        del index, ready
        return counts

    def retire(self, slot: int, state: int = TOMBSTONE) -> None:
        """Mark an entry EMPTY/TOMBSTONE under the seqlock."""
        mm, base = self.mm, self._base(slot)
        seq, prev, _, _, length = FIELDS.unpack_from(mm, base)
        seq |= 1  # odd while it changes; also fixes an entry left odd by a dead writer
        SEQ.pack_into(mm, base, seq)
        self._flush(base, SEQ.size)
        STATE.pack_into(mm, base + 8, state)
        self._flush(base, ENTRY_BYTES)
        SEQ.pack_into(mm, base, seq + 1)
        self._flush(base, SEQ.size)
        stats = self.stats
        if prev == READY:
            stats[0] -= length
            stats[1] -= 1
            U64.pack_into(mm, self.geo.ext_len_offset + slot * 8, 0)
        if (state == EMPTY) != (prev == EMPTY):
            stats[2] += 1 if prev == EMPTY else -1

    def delete_slot(self, slot: int) -> None:
        """Retire a READY entry: EMPTY when it ends its probe chain, else TOMBSTONE."""
        nxt = (slot + 1) & self.geo.mask
        nxt_state = STATE.unpack_from(self.mm, self._base(nxt) + 8)[0]
        self.retire(slot, EMPTY if nxt_state == EMPTY else TOMBSTONE)

    def publish(self, slot: int, key: bytes, offset: int, length: int, atime: int) -> None:
        """Make a (non-READY) slot the READY entry for key (data already in place)."""
        mm, base = self.mm, self._base(slot)
        seq, prev = SEQ.unpack_from(mm, base)[0] | 1, STATE.unpack_from(mm, base + 8)[0]
        stats = self.stats
        stats[0] += length
        stats[1] += 1
        stats[2] += prev == EMPTY
        SEQ.pack_into(mm, base, seq)  # busy
        self._flush(base, SEQ.size)
        final = seq + 1
        esum = entry_sum(final, READY, len(key), offset, length, key)  # the entry checksum, over the final seq
        mm[base + KEY_AT:base + KEY_AT + len(key)] = key
        ENTRY.pack_into(mm, base, seq, READY, len(key), offset, length, atime, esum)
        self._flush(base, ENTRY_BYTES)  # the entry in memory before ...
        SEQ.pack_into(mm, base, final)  # ... the publish flag: an even seq over a READY entry
        self._flush(base, SEQ.size)
        U64.pack_into(mm, self.geo.ext_offset + slot * 8, offset)
        U64.pack_into(mm, self.geo.ext_len_offset + slot * 8, extent_bytes(length))

    def repair(self) -> None:
        """Retire entries a dead writer left mid-update (odd seq): with the lock held no live writer is."""
        odd = np.flatnonzero(self.entries()["seq"] & 1).tolist()
        for slot in odd:
            self.retire(slot, TOMBSTONE)
            self.counters.add("repaired_entries")

    def remove_key(self, key: bytes) -> bool:
        """Retire every READY entry for `key`, damaged ones included (no entry is mid-update)."""
        geo, removed = self.geo, False
        start = xxhash.xxh3_64_intdigest(key) & geo.mask
        for i in range(geo.num_slots):
            slot = (start + i) & geo.mask
            state = STATE.unpack_from(self.mm, self._base(slot) + 8)[0]
            if state == EMPTY:
                break
            if state == READY and self.key_at(slot) == key:
                self.delete_slot(slot)
                removed = True
        return removed

    def insert_slot(self, key: bytes) -> int | None:
        geo = self.geo
        start = xxhash.xxh3_64_intdigest(key) & geo.mask
        for i in range(geo.num_slots):
            slot = (start + i) & geo.mask
            if STATE.unpack_from(self.mm, self._base(slot) + 8)[0] != READY:
                return slot
        return None

    def purge_tombstones(self) -> None:
        """Rebuild the table without tombstones. Readers racing with this see misses, never bad data."""
        index = self.entries()
        ready = np.flatnonzero(index["state"] == READY).tolist()
        occupied = np.flatnonzero(index["state"] != EMPTY).tolist()
        del index
        live = []
        for slot in ready:
            _, _, _, offset, length, atime, _ = ENTRY.unpack_from(self.mm, self._base(slot))
            live.append((self.key_at(slot), offset, length, atime))
        for slot in occupied:
            self.retire(slot, EMPTY)
        for key, offset, length, atime in live:
            slot = self.insert_slot(key)
            if slot is not None:
                self.publish(slot, key, offset, length, atime)
        self.counters.add("purges")

    def clear(self) -> None:
        for slot in np.flatnonzero(self.entries()["state"] != EMPTY).tolist():
            self.retire(slot, EMPTY)

    def validate(self) -> str | None:
        """Retire bad entries, rebuild the extent table and the totals; report what makes the index unusable."""
        self.repair()
        index = self.entries()
        ready = np.flatnonzero(index["state"] == READY)
        for slot in np.flatnonzero(index["state"] > TOMBSTONE).tolist():
            self.retire(slot, TOMBSTONE)
        offsets, lengths = index["offset"][ready], index["length"][ready]
        del index
        good = []
        for slot, off, length in zip(ready.tolist(), offsets.tolist(), lengths.tolist()):
            base = self._base(slot)
            seq, state, key_len, _, _, _, esum = ENTRY.unpack_from(self.mm, base)
            key = self.mm[base + KEY_AT:base + KEY_AT + min(key_len, MAX_KEY_BYTES)]
            if (key_len > MAX_KEY_BYTES or off % ALIGN or off + length > self.geo.data_bytes
                    or esum != entry_sum(seq, state, key_len, off, length, key)):
                self.retire(slot, TOMBSTONE)
                self.counters.add("bad_entries")
            else:
                good.append((off, off + length))
        good.sort()
        for (_, end), (start, _) in zip(good, good[1:]):
            if start < end:
                return "overlapping extents"
        self.rebuild_extents()
        STATS.pack_into(self.mm, STATS_AT, 0, *self.recount())
        return None
