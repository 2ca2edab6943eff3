"""Memory mapped for writing before a hot path writes it.

Why: on the machines we measure on (a VM) a page fault taken on first touch is costly: a copy into fresh
`np.empty` buffers runs many times slower than into buffers touched before, while mapping the same pages in one
`madvise(MADV_POPULATE_WRITE)` call costs about as much as the copy (docs/design/measurements.md). So the buffers a
load or save writes (the engine's KV cache, a fresh process-memory blob) are populated when they are made, not
faulted in during the copy. (Staging `Scratch` buffers stay zeroed bytearrays: a Gemma-3 layer-wise read took bytes
of one that nothing wrote.)

- `Scratch`: a reused read buffer that grows on demand (a tier's `get_into` reads into it; connectors copy out).
- `populate(address, size)` maps the pages of [address, address + size) for writing, contents unchanged;
  on a kernel without MADV_POPULATE_WRITE (Linux < 5.14) each page gets one write of the byte it holds.
- `populated_empty(size)` is `np.empty(size, uint8)` with its pages populated.
- `map_file(fd, offset, size)` maps [offset, offset + size) of a file read-only with its page-table entries made
  at once (MAP_POPULATE): a reader copies straight out of the page cache, one copy fewer than `pread` into a
  buffer (an 8k load from cached chunk files, hashed and copied, then runs close to a memcpy of the same bytes:
  docs/design/measurements.md). None where the file is shorter. A file truncated while mapped raises SIGBUS on access:
  kvfabric never truncates a chunk file (it writes a new one and renames it), and the caller closes the mapping
  right after its copy.

Huge pages are not asked for: MADV_HUGEPAGE on malloc'd buffers was slower on the same VM (see
docs/design/measurements.md).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os

import numpy as np

MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in for writing


@functools.cache
def _libc() -> ctypes.CDLL:  # loaded once, not per buffer
    return ctypes.CDLL(None, use_errno=True)


def populate(address: int, size: int) -> None:
    """Map [address, address + size) for writing now; the bytes in it are unchanged."""
    if size <= 0:
        return
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    length = -(-(address + size) // mmap.PAGESIZE) * mmap.PAGESIZE - start
    if _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_POPULATE_WRITE) == 0:
        return
    data = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))
    pages = data[-address % mmap.PAGESIZE::mmap.PAGESIZE]  # the bytes at page starts
    pages |= 0  # a write per page, of what it holds (an in-place ufunc stores; a self-assignment may not)
    data[:1] |= 0  # the page the range starts in


def populated_empty(size: int) -> np.ndarray:
    """An uninitialized uint8 array of `size` bytes whose pages are mapped."""
    array = np.empty(size, dtype=np.uint8)
    populate(array.ctypes.data, size)
    return array


class FileMapping:
    """A read-only mapping of part of a file: `array`, uint8. `close()` it as soon as the copy out of it is done."""
    __slots__ = ("_mm", "array")

    def __init__(self, mm: mmap.mmap, offset: int, size: int) -> None:
        self._mm = mm
        self.array: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8, count=size, offset=offset)

    def close(self) -> None:
        self.array = None  # the buffer export first: a mapping with an exported view cannot close
        self._mm.close()


def map_file(fd: int, offset: int, size: int) -> FileMapping | None:
    """[offset, offset + size) of the file open as fd, mapped read-only and populated; None when it is shorter or
    cannot be mapped (the caller reads it instead)."""
    try:
        if size <= 0 or os.fstat(fd).st_size < offset + size:
            return None
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return FileMapping(mmap.mmap(fd, offset + size, flags=flags, prot=mmap.PROT_READ), offset, size)
    except OSError:
        return None


class Scratch:
    """A reusable byte buffer that grows on demand (never shrinks).

    A numpy buffer, not a bytearray: numpy asks for transparent huge pages from 4 MiB on, and a copy into a
    reused huge-page buffer runs at memcpy speed where one into a 4 KiB-page bytearray was slower - the TLB
    misses of the destination (docs/design/measurements.md)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def view(self, size: int) -> memoryview:
        if len(self._buf) < size:
            self._buf = np.empty(size, dtype=np.uint8)
        return memoryview(self._buf)[:size]

    def discard(self) -> None:
        """Let go of the buffer: a read that gave up waiting may still write into it. The next `view` allocates a
        fresh one (the abandoned one lives on for as long as that late writer holds it)."""
        self._buf = np.empty(0, dtype=np.uint8)
