"""CPU tier: chunk blobs in this process's memory, byte-bounded LRU.

Trusted (`is_trusted`): it returns the very object that was put, so readers skip the payload checksum.
A reader holding a blob keeps it alive after eviction (Python references), and pinned keys are not evicted.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvfabric.tiers.base import Blob, IndexedTier, LRUIndex


class CpuTier(IndexedTier):
    name = "cpu"
    is_trusted = True
    is_read_only = False
    is_persistent = False
    is_shared = False
    honors_capacity = True
    honors_pins = True

    def __init__(self, capacity_bytes: int) -> None:
        self._index = LRUIndex(capacity_bytes)
        self._blobs: dict[bytes, Blob] = {}
        self.capacity_bytes = capacity_bytes

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        blobs = self._blobs
        return [key in blobs for key in keys]

    def get(self, key: bytes) -> Blob | None:
        with self._index.lock:
            blob = self._blobs.get(key)
            if blob is not None:
                self._index.touch(key)
            return blob

    def put(self, key: bytes, blob: Blob) -> bool:
        if not self._index.can_fit(len(blob)):
            return False
        with self._index.lock:
            self._blobs[key] = blob
            for victim in self._index.add(key, len(blob)):
                del self._blobs[victim]
        return True

    def delete(self, key: bytes) -> bool:
        with self._index.lock:
            self._blobs.pop(key, None)
            return self._index.remove(key)

    def clear(self) -> None:
        with self._index.lock:
            self._blobs.clear()
            self._index.clear()

    def close(self) -> None:
        self.clear()
