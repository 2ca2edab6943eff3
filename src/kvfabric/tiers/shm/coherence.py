"""Cache maintenance of the publish protocol: what a pool whose memory is not coherent across hosts needs.

TraCT's CXL pool is shared by hosts whose CPU caches do not snoop each other: a store sits in the writer's cache
until written back, and a reader may hit a stale line of its own. So the writer writes back (flush) what it wrote
and orders it (fence) before the store that publishes it, and the reader drops (invalidate) its cached copy of
what it is about to read. The protocol calls these at fixed points (the package docstring lists them); this
module supplies the primitives.

- `CacheOps`: coherent memory (one host's /dev/shm, x86-64's coherent caches keep stores in order): every
  primitive is a no-op.
- `MsyncCacheOps` (``shm.coherent: false``): flush and invalidate are msync of the pages that hold the range,
  which writes a file-backed mapping back to its file (on a DAX file system, the kernel's cache write-back of
  the range); fence is implied, msync being a system call (a full barrier). Python cannot issue CLFLUSHOPT,
  so on true non-coherent CXL memory these need a native extension with the same three calls; which calls are
  made, and in which order, is this module's contract and is tested with a recording shim.
"""
from __future__ import annotations

import mmap

PAGE = mmap.PAGESIZE


class CacheOps:
    is_coherent = True

    def flush(self, mm: mmap.mmap, start: int, length: int) -> None:
        """Write [start, start + length) of the mapping back to memory."""

    def fence(self) -> None:
        """Order every flush before it ahead of every store after it."""

    def invalidate(self, mm: mmap.mmap, start: int, length: int) -> None:
        """Drop cached copies of [start, start + length) so the next load reads memory."""


class MsyncCacheOps(CacheOps):
    is_coherent = False

    def flush(self, mm: mmap.mmap, start: int, length: int) -> None:
        first = start // PAGE * PAGE
        mm.flush(first, start + length - first)

    def invalidate(self, mm: mmap.mmap, start: int, length: int) -> None:
        self.flush(mm, start, length)


def cache_ops(coherent: bool) -> CacheOps:
    return CacheOps() if coherent else MsyncCacheOps()
