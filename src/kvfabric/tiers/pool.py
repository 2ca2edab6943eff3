"""BlobPool: recycled blob buffers for the process-memory tier, so a store does not fault fresh pages in.

A fresh multi-megabyte buffer costs a page fault per 4 KiB on first write (the cpu tier's store ran at 0.1-0.2
of a memcpy of the same bytes, most of it faults). The pool hands out buffers of chunks the tier dropped.

Contract:
- `take(size)` returns a writable `memoryview` of exactly `size` bytes (format "B"): a recycled buffer of that
  size when one is free, else fresh memory (a numpy array whose pages are mapped before it is handed out:
  `kvfabric.pages`).
  Byte `align_offset` of the view (a blob's payload) sits on a 64-byte boundary: streaming stores into the
  payload then fill whole cache lines.
- `give(blob)` is called when the tier lets go of a blob (evicted, deleted, replaced, cleared). The buffer is
  reused only once nothing else references it: a reader still holding the blob, a view or tensor over it, or a
  queued write of it to a slower tier keeps it alive and untouched (CPython reference counts of the buffer's
  owner: every memoryview, numpy array or tensor over a buffer references it). A buffer still referenced
  when the budget runs out is simply forgotten (garbage collected once its last user lets go). So a blob a
  reader holds never changes under it, and a chunk is never served from a recycled buffer.
- Free buffers are bounded by `budget()` bytes, or MIN_KEPT buffers when that is more (the cpu tier passes what
  its chunks leave of its capacity, at least an eighth of it); `clear()` lets go of all of them.
- Blobs the pool did not make (bytes, bytearrays) are ignored by `give`. Thread-safe.
"""
from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable

import numpy as np

from kvfabric.pages import populated_empty
from kvfabric.tiers.base import Blob


def _refs(arrays: deque) -> int:
    """References to arrays[0], counted the same way for every buffer (calibrated once, see BlobPool)."""
    array = arrays[0]
    return sys.getrefcount(array)


ALIGN = 64
MIN_KEPT = 2  # buffers kept whatever the budget: a full tier's next store reuses the victim of the last one
NUM_TRIED = 4  # free buffers of the asked size looked at per take (still-referenced ones rotate to the back)


class BlobPool:
    def __init__(self, budget: Callable[[], int], align_offset: int = 0) -> None:
        self.budget = budget
        self.align_offset = align_offset
        self._free: dict[int, deque[np.ndarray]] = {}  # size -> buffers dropped by the tier, oldest first
        self._free_bytes = self._num_free = 0
        self._lock = threading.Lock()
        self.num_reused = self.num_fresh = 0
        self._unreferenced = _refs(deque([np.empty(1, dtype=np.uint8)]))  # the count of a buffer only we hold

    def take(self, size: int) -> memoryview:
        with self._lock:
            bucket = self._free.get(size)
            for _ in range(min(len(bucket), NUM_TRIED) if bucket else 0):
                if _refs(bucket) == self._unreferenced:
                    self._free_bytes -= size
                    self._num_free -= 1
                    self.num_reused += 1
                    return memoryview(bucket.popleft())
                bucket.rotate(-1)
            self.num_fresh += 1
        whole = populated_empty(size + ALIGN)  # mapped now: the copy into it must not fault page by page
        start = -(whole.ctypes.data + self.align_offset) % ALIGN
        return memoryview(whole[start:start + size])

    def give(self, blob: Blob) -> None:
        array = blob.obj if isinstance(blob, memoryview) else None
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1 or \
                not array.flags.writeable or not array.flags.c_contiguous or len(blob) != array.nbytes:
            return  # not a buffer this pool made: leave it to the garbage collector
        with self._lock:
            self._free.setdefault(array.nbytes, deque()).append(array)
            self._free_bytes += array.nbytes
            self._num_free += 1
            budget = max(0, self.budget())
            while self._free_bytes > budget and self._num_free > MIN_KEPT:
                size, bucket = max(self._free.items(), key=lambda item: len(item[1]))
                bucket.popleft()
                self._free_bytes -= size
                self._num_free -= 1

    @property
    def num_free_bytes(self) -> int:
        return self._free_bytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._free_bytes = self._num_free = 0
