"""CPU tier: chunk blobs in this process's memory, byte-bounded, with pluggable eviction and admission policies.

Trusted (`is_trusted`): it returns the very object that was put, so readers skip the payload checksum.
A reader holding a blob keeps it alive after eviction (Python references), and pinned keys are not evicted.
`new_blob` hands out buffers of dropped chunks (tiers/pool.py): the pool never recycles a buffer that a reader,
a view, or a queued write to a slower tier still references, and the tier's chunks plus its free buffers stay
within 1.125 x `capacity_bytes` plus two buffers (the free ones within what the chunks leave, or an eighth).
With `premap_bytes`, once `premap(size)` names a full chunk's blob size, up to that many free buffers of it are
mapped ahead of the stores by a background thread (tiers/pool.py), so a store into a tier that is still filling
up faults no fresh pages (the vLLM worker asks at attach; an in-process engine only if its owner calls it).
"""
from __future__ import annotations

from collections.abc import Sequence

from kvfabric.codec.format import HEADER_BYTES
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob, PolicyTier
from kvfabric.tiers.policies import NO_META, AccessMeta, EvictionPolicy, make_index
from kvfabric.tiers.pool import BlobPool


class CpuTier(PolicyTier):
    name = "cpu"
    is_trusted = True
    is_read_only = False
    is_persistent = False
    is_shared = False
    honors_capacity = True
    honors_pins = True

    def __init__(self, capacity_bytes: int, eviction: str | EvictionPolicy = "lru",
                 admission: str = "always", premap_bytes: int = 0) -> None:
        self._index = make_index(capacity_bytes, eviction, admission, on_evict=self._evicted)
        self._blobs: dict[bytes, Blob] = {}
        self._events = Counters()
        self.capacity_bytes = capacity_bytes
        # Free buffers: what the chunks leave of the capacity, and at least an eighth of it, so that a full tier
        # recycles its victims (a store takes its buffer before the put that evicts one).
        self.pool = BlobPool(lambda: max(self.capacity_bytes - self._index.num_bytes, self.capacity_bytes // 8),
                             align_offset=HEADER_BYTES, premap_bytes=premap_bytes)

    def new_blob(self, size: int) -> memoryview:
        return self.pool.take(size)

    def premap(self, size: int) -> None:
        self.pool.expect(size)

    def pause_premap(self, is_paused: bool) -> None:
        self.pool.pause(is_paused)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        blobs = self._blobs
        return [key in blobs for key in keys]

    def get(self, key: bytes, meta: AccessMeta = NO_META) -> Blob | None:
        with self._index.lock:
            blob = self._blobs.get(key)
            if blob is not None:
                self._index.touch(key, meta)
            return blob

    def get_into(self, key: bytes, scratch: object = None, meta: AccessMeta = NO_META) -> Blob | None:
        """The stored blob itself: copying it into the scratch buffer would only add a copy."""
        return self.get(key, meta)

    def put(self, key: bytes, blob: Blob, meta: AccessMeta = NO_META) -> bool:
        if not self._index.can_fit(len(blob)):
            return False
        with self._index.lock:
            old = self._blobs.pop(key, None)
            if old is not None and old is not blob:
                self.pool.give(old)
            if not self._index.add(key, len(blob), meta):  # refused (admission, pins) or a resident key dropped
                return False
            self._blobs[key] = blob
        return True

    def _evicted(self, key: bytes) -> None:
        """The index evicted `key` (under its lock): hand the blob to the listener (demotion), then recycle it."""
        blob = self._blobs.pop(key)
        if self._evict_listener is not None:
            self._evict_listener(key, blob)
        self.pool.give(blob)

    def delete(self, key: bytes) -> bool:
        with self._index.lock:
            blob = self._blobs.pop(key, None)
            if blob is not None:
                self.pool.give(blob)
            return self._index.remove(key)

    def clear(self) -> None:
        with self._index.lock:
            blobs = list(self._blobs.values())
            self._blobs.clear()
            self._index.clear()
            for blob in blobs:
                self.pool.give(blob)

    def close(self) -> None:
        self.clear()
        self.pool.close()
