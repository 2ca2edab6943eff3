"""Shared-memory tier: one KV pool in /dev/shm shared by every engine process on the host.

The single-host analogue of a CXL shared memory pool: a chunk stored by one process is read by another with one
memcpy out of the shared mapping, no socket and no serialization.

    layout.py  the pool file's bytes: header, index entries, extent table, arena; checksums and geometry
    index.py   the seqlocked hash index: lock-free lookups, entry publish/retire, totals and crash recovery
    space.py   eviction (LRU, pins, table load) and first-fit allocation of arena extents
    pool.py    the pool file and its mapping: create, validate, replace, remap; the writers' lock; fork safety
    tier.py    ShmTier, the Tier protocol on top of these

Contract:
- Writers (put, delete, eviction, clear) hold `fcntl.flock` on `<root>/kvfabric-<name>.lock` (the kernel releases
  it when a process dies, even by SIGKILL) plus a thread lock. A writer copies the blob into a free extent first,
  then publishes the entry; an extent is reused only after the entry pointing at it was retired.
- A writer waits at most `lock_timeout_s` for the lock (a stopped process may hold it); then the put is dropped
  and counted (`counters`), like a full write queue. Readers never wait for writers.
- Every entry update is a seqlock: seq becomes odd, the fields change, seq becomes even again. Readers take no
  lock: they read an entry between two equal even seqs, copy the blob out, and re-read seq; if it moved, the extent
  may have been reused and the read is retried or is a miss. So a reader never returns a torn or half-written blob,
  even when a writer is killed mid-write: unpublished data is unreachable, and an entry left with an odd seq is
  retired by the next writer: a writer sets the header's dirty flag while it changes the index and clears it when
  done, so a set flag found under the lock means one died mid-change (then odd entries are retired and the totals
  recounted). (Ordering relies on the host keeping stores in order, as x86-64 does.)
- `get` returns a private copy (`bytes`; from 16 MiB a memoryview over a private huge-page mapping, 3x faster
  than faulting in a fresh heap object) and `get_into` copies into the caller's scratch buffer (the stack's fast
  path: no allocation); nothing handed out points into the arena.
- One `ShmTier` per process and pool name: a forked child gets its own lock file description automatically.
- The byte budget (`capacity_bytes`) bounds the sum of stored blob sizes; least recently used entries (atime =
  CLOCK_MONOTONIC of the last read or write, shared by all processes) are evicted first. The arena is 25% larger
  than the budget so fragmentation rarely forces extra evictions; when it does, more LRU entries go. Pins are
  per process (a pin stored in shared memory would leak when its process dies): this process never evicts its
  pinned keys, other processes may; readers then get a clean miss.
- The pool survives process restarts: opening validates the header and every entry (bad entries are retired,
  overlapping extents reset the pool). A header with a bad magic, version, checksum or size, or a budget that
  differs from this tier's, is replaced by a fresh pool (with a warning): the new file is built aside and renamed
  over the old one, so processes still mapping the old file never fault; they notice the new inode and remap.
- Space for the whole file is reserved at creation (posix_fallocate), so a full /dev/shm fails `ShmTier(...)`
  with an error instead of killing a writer with SIGBUS later.
- Not trusted: the stack verifies each blob's checksums (a corrupted arena is a counted miss).
"""
from __future__ import annotations

import os  # noqa: F401  (tests patch os functions through this module)
from pathlib import Path  # noqa: F401  (tests build expected paths with it)

from kvfabric.tiers.shm.layout import (_SEQ, _STATS, ALIGN, EMPTY, ENTRY_BYTES, HEADER_BYTES, KEY_AT, MAGIC,
                                       MAX_KEY_BYTES, READY, STATS_AT, TOMBSTONE, VERSION, _extent,
                                       default_num_slots)
from kvfabric.tiers.shm.pool import DEFAULT_ROOT, ShmLockTimeout, ShmPoolError
from kvfabric.tiers.shm.tier import LARGE_COPY_BYTES, ShmTier

__all__ = ["DEFAULT_ROOT", "LARGE_COPY_BYTES", "ShmLockTimeout", "ShmPoolError", "ShmTier", "default_num_slots"]
