"""The Tier protocol, its default methods (`TierBase`), and the byte-bounded LRU index that tiers share.

Contract for every tier (tests/tier_contract.py runs one suite on each implementation):
- Values are chunk blobs (codec.format): opaque bytes to the tier. `put` then `get` returns the same bytes, or
  None once the entry was evicted, deleted or found damaged; `get` never raises for a missing key.
- What a tier can promise is declared as class attributes, never discovered at run time:
  `is_trusted`       it hands back exactly the object this process stored (process memory), so the payload
                     checksum need not be recomputed on read; every other tier's blobs are verified by the stack;
  `is_read_only`     this process never writes it (a peer): `put` stores nothing and returns False;
  `is_persistent`    what it holds survives a process restart (a new instance over the same storage sees it);
  `is_shared`        other processes (other instances over the same storage) see what is stored;
  `honors_capacity`  it evicts least recently used entries itself to keep stored bytes within `capacity_bytes`
                     (a Redis server evicts by its own maxmemory instead), and refuses a blob larger than that;
  `honors_pins`      a key this process pinned is never evicted by this process (a retrieve pins what it reads).
- `get_into(key, scratch)` reads the blob into a reusable buffer instead of a fresh one (fresh large allocations
  cost ~1 GB/s of page faults on small machines); the view is valid until the scratch buffer is reused.
  `prefetch(keys)` is a hint to start reading keys that `get` will ask for; `file_of(key)` names the file holding
  a chunk when the tier keeps each chunk as an immutable file (the peer server sends it with sendfile).
  `TierBase` gives the defaults: get_into returns get(key), prefetch does nothing, file_of is None, and the batch
  calls `put_many(items)` / `get_many_into(keys, scratches)` loop over put / get_into (a remote tier overrides
  them with one round trip).
- All methods are safe to call from several threads.
"""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvfabric.counters import Counters

Blob = bytes | bytearray | memoryview


class Scratch:
    """A reusable byte buffer that grows on demand (never shrinks)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def view(self, size: int) -> memoryview:
        if len(self._buf) < size:
            self._buf = bytearray(size)
        return memoryview(self._buf)[:size]

    def discard(self) -> None:
        """Let go of the buffer: a read that gave up waiting may still write into it. The next `view` allocates a
        fresh one (the abandoned one lives on for as long as that late writer holds it)."""
        self._buf = bytearray()


@dataclass(frozen=True, slots=True)
class TierUsage:
    name: str
    num_chunks: int
    num_bytes: int
    capacity_bytes: int


class Tier(Protocol):
    name: str
    capacity_bytes: int
    is_trusted: bool
    is_read_only: bool
    is_persistent: bool
    is_shared: bool
    honors_capacity: bool
    honors_pins: bool

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    def get(self, key: bytes) -> Blob | None: ...

    def get_into(self, key: bytes, scratch: Scratch) -> Blob | None: ...

    def prefetch(self, keys: Sequence[bytes]) -> None: ...

    def file_of(self, key: bytes) -> Path | None: ...

    def put(self, key: bytes, blob: Blob) -> bool: ...

    def delete(self, key: bytes) -> bool: ...

    def keys(self) -> list[bytes]: ...

    def usage(self) -> TierUsage: ...

    def pin(self, keys: Iterable[bytes]) -> None: ...

    def unpin(self, keys: Iterable[bytes]) -> None: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


class TierBase:
    """Defaults for the optional methods of the Tier protocol; tiers override what they do better. (The
    declarations have no defaults: every tier states each one.)"""

    def get_into(self, key: bytes, scratch: Scratch) -> Blob | None:
        """By default `get(key)`: a blob of its own is valid for longer than the contract asks, and copying it
        into the scratch would only add a copy (process memory, Redis and peers hand out fresh objects)."""
        return self.get(key)  # type: ignore[attr-defined]

    def put_many(self, items: Sequence[tuple[bytes, Blob]]) -> list[bool]:
        """`put` of each (key, blob); by default one by one."""
        return [self.put(key, blob) for key, blob in items]  # type: ignore[attr-defined]

    def get_many_into(self, keys: Sequence[bytes], scratches: Sequence[Scratch]) -> list[Blob | None]:
        """`get_into(key, scratch)` for each pair (one scratch per key); by default one by one."""
        return [self.get_into(key, scratch) for key, scratch in zip(keys, scratches, strict=True)]

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """A hint that `get` will soon ask for these keys; by default nothing to do."""

    def file_of(self, key: bytes) -> Path | None:
        """The immutable file holding this chunk, if the tier keeps chunks as files; by default None."""
        return None


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
        self.counters = Counters()  # "evicted": keys dropped to stay within capacity

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
            if victims:
                self.counters.add("evicted", len(victims))
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


class IndexedTier(TierBase):
    """Shared bookkeeping methods for tiers whose entries are tracked by an `LRUIndex` in `self._index`."""

    name: str
    capacity_bytes: int
    _index: LRUIndex

    def keys(self) -> list[bytes]:
        return self._index.keys()

    @property
    def counters(self) -> Counters:
        """The tier's own counters (metrics): evictions."""
        return self._index.counters

    def usage(self) -> TierUsage:
        return TierUsage(self.name, len(self._index), self._index.num_bytes, self.capacity_bytes)

    def pin(self, keys: Iterable[bytes]) -> None:
        self._index.pin(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        self._index.unpin(keys)
