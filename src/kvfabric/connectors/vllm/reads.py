"""Chunk reads for the worker's loads: key -> KV [L, 2, H, C, D] held until the step ends.

Contract:
- `read(key)` is ``CacheEngine.read_chunk``: a ``ChunkHit`` or a ``ChunkMiss`` (missing, corrupt, wrong_layout; a
  chunk that fails its checks is discarded and counted by the engine). The worker's counters get
  ``load_<reason>_chunks`` per miss and ``bytes_loaded.<tier>`` per hit. Nothing here raises for a bad cache
  entry, and nothing can crash the process: files are read with plain reads into process memory (a memory-mapped
  chunk file truncated by another process would raise SIGBUS on access instead).
- Raw-codec chunks come back as zero-copy views (the scatter copies each layer once, straight into the paged cache).
- Buffers: a chunk read from the first tier (when that tier reads into a buffer, e.g. disk or shm first) lands in
  a reusable ``Scratch`` instead of a fresh allocation (fresh large allocations cost page faults at ~1 GB/s on
  small machines). Every chunk of a step is held until its last layer is scattered, so each chunk read gets its
  own buffer: the pool grows to the most chunks loaded in one step and is reused from `new_step()` on, which the
  worker calls only once the previous step's views are dropped.
"""
from __future__ import annotations

from kvfabric.counters import Counters
from kvfabric.engine import CacheEngine, ChunkHit, ChunkMiss
from kvfabric.tiers.base import Scratch


class ChunkReader:
    def __init__(self, engine: CacheEngine, counters: Counters) -> None:
        self.engine = engine
        self.counters = counters  # the worker's connector counters
        self._pool: list[Scratch] = []  # pool[i]: the buffer of the i-th chunk read in the current step
        self._held = 0

    def new_step(self) -> None:
        """The views handed out so far are no longer used: their buffers may be read into again."""
        self._held = 0

    def read(self, key: bytes) -> ChunkHit | ChunkMiss:
        if self._held == len(self._pool):
            self._pool.append(Scratch())  # empty until a tier reads into it
        found = self.engine.read_chunk(key, scratch=self._pool[self._held])
        if isinstance(found, ChunkMiss):
            self.counters.add(f"load_{found.reason}_chunks")
            return found
        self._held += 1  # the view may live in this buffer: the next chunk takes the next one
        self.counters.add(f"bytes_loaded.{found.tier}", found.num_bytes)
        return found
