"""Shared-memory tier: one KV pool in /dev/shm shared by every engine process on the host.

The single-host analogue of a CXL shared memory pool: a chunk stored by one process is read by another with one
memcpy out of the shared mapping, no socket and no serialization.

    layout.py     the pool file's bytes: header, index entries, extent table, arena; checksums and geometry
    index.py      Index: one mapping's seqlocked hash index: lock-free lookups, entry publish/retire, totals,
                  crash recovery and validation
    allocator.py  Allocator: eviction (LRU, this process's pins, table load) and first-fit arena extents
    fit.py        first_fit: the free-extent search of every put, compiled (numba, loaded on the first put)
    index_kernel.py  the index's steps on coherent memory compiled: a put's reserve and publish, a read's find
                  and recheck (numba, loaded on the first use; the Python methods stay for other memory)
    arena.py      Arena: the pool file and its mapping (create, validate, replace, remap: a superseded flag in
                  the old file), the writers' lock, fork safety, copies into and out of the data region
    tier.py       ShmTier, the Tier protocol composed of the three (no shared state but the counters)
    coherence.py  the cache-maintenance primitives (flush, fence, invalidate): no-ops on coherent memory

Publish protocol (a put; the writers' lock held). A slot's entry is seqlocked: an odd seq means busy, and a
READY entry under an even seq is the publish flag. Steps in order ("flush+fence": coherence.py; no-ops unless
`coherent=False`):
    W1  header dirty flag set; flush+fence           (a writer dying from here on is repaired by the next one)
    W2  old entries of the key retired: seq odd, flush+fence; state TOMBSTONE, flush+fence; seq even, flush+fence
    W3  payload copied into a free extent: the chunk blob, which carries its own checksums; flush+fence
    W4  entry seq made odd; flush+fence
    W5  entry fields written with their checksum `esum` (over the final even seq, the key, offset, length);
        flush+fence: payload and entry are in memory before ...
    W6  ... the publish flag: seq even; flush+fence
    W7  header dirty flag cleared; flush+fence
A reader (no lock): R1 invalidates and reads the entry, which counts only between two equal even seqs, READY,
with a matching esum and an extent inside the arena; R2 invalidates and copies the payload; R3 invalidates the
entry's seq and re-reads it: changed means the extent may have been reused (retry, else a miss); R4 the stack
verifies the blob's checksums (a bad blob is a miss). A writer killed at any step leaves either no READY entry
for the key or a complete one, never a torn read; the dirty flag makes the next writer retire odd entries.
On coherent memory (one host's /dev/shm) the flushes, fences and invalidations are no-ops: x86-64 keeps the
stores in order. The writers' lock is a host-local flock: across hosts that share non-coherent memory, one
host writes a pool (a pool-resident lock is not implemented).

Contract (each module states its part):
- Readers take no lock and never wait for writers; every entry update is a seqlock, and a reader re-checks the
  entry after copying, so it never returns a torn or half-written blob, even when a writer is killed mid-write
  (an entry left odd by a dead writer is retired by the next one, which sees the header's dirty flag).
  Ordering relies on the host keeping stores in order, as x86-64 does.
- Writers hold flock on the pool's lock file (released by the kernel when a process dies) for at most
  `lock_timeout_s`; a put that cannot get it is dropped and counted, like a full write queue.
- The byte budget bounds the stored bytes (LRU eviction across processes); pins are per process.
- The pool survives process restarts; a damaged or foreign pool is replaced by a fresh one, and processes still
  mapping the old file follow the new one.
- Not trusted: the stack verifies each blob's checksums (a corrupted arena is a counted miss).
"""

from __future__ import annotations

from kvfabric.tiers.shm.arena import DEFAULT_ROOT, ShmLockTimeout, ShmPoolError
from kvfabric.tiers.shm.tier import ShmTier

__all__ = ["DEFAULT_ROOT", "ShmLockTimeout", "ShmPoolError", "ShmTier"]
