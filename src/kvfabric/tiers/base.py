"""The Tier protocol, and the byte-bounded LRU index that tiers share.

Contract for every tier (tests/tier_contract.py runs one suite on each implementation):
- Values are chunk blobs (codec.format): opaque bytes to the tier. `put` then `get` returns the same bytes, or
  None once the entry was evicted, deleted or found damaged; `get` never raises for a missing key.
- `capacity_bytes` bounds the sum of stored blob sizes; when a put would exceed it the least recently used
  entries go first. Pinned keys are never evicted (a retrieve in progress pins what it reads).
- `is_trusted`: the tier hands back exactly the object this process stored (process memory), so the payload
  checksum need not be recomputed on read. Every other tier's blobs are verified by the stack on read.
- All methods are safe to call from several threads.
- Optional fast path `get_into(key, scratch)`: read the blob into a reusable buffer instead of a fresh one
  (fresh large allocations cost ~1 GB/s of page faults on small machines); the view is valid until the scratch
  buffer is reused.
"""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

Blob = bytes | bytearray | memoryview


class Scratch:
    """A reusable byte buffer that grows on demand (never shrinks)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def view(self, size: int) -> memoryview:
        if len(self._buf) < size:
            self._buf = bytearray(size)
        return memoryview(self._buf)[:size]


@dataclass(frozen=True, slots=True)
class TierUsage:
    name: str
    num_chunks: int
    num_bytes: int
    capacity_bytes: int


class Tier(Protocol):
    name: str
    is_trusted: bool
    capacity_bytes: int

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    def get(self, key: bytes) -> Blob | None: ...

    def put(self, key: bytes, blob: Blob) -> bool: ...

    def delete(self, key: bytes) -> bool: ...

    def keys(self) -> list[bytes]: ...

    def usage(self) -> TierUsage: ...

    def pin(self, keys: Iterable[bytes]) -> None: ...

    def unpin(self, keys: Iterable[bytes]) -> None: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


def prefix_length(tier: Tier, keys: Sequence[bytes]) -> int:
    """Number of leading keys present in `tier` (one batched call)."""
    for i, hit in enumerate(tier.contains_many(keys)):
        if not hit:
            return i
    return len(keys)


class LRUIndex:
    """Byte-bounded LRU bookkeeping (no data): key -> size, oldest first, with pin counts."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._pins: Counter[bytes] = Counter()
        self.lock = threading.RLock()

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[bytes]:
        with self.lock:
            return list(self._sizes)

    def touch(self, key: bytes) -> bool:
        with self.lock:
            if key not in self._sizes:
                return False
            self._sizes.move_to_end(key)
            return True

    def can_fit(self, size: int) -> bool:
        return size <= self.capacity_bytes

    def add(self, key: bytes, size: int) -> list[bytes]:
        """Record `key` as most recent; return the keys evicted to make room (caller frees their data)."""
        with self.lock:
            self.num_bytes -= self._sizes.pop(key, 0)
            self._sizes[key] = size
            self.num_bytes += size
            victims: list[bytes] = []
            for old in list(self._sizes):
                if self.num_bytes <= self.capacity_bytes:
                    break
                if old == key or self._pins[old] > 0:
                    continue  # pinned entries stay; the budget is exceeded until they are unpinned
                self.num_bytes -= self._sizes.pop(old)
                victims.append(old)
            return victims

    def remove(self, key: bytes) -> bool:
        with self.lock:
            size = self._sizes.pop(key, None)
            if size is None:
                return False
            self.num_bytes -= size
            return True

    def pin(self, keys: Iterable[bytes]) -> None:
        with self.lock:
            self._pins.update(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        with self.lock:
            self._pins.subtract(keys)
            self._pins = +self._pins  # drop zero counts so the counter does not grow without bound

    def clear(self) -> None:
        with self.lock:
            self._sizes.clear()
            self.num_bytes = 0


class IndexedTier:
    """Shared bookkeeping methods for tiers whose entries are tracked by an `LRUIndex` in `self._index`."""

    name: str
    capacity_bytes: int
    _index: LRUIndex

    def keys(self) -> list[bytes]:
        return self._index.keys()

    def usage(self) -> TierUsage:
        return TierUsage(self.name, len(self._index), self._index.num_bytes, self.capacity_bytes)

    def pin(self, keys: Iterable[bytes]) -> None:
        self._index.pin(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        self._index.unpin(keys)
