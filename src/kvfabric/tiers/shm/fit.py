"""The compiled half of the allocator: `first_fit` finds the lowest free arena extent of a size in one pass over
the writers' extent table, without the GIL.

Why compiled: a put runs it on every call, over a table of one slot per 64 KiB of budget (16,384 for the default
1 GiB pool), while most slots are empty. The same search in numpy (nonzero, argsort, two concatenations, a
comparison) was more than a third of a put's index work; one loop that stops at the last live extent costs a
fraction of that (docs/design/measurements.md).

Imported on the first put, never when kvfabric is imported (numba loaded at start-up breaks hosts that walk every
loaded module's attributes: see codec/stream_kernel.py); compiled once and cached on disk.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def first_fit(offsets, sizes, num_live, need, data_bytes, starts, stops):  # noqa: ANN001, ANN201
    """The offset of the lowest gap of at least `need` bytes between the extents [offsets[s], offsets[s] +
    sizes[s]) of the slots whose size is not 0 (arena [0, data_bytes)), or -1 when none is that large.
    offsets, sizes: uint64 [num_slots], the extent table, which has `num_live` extents (the scan stops once it
    has them all); starts, stops: int64 [num_slots], scratch."""
    n = 0
    for slot in range(sizes.shape[0]):
        if n == num_live:
            break
        size = np.int64(sizes[slot])
        if size != 0:
            starts[n] = np.int64(offsets[slot])
            stops[n] = starts[n] + size
            n += 1
    order = np.argsort(starts[:n])
    at = np.int64(0)
    for k in range(n):
        i = order[k]
        if starts[i] - at >= need:
            return at
        at = max(at, stops[i])
    return at if data_bytes - at >= need else np.int64(-1)
