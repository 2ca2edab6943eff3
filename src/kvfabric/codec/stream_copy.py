"""Streaming copies of KV chunks: a chunk's rows between a token slice of a KV tensor and a blob's payload.

Why: a chunk is `[L, 2, H, T, D]` tokens [s, e) of a longer KV tensor, so each copy is L*2*H runs of T*D values
(32-64 KiB), and a copy through the cache reads every destination line before writing it (read for
ownership): numpy's copy of these runs is clearly slower than a memcpy of the same bytes (see
docs/design/measurements.md). `stream_rows` writes with non-temporal stores (whole cache lines, no read for
ownership, then SFENCE so that other threads see the bytes once they synchronize), which is what glibc's memcpy does
for large contiguous copies; numba compiles it once and caches it on disk. Without numba, or for rows that are not
contiguous, `copy_rows` falls back to numpy.

Contract: `rows(x)` is a uint8 view `[A, B, C, n]` (last axis contiguous) of a `[L, 2, H, T, D]` array whose
(T, D) axes are contiguous together, or None when they are not; `copy_rows(dst, src)` copies such views of
the same shape, all bytes, in row order. Nothing here allocates.
"""
from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import numpy as np

STREAM_BYTES = 1 << 20


def rows(x: np.ndarray) -> np.ndarray | None:
    """x [L, 2, H, T, D] as uint8 rows [L, 2, H, T*D*itemsize]; None if a row is not one contiguous run."""
    if x.ndim != 5 or x.strides[4] != x.itemsize or (x.shape[3] > 1 and x.strides[3] != x.shape[4] * x.itemsize):
        return None
    L, K, H, T, D = x.shape
    if x.size:  # a view with (T, D) merged: a tenth of as_strided's cost, which ran twice per chunk copy
        merged = x.view(np.uint8).reshape(L, K, H, T * D * x.itemsize)
        if not merged.flags.owndata:  # (the strides checked above make it a view; never write into a copy)
            return merged
    return np.lib.stride_tricks.as_strided(x.view(np.uint8) if x.size else x, shape=(L, K, H, T * D * x.itemsize),
                                           strides=(*x.strides[:3], 1), writeable=x.flags.writeable)


def _copy_rows_numpy(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src)


# numba present = the streamed path exists; the kernel module itself is imported on first use (see
# stream_kernel.py for why never at import time)
HAVE_STREAMING = importlib.util.find_spec("numba") is not None


@functools.cache
def _kernel() -> Callable[[np.ndarray, np.ndarray], None]:
    from kvfabric.codec.stream_kernel import stream_rows
    return stream_rows


def copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy uint8 rows [A, B, C, n] (from `rows`) of the same shape; non-temporal stores where available."""
    if dst.shape != src.shape:
        raise ValueError(f"row shapes differ: {dst.shape} vs {src.shape}")
    if HAVE_STREAMING and dst.shape[3] >= 64:
        _kernel()(dst, src)
    else:
        _copy_rows_numpy(dst, src)


def can_copy_chunks(src: np.ndarray) -> bool:
    """Whether `copy_chunks` can cut chunks out of src (numba present, each row one run): asked before the
    destinations are taken."""
    return HAVE_STREAMING and rows(src) is not None


def copy_chunks(src: np.ndarray, spans: list[tuple[int, int]], dsts: list[np.ndarray]) -> bool:
    """Copy token spans [s, e) of src [L, 2, H, T, D] into dsts[k], contiguous [L, 2, H, e - s, D] arrays of the
    same dtype, in one streamed pass over src (stream_kernel.stream_chunks). False, having copied nothing, when
    the streamed path cannot take them (no numba, src rows not one run each, a destination of another shape):
    the caller copies chunk by chunk."""
    src_rows = rows(src) if can_copy_chunks(src) else None
    if src_rows is None or not dsts:
        return False
    row_bytes = src.shape[4] * src.itemsize  # one token's bytes in a row
    offsets = np.array([s * row_bytes for s, _ in spans], dtype=np.int64)
    runs = np.array([(e - s) * row_bytes for s, e in spans], dtype=np.int64)
    addrs = np.array([d.ctypes.data for d in dsts], dtype=np.int64)
    num_rows = src_rows.shape[0] * src_rows.shape[1] * src_rows.shape[2]
    if any(not d.flags.c_contiguous or not d.flags.writeable or d.dtype != src.dtype or d.nbytes != num_rows * run
           for d, run in zip(dsts, runs.tolist())):
        return False
    _chunks_kernel()(src_rows, offsets, addrs, runs)
    return True


@functools.cache
def _chunks_kernel() -> Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]:
    from kvfabric.codec.stream_kernel import stream_chunks
    return stream_chunks


def is_streamed(num_bytes: int) -> bool:
    """Whether a copy of this size goes through `copy_rows`: below STREAM_BYTES a cached copy is as fast (the
    destination stays in cache for its reader) and building the row views would cost more than it saves."""
    return HAVE_STREAMING and num_bytes >= STREAM_BYTES
