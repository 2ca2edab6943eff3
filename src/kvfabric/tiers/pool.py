"""BlobPool: recycled blob buffers for the process-memory tier, so a store does not fault fresh pages in.

A fresh multi-megabyte buffer costs a page fault per 4 KiB on first write (the cpu tier's store ran at 0.1-0.2
of a memcpy of the same bytes, most of it faults). The pool hands out buffers of chunks the tier dropped.

Contract:
- `take(size)` returns a writable `memoryview` of exactly `size` bytes (format "B"): a recycled buffer of that
  size when one is free, else fresh memory (a numpy array, which numpy backs with huge pages where it can).
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

from kvfabric.tiers.base import Blob


def _refs(arrays: deque, i: int) -> int:
    """References to arrays[i], counted the same way for every buffer (calibrated once, see BlobPool)."""
    array = arrays[i]
    return sys.getrefcount(array)


ALIGN = 64
MIN_KEPT = 2  # buffers kept whatever the budget: a full tier's next store reuses the victim of the last one


class BlobPool:
    def __init__(self, budget: Callable[[], int], align_offset: int = 0) -> None:
        self.budget = budget
        self.align_offset = align_offset
        self._retired: deque[np.ndarray] = deque()  # dropped by the tier, oldest first; maybe still referenced
        self._retired_bytes = 0
        self._lock = threading.Lock()
        self.num_reused = self.num_fresh = 0
        probe: deque[np.ndarray] = deque([np.empty(1, dtype=np.uint8)])
        self._unreferenced = _refs(probe, 0)  # the count of a buffer only the pool holds

    def take(self, size: int) -> memoryview:
        with self._lock:
            retired = self._retired
            for i in range(len(retired)):
                if retired[i].nbytes == size + ALIGN and _refs(retired, i) == self._unreferenced:
                    array = retired[i]
                    del retired[i]
                    self._retired_bytes -= array.nbytes
                    self.num_reused += 1
                    return self._aligned(array, size)
            self.num_fresh += 1
        return self._aligned(np.empty(size + ALIGN, dtype=np.uint8), size)

    def _aligned(self, array: np.ndarray, size: int) -> memoryview:
        start = -(array.ctypes.data + self.align_offset) % ALIGN
        return memoryview(array)[start:start + size]

    def give(self, blob: Blob) -> None:
        owner = blob.obj if isinstance(blob, memoryview) else None
        if not isinstance(owner, np.ndarray) or owner.dtype != np.uint8 or owner.ndim != 1 or \
                not owner.flags.writeable or not owner.flags.c_contiguous or owner.base is not None:
            return  # not a buffer this pool made (or a view of one): leave it to the garbage collector
        with self._lock:
            self._retired.append(owner)
            self._retired_bytes += owner.nbytes
            budget = max(0, self.budget())
            while self._retired_bytes > budget and len(self._retired) > MIN_KEPT:
                self._retired_bytes -= self._retired.popleft().nbytes

    @property
    def num_free_bytes(self) -> int:
        return self._retired_bytes

    def clear(self) -> None:
        with self._lock:
            self._retired.clear()
            self._retired_bytes = 0
