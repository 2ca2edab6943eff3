"""ShmTier: the Tier protocol over a shared-memory pool, composed of an Arena (arena.py), the Index of its
current mapping (index.py) and an Allocator (allocator.py); they share nothing but the counters.

Contract:
- Reads take no lock: find the entry, copy its bytes out, and re-check the entry's seq; if it moved, the extent
  may have been reused and the read is retried (READ_RETRIES times) or is a miss, never a torn blob. `get`
  returns a private copy, `get_into` a view of the caller's scratch; `prefetch` has nothing to start early.
  `get_view` copies nothing: the blob is a view of the pool, and its `is_current()` is that same re-check, for
  the caller to run after it has copied what it needs out (a False means the copy may be torn).
- A put or delete that cannot get the writers' lock within `lock_timeout_s` is dropped and counted, like a full
  write queue; `clear` waits longer and raises rather than pretend it emptied the pool.
- A closed tier (or one whose pool cannot be reached) answers misses, False, [] and zero usage; clear is a no-op.
- Capabilities: untrusted (the stack verifies checksums), writable, persistent, shared by the host's processes,
  keeps itself within its byte budget, never evicts a key this process pinned.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import xxhash

from kvfabric.config import ShmTierConfig
from kvfabric.host.pages import Scratch
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob, TierBase, TierUsage, TierView
from kvfabric.tiers.shm.allocator import Allocator
from kvfabric.tiers.shm.arena import DEFAULT_ROOT, Arena, ShmLockTimeout
from kvfabric.tiers.shm.coherence import CacheOps, cache_ops
from kvfabric.tiers.shm.index import Index
from kvfabric.tiers.shm.layout import MAX_KEY_BYTES, READY, entry_sum, extent_bytes

READ_RETRIES = 4


class ShmTier(TierBase):
    """A KV tier in a /dev/shm pool shared by every engine process on the host (see the package docstring)."""

    name = "shm"
    is_trusted = False
    is_read_only = False
    is_persistent = True
    is_shared = True
    honors_capacity = True
    honors_pins = True
    is_zero_copy = True

    def __init__(self, name: str = "kvfabric", capacity_bytes: int = 2**30, *, root: str | os.PathLike = DEFAULT_ROOT,
                 num_slots: int | None = None, lock_timeout_s: float = 2.0, coherent: bool = True,
                 ops: CacheOps | None = None, strict_permissions: bool = False, recheck_s: float = 1.0) -> None:
        """coherent=False: the publish protocol's flushes and invalidations run (coherence.py); `ops` replaces
        the primitives (a recording shim in the tests). A pool or lock file that grants more than 0600 is a
        warning, an error with `strict_permissions`. `recheck_s`: how soon a pool file removed by hand is noticed
        (one replaced by another kvfabric process is followed at once: arena.py)."""
        self.counters = Counters()
        self.allocator = Allocator(self.counters)
        self.arena = Arena(name, capacity_bytes, root=root, num_slots=num_slots, lock_timeout_s=lock_timeout_s,
                           counters=self.counters, ops=ops or cache_ops(coherent), recheck_s=recheck_s,
                           strict_permissions=strict_permissions)

    @classmethod
    def from_config(cls, config: ShmTierConfig, strict_permissions: bool = False) -> ShmTier:
        return cls(config.name, config.capacity, root=config.root, lock_timeout_s=config.lock_timeout_s,
                   coherent=config.coherent, strict_permissions=strict_permissions)

    @staticmethod
    def destroy(name: str, root: str | os.PathLike = DEFAULT_ROOT) -> None:
        """Remove a pool's files (see Arena.destroy: only when no process uses the pool)."""
        Arena.destroy(name, root)

    @property
    def capacity_bytes(self) -> int:
        return self.arena.capacity_bytes

    # ---- reads -------------------------------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys or (index := self.arena.refresh()) is None:
            return [False] * len(keys)
        try:
            return [index.find(key) is not None for key in keys]
        except ValueError:  # closed under us by close()
            return [False] * len(keys)

    def get(self, key: bytes) -> Blob | None:
        return self._read(key, None)

    def get_into(self, key: bytes, scratch: Scratch) -> memoryview | None:
        """Like `get`, but copy into `scratch` (no allocation, no page faults); valid until scratch is reused."""
        return self._read(key, scratch)  # type: ignore[return-value]

    def get_view(self, key: bytes) -> TierView | None:
        """The blob in place (no copy), with the re-check of its entry for after the caller has used it."""
        if (index := self.arena.refresh()) is None:
            return None
        try:
            ref = index.find(key)
            if ref is None:
                return None
            view = self.arena.view(index, ref)
        except ValueError:  # closed under us by close()
            return None
        index.touch(ref.slot)

        def is_current() -> bool:
            try:
                if index.is_current(ref):
                    return True
            except ValueError:  # unmapped meanwhile: the view's bytes are no longer the pool's
                pass
            self.counters.add("view_reused")
            return False
        return TierView(view, is_current)

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Nothing to start early: a read is one copy out of memory."""

    def _read(self, key: bytes, scratch: Scratch | None) -> Blob | None:
        if (index := self.arena.refresh()) is None:
            return None
        try:
            for _ in range(READ_RETRIES):
                ref = index.find(key)
                if ref is None:
                    return None
                blob = self.arena.read(index, ref, scratch)
                if index.recheck(ref):  # not retired while we copied: the bytes are that entry's (and touched)
                    return blob
                self.counters.add("read_retries")
        except ValueError:  # closed under us by close()
            pass
        return None

    def keys(self) -> list[bytes]:
        index = self.arena.refresh()
        return [] if index is None else index.ready_keys()

    def usage(self) -> TierUsage:
        if (index := self.arena.refresh()) is None:
            return TierUsage(self.name, 0, 0, self.capacity_bytes)
        entries = index.entries()
        ready = entries["state"] == READY
        num_chunks, num_bytes = int(np.count_nonzero(ready)), int(entries["length"][ready].sum())
        del entries, ready
        return TierUsage(self.name, num_chunks, num_bytes, self.capacity_bytes)

    # ---- writes ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _writing(self, timeout_s: float | None = None) -> Iterator[Index | None]:
        """The writers' lock and an index change on the current mapping; None if the pool cannot be reached."""
        if self.arena.is_closed:  # (the pool is followed once, under the lock: a stat a write, not two)
            yield None
            return
        with self.arena.locked(timeout_s):
            index = self.arena.refresh()  # another process may have replaced the pool while we waited
            if index is None:
                yield None
                return
            with index.writing():
                yield index

    def put(self, key: bytes, blob: Blob) -> bool:
        view = memoryview(blob)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        size = view.nbytes
        if len(key) > MAX_KEY_BYTES or size > self.capacity_bytes:
            self.counters.add("put.rejected")
            return False
        if self.arena.is_closed:
            return False
        try:
            self.arena.acquire()  # (not `with _writing()`: the generators' frames cost as much as the index work)
        except ShmLockTimeout:
            self.counters.add("put.lock_timeout")
            return False
        try:
            if (index := self.arena.refresh()) is None:  # another process may have replaced the pool meanwhile
                return False
            went = self._put_compiled(index, key, view, size) if index.is_plain else "repair"
            if went == "done":
                return True
            with index.writing(resumed=went == "resume"):
                return self._put(index, key, view, size)
        finally:
            self.arena.release()

    def _put_compiled(self, index: Index, key: bytes, view: memoryview, size: int) -> str:
        """The put through index_kernel (coherent memory, lock held): "done"; "resume" when entries must be evicted
        (the Python path goes on, the dirty flag already set); "repair" when a dead writer's change must be
        repaired first (nothing done)."""
        kernel, geo = index.kernel(), index.geo
        w64, w32, w8 = index.words()
        starts, stops = self.allocator.fit_scratch(geo.num_slots)
        need = extent_bytes(size)
        status, slot, offset, seq = kernel.reserve(
            w64, w32, w8, key, xxhash.xxh3_64_intdigest(key) & geo.mask, size, need, geo.num_slots,
            geo.index_offset, geo.ext_offset, geo.ext_len_offset, geo.data_bytes, geo.capacity, geo.max_used,
            starts, stops)
        if status != kernel.OK:
            return "repair" if status == kernel.DIRTY else "resume"
        esum = entry_sum(seq, READY, len(key), offset, size, key)
        self.arena.write(index, offset, view)  # data first ...
        kernel.publish(w64, w32, w8, slot, key, offset, size, need, time.monotonic_ns(),  # ... then the entry
                       esum - (esum >> 63 << 64), geo.index_offset, geo.ext_offset, geo.ext_len_offset)  # as int64
        return "done"

    def _put(self, index: Index, key: bytes, view: memoryview, size: int) -> bool:
        index.remove_key(key)  # a reader sees the old blob or none until the new one is published, never a mix
        offset = self.allocator.make_room(index, size)
        slot = index.insert_slot(key) if offset is not None else None
        if offset is None or slot is None:  # everything left to evict is pinned
            self.counters.add("put.no_room")
            return False
        self.arena.write(index, offset, view)  # data first ...
        index.publish(slot, key, offset, size, time.monotonic_ns())  # ... then the entry that points at it
        return True

    def delete(self, key: bytes) -> bool:
        try:
            with self._writing() as index:
                return index is not None and index.remove_key(key)
        except ShmLockTimeout:
            self.counters.add("delete.lock_timeout")
            return False

    def pin(self, keys: Iterable[bytes]) -> None:
        self.allocator.pin(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        self.allocator.unpin(keys)

    def clear(self) -> None:
        """Empty the pool for every process sharing it."""
        with self._writing(max(30.0, self.arena.lock_timeout_s)) as index:  # raises if it cannot: clear must not lie
            if index is not None:
                index.clear()

    def close(self) -> None:
        """Unmap the pool; its contents stay for other and later processes."""
        self.arena.close()
