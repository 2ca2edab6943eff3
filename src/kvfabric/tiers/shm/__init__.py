"""Shared-memory tier: one KV pool in /dev/shm shared by every engine process on the host.

The single-host analogue of a CXL shared memory pool: a chunk stored by one process is read by another with one
memcpy out of the shared mapping, no socket and no serialization.

    layout.py     the pool file's bytes: header, index entries, extent table, arena; checksums and geometry
    index.py      Index: one mapping's seqlocked hash index: lock-free lookups, entry publish/retire, totals,
                  crash recovery and validation
    allocator.py  Allocator: eviction (LRU, this process's pins, table load) and first-fit arena extents
    arena.py      Arena: the pool file and its mapping (create, validate, replace, remap), the writers' lock,
                  fork safety, copies into and out of the data region
    tier.py       ShmTier, the Tier protocol composed of the three (no shared state but the counters)

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
