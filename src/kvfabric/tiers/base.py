"""The Tier protocol, its default methods (`TierBase`), and `PolicyTier`, the base of tiers whose entries a
`PolicyIndex` (tiers/policies) tracks.

Contract for every tier (tests/tier_contract.py runs one suite on each implementation):
- Values are chunk blobs (codec.format): opaque bytes to the tier. `put` then `get` returns the same bytes, or
  None once the entry was evicted, deleted or found damaged; `get` never raises for a missing key.
- What a tier can promise is declared as class attributes, never discovered at run time:
  `is_trusted`       it hands back exactly the object this process stored (process memory), so the payload
                     checksum need not be recomputed on read; every other tier's blobs are verified by the stack;
  `is_read_only`     this process never writes it (a peer): `put` stores nothing and returns False;
  `is_persistent`    what it holds survives a process restart (a new instance over the same storage sees it);
  `is_shared`        other processes (other instances over the same storage) see what is stored;
  `honors_capacity`  it evicts entries itself (by its eviction policy; LRU where it has no choice) to keep stored
                     bytes within `capacity_bytes` (a Redis server evicts by its own maxmemory instead), and
                     refuses a blob larger than that;
  `honors_pins`      a key this process pinned is never evicted by this process (a retrieve pins what it reads).
- `get_into(key, scratch)` reads the blob into a reusable buffer instead of a fresh one (the page faults of fresh
  large allocations are slow on small machines); the view is valid until the scratch buffer is reused.
  `prefetch(keys)` is a hint to start reading keys that `get` will ask for; `file_of(key)` names the file holding
  a chunk when the tier keeps each chunk as an immutable file (the peer server sends it with sendfile).
  `new_blob(size)` is a buffer for a blob that will be put here (the cpu tier recycles the buffers of chunks it
  dropped once nothing else references them, so a store does not page-fault fresh memory in).
  `get_view(key)` (only where `is_zero_copy`: the shm pool) gives a `TierView`: the blob as a view of memory the
  tier shares with other processes, no copy at all, and `is_current()`, which says whether the bytes are still
  that entry's. A writer may reuse the memory at any time, so a caller copies what it needs out of the view and
  then checks `is_current()`: False means the copy may be torn and must be thrown away.
  `open_ranged(key)` (only where `is_ranged`: the disk tier) gives a `RangedBlob`: the blob read piece by piece
  (`read_into(offset, buf)`), so that a reader copies each piece on while it is in cache; the caller closes it.
  `TierBase` gives the defaults: get_into returns get(key), get_view raises (`is_zero_copy` is False), prefetch
  does nothing, file_of is None, new_blob is fresh memory, `is_policy_driven` is False, and the batch calls
  `put_many(items)` / `get_many_into(keys, scratches)` loop over put / get_into (a remote tier overrides them
  with one round trip).
- `is_policy_driven` (a `PolicyTier`: cpu, disk): eviction and admission are pluggable policies; `get`,
  `get_into` and `put` take a keyword `meta` (`AccessMeta`: the chunk's position in its prompt, its miss cost),
  `put` may refuse a chunk its admission policy rejects (False), and `set_evict_listener` hands evicted chunks
  to the stack (demotion). The stack passes `meta` only to such tiers.
- All methods are safe to call from several threads.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvfabric.host.pages import Scratch
from kvfabric.observe.counters import Counters
from kvfabric.tiers.policies import IndexStats, PolicyIndex

Blob = bytes | bytearray | memoryview
EvictListener = Callable[[bytes, "Blob"], None]


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
    is_zero_copy: bool
    is_ranged: bool

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    def get(self, key: bytes) -> Blob | None: ...

    def premap(self, size: int) -> None:
        """Blobs of `size` bytes will be asked for (`new_blob`): map them ahead, off the caller's thread (by default
        nothing: only the cpu tier recycles its buffers)."""

    def pause_premap(self, is_paused: bool) -> None:
        """While paused, premapping waits (the caller's hot work runs)."""

    def get_into(self, key: bytes, scratch: Scratch) -> Blob | None: ...

    def get_view(self, key: bytes) -> TierView | None: ...

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


class RangedBlob(Protocol):
    """A blob read piece by piece (`Tier.open_ranged`): `size` bytes in all; `read_into(offset, buf)` fills buf with
    bytes [offset, offset + len(buf)) and says whether it could (False: the blob is shorter or unreadable). `fd`:
    the open file it reads (a native reader may pread it directly), or -1."""
    size: int
    fd: int

    def read_into(self, offset: int, buf: memoryview) -> bool: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TierView:
    """A blob read in place (`Tier.get_view`): `blob` is a view of shared memory, valid to read until a writer
    reuses it; `is_current()` after the reader has copied what it needs says whether that happened meanwhile."""
    blob: memoryview
    is_current: Callable[[], bool]


class TierBase:
    """Defaults for the optional methods of the Tier protocol; tiers override what they do better. (The
    declarations have no defaults: every tier states each one; `is_policy_driven` and `is_zero_copy` are False
    unless the tier is a `PolicyTier` / reads in place.)"""

    is_policy_driven = False
    is_zero_copy = False
    is_ranged = False

    def get_view(self, key: bytes) -> TierView | None:
        """Only on a tier that `is_zero_copy`."""
        raise NotImplementedError(f"{type(self).__name__} does not read in place")

    def open_ranged(self, key: bytes) -> RangedBlob | None:
        """Only on a tier that `is_ranged`."""
        raise NotImplementedError(f"{type(self).__name__} does not read by ranges")

    def new_blob(self, size: int) -> bytearray:
        """A writable buffer of `size` bytes for a blob that will be put here; by default fresh memory (the cpu
        tier hands out recycled buffers)."""
        return bytearray(size)

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

    def premap(self, size: int) -> None:
        """A hint that `new_blob(size)` will be asked for; by default nothing to map ahead (fresh memory)."""

    def pause_premap(self, is_paused: bool) -> None:
        """By default nothing is premapped, so nothing to pause."""

    def file_of(self, key: bytes) -> Path | None:
        """The immutable file holding this chunk, if the tier keeps chunks as files; by default None."""
        return None


class PolicyTier(TierBase):
    """Shared bookkeeping of the tiers whose entries a `PolicyIndex` tracks (`self._index`: byte budget, pins,
    pluggable eviction and admission): cpu and disk. They take each access's `AccessMeta` (position in the
    prompt, miss cost) on get / get_into / put, and hand each evicted chunk to the listener set with
    `set_evict_listener` (the stack demotes it to the next tier), after its bookkeeping is done and before its
    data is freed."""

    is_policy_driven = True
    name: str
    capacity_bytes: int
    _index: PolicyIndex
    _events: Counters
    _evict_listener: EvictListener | None = None

    def set_evict_listener(self, listener: EvictListener | None) -> None:
        """`listener(key, blob)` runs for each chunk this tier evicts to make room (not for deletes or clear),
        under the tier's lock: it must not block (the stack only queues a write)."""
        self._evict_listener = listener

    def keys(self) -> list[bytes]:
        return self._index.keys()

    @property
    def counters(self) -> Counters:
        """The tier's own counters (metrics), a snapshot: its events (`_events`, made by the tier) and "evicted"
        (the index's evictions)."""
        return Counters({**self._events.snapshot(), "evicted": self._index.num_evicted})

    def usage(self) -> TierUsage:
        return TierUsage(self.name, len(self._index), self._index.num_bytes, self.capacity_bytes)

    def index_stats(self) -> IndexStats:
        """Hits, admissions, refusals and evictions counted by the tier's index."""
        return self._index.stats()

    def pin(self, keys: Iterable[bytes]) -> None:
        self._index.pin(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        self._index.unpin(keys)
