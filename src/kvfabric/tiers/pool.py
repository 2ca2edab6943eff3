"""BlobPool: recycled blob buffers for the process-memory tier, so a store does not fault fresh pages in.

A fresh multi-megabyte buffer costs a page fault per 4 KiB on first write (the cpu tier's store ran many times
slower than a memcpy of the same bytes, most of it faults: docs/design/measurements.md). The pool hands out
buffers of chunks the tier dropped.

Contract:
- `take(size)` returns a writable `memoryview` of exactly `size` bytes (format "B"): a recycled buffer of that
  size when one is free, else fresh memory (a numpy array whose pages are mapped before it is handed out:
  `kvfabric.host.pages`).
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
- Blobs the pool did not make (bytes, bytearrays, another pool's or a scratch's arrays) are ignored by `give`:
  a tier that stores a buffer it did not take never adopts it. Thread-safe.
- With `premap_bytes` > 0, a background thread keeps up to that many free buffers of the size named by `expect`
  (a full chunk's blob; nothing before that call) mapped ahead of `take`, within the budget: a tier that is still filling up hands out
  buffers mapped off the caller's thread. Why: growing a process by fresh memory costs far more than a copy on some
  hosts (the gVisor-like sandbox we measure on most of all, far less on bare Linux: see
  docs/design/measurements.md), and a vLLM save writes its blobs on the engine's thread. The thread inherits its
  creator's CPU affinity; `expect(size)` names the size before the first take; `pause(True)` holds it (within one
  1 MiB piece) while the owner's hot work runs, since on a machine whose cores that work fills (vLLM's CPU forward)
  mapping beside it costs the forward as much as faulting in it would; `close()` stops it (and `clear()`s).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import numpy as np

from kvfabric.host.pages import populate, populated_empty
from kvfabric.tiers.base import Blob


def _refs(arrays: deque) -> int:
    """References to arrays[0], counted the same way for every buffer (calibrated once, see BlobPool)."""
    array = arrays[0]
    return sys.getrefcount(array)


ALIGN = 64
MIN_KEPT = 2  # buffers kept whatever the budget: a full tier's next store reuses the victim of the last one
PREMAP_NICE = 19  # the premap thread's niceness
PREMAP_PIECE = 1 << 20  # bytes the premap thread maps between looks at `pause` (a few ms on the sandbox)
NUM_TRIED = 4  # free buffers of the asked size looked at per take (still-referenced ones rotate to the back)


class BlobPool:
    def __init__(self, budget: Callable[[], int], align_offset: int = 0, premap_bytes: int = 0) -> None:
        self.budget = budget
        self.align_offset = align_offset
        self.premap_bytes = premap_bytes
        self._free: dict[int, deque[np.ndarray]] = {}  # size -> buffers dropped by the tier, oldest first
        self._free_bytes = self._num_free = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the premap thread waits here for a take or close
        self._ahead_size = 0  # the largest size taken: what the premap thread maps ahead
        self._is_closed = self._is_paused = False
        self.num_reused = self.num_fresh = self.num_premapped = 0
        self._made: dict[int, weakref.ref] = {}  # id -> the buffers this pool made, alive (weak: no refcount)
        self._unreferenced = _refs(deque([np.empty(1, dtype=np.uint8)]))  # the count of a buffer only we hold
        self._premapper: threading.Thread | None = None
        if premap_bytes > 0:
            self._premapper = threading.Thread(target=self._premap_loop, name="kvfabric-premap", daemon=True)
            self._premapper.start()

    def expect(self, size: int) -> None:
        """Buffers of `size` will be taken: map them ahead from now, and after each take of that size (when
        premapping, and `size` at least as large as any expected before)."""
        with self._lock:
            if size >= self._ahead_size and self._premapper is not None:
                self._ahead_size = size
                self._wake.notify_all()

    def pause(self, is_paused: bool) -> None:
        """While paused, the premap thread stops at its next piece (the owner's hot work runs: a forward)."""
        with self._lock:
            self._is_paused = is_paused
            if not is_paused:
                self._wake.notify_all()

    def take(self, size: int) -> memoryview:
        with self._lock:
            if size == self._ahead_size:  # the premap thread replaces the buffer this take uses
                self._wake.notify_all()
            bucket = self._free.get(size)
            for _ in range(min(len(bucket), NUM_TRIED) if bucket else 0):
                if _refs(bucket) == self._unreferenced:
                    self._free_bytes -= size
                    self._num_free -= 1
                    self.num_reused += 1
                    return memoryview(bucket.popleft())
                bucket.rotate(-1)
            self.num_fresh += 1
        return memoryview(self._mapped(size))

    def _mapped(self, size: int) -> np.ndarray:
        whole = populated_empty(size + ALIGN)  # mapped now: the copy into it must not fault page by page
        start = -(whole.ctypes.data + self.align_offset) % ALIGN
        array = whole[start:start + size]
        self._made[id(array)] = weakref.ref(array, lambda _, made=self._made, ident=id(array): made.pop(ident, None))
        return array

    def _is_short(self) -> bool:
        """Fewer than `premap_bytes` free of the ahead size, and room in the budget for one more (under the lock)."""
        size = self._ahead_size
        num_ahead = len(self._free.get(size, ())) * size
        return size > 0 and num_ahead + size <= self.premap_bytes and self._free_bytes + size <= self.budget()

    def _until_free(self, is_wanted: Callable[[], bool]) -> bool:
        """Wait (under the lock) until unpaused and `is_wanted()`, or closed (False)."""
        while not self._is_closed and (self._is_paused or not is_wanted()):
            self._wake.wait()
        return not self._is_closed

    def _premap_loop(self) -> None:
        try:  # the lowest priority, where the host honors it: a core is better spent on work that runs now
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREMAP_NICE)
        except OSError:
            pass
        while True:
            with self._wake:
                if not self._until_free(self._is_short):
                    return
                size = self._ahead_size
            whole = np.empty(size + ALIGN, dtype=np.uint8)
            for offset in range(0, whole.nbytes, PREMAP_PIECE):  # piece by piece, so that a pause stops it soon
                with self._wake:
                    if not self._until_free(lambda: True):
                        return
                populate(whole.ctypes.data + offset, min(PREMAP_PIECE, whole.nbytes - offset))
            start = -(whole.ctypes.data + self.align_offset) % ALIGN
            array = whole[start:start + size]
            del whole
            with self._lock:
                self._add(array)
                del array  # a reference held here would read as a reader's, and `take` would skip the buffer
                self.num_premapped += 1
                self._wake.notify_all()  # `wait_premapped` callers

    def wait_premapped(self, timeout: float) -> bool:
        """Wait until the premap thread has nothing left to map (True), or `timeout` seconds (False)."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while self._premapper is not None and self._is_short():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def give(self, blob: Blob) -> None:
        array = blob.obj if isinstance(blob, memoryview) else None
        made = self._made.get(id(array)) if array is not None else None
        if made is None or made() is not array:
            return  # another pool's buffer (or a scratch's, or not an array): its owner recycles it
        if blob.nbytes != array.nbytes or not array.flags.writeable:  # (ours: a 1-D uint8 C-contiguous array)
            return  # a view of part of it, or made read-only since: leave it to the garbage collector
        with self._lock:
            self._add(array)

    def _add(self, array: np.ndarray) -> None:
        """A free buffer in, then the oldest of the fullest size out while over budget (under the lock)."""
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

    def close(self) -> None:
        """Stop the premap thread and let go of every free buffer."""
        with self._wake:
            self._is_closed = True
            self._wake.notify_all()
        if self._premapper is not None:
            self._premapper.join()
        self.clear()
