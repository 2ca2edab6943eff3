"""The compiled half of the vLLM loader's block copies: `ChunkPlacer.place` puts one block-layout chunk's runs of
blocks into every layer of a paged cache in ONE call that runs without the GIL (numba, nogil). Per layer it reads
the layer's slab (from the chunk file with pread, or from memory), copies each run of whole blocks with memcpy, and
of a partial block (a prompt's last: vLLM recomputes its last token) only the slots of the run's tokens, and feeds
the slab to xxh3 (the xxhash package's own C functions, called through ctypes): the slab is copied and hashed while
it is in cache, and the payload's checksum comes out of the same pass.

Why one call per chunk: the loader's threads share a process with vLLM's engine thread, which holds the GIL most of
the time; each time a loader thread gives the GIL up (a read, a hash, a copy) it waits up to a switch interval
(5 ms) to get it back. Copying a chunk from Python layer by layer took dozens of such waits, and a load beside a
busy Python thread then ran many times longer than alone (docs/design/measurements.md).

Imported by the loader's threads once the layers are bound, never when kvfabric is imported (numba loaded at
start-up breaks hosts that walk every module's attributes: see codec/stream_kernel.py). `AVAILABLE` is False
where numba or the xxhash build's exported symbols are missing; the loader then copies from Python.
"""
from __future__ import annotations

import ctypes
import time

import numpy as np
import xxhash._xxhash
from numba import njit

from kvfabric.codec.stream_kernel import store_fence, stream_lines
from kvfabric.kv.blocks import BlockLayout

_SIZE = ctypes.c_size_t


def _function(lib: ctypes.CDLL, name: str, restype: type, *argtypes: type):  # noqa: ANN202
    function = getattr(lib, name)
    function.restype = restype
    function.argtypes = list(argtypes)  # pointers as size_t: numba passes integers, the ABI is the same on x86-64
    return function


_XXH = ctypes.CDLL(xxhash._xxhash.__file__)
_LIBC = ctypes.CDLL(None)
# the build's runtime-dispatched update (AVX2 / AVX-512 where the CPU has them) where it exports one: the plain
# symbol is its SSE2 code, slower (the same digest either way; docs/design/measurements.md)
_UPDATE = _function(_XXH, "XXH3_64bits_update_dispatch" if hasattr(_XXH, "XXH3_64bits_update_dispatch")
                    else "XXH3_64bits_update", ctypes.c_int, _SIZE, _SIZE, _SIZE)
_CREATE = _function(_XXH, "XXH3_createState", _SIZE)
_RESET = _function(_XXH, "XXH3_64bits_reset", ctypes.c_int, _SIZE)
_DIGEST = _function(_XXH, "XXH3_64bits_digest", ctypes.c_uint64, _SIZE)
_FREE = _function(_XXH, "XXH3_freeState", ctypes.c_int, _SIZE)
_PREAD = _function(_LIBC, "pread", ctypes.c_ssize_t, ctypes.c_int, _SIZE, _SIZE, ctypes.c_ssize_t)
_MEMCPY = _function(_LIBC, "memcpy", _SIZE, _SIZE, _SIZE, _SIZE)
_CLOCK = _function(_LIBC, "clock_gettime", ctypes.c_int, ctypes.c_int, _SIZE)
_MONOTONIC = 1


@njit(nogil=True, inline="always")
def _now(clock):  # noqa: ANN001, ANN202
    _CLOCK(_MONOTONIC, clock.ctypes.data)
    return clock[0] * 1_000_000_000 + clock[1]


@njit(nogil=True, inline="always")
def _copy(dst, src, size):  # noqa: ANN001, ANN202
    """size bytes from address src to address dst, the whole lines of dst with non-temporal stores. Why: a piece
    is below the size at which memcpy streams, so its stores would first read each destination line into the
    cache (read for ownership) and then evict it: a third more memory traffic, for KV the forward reads much
    later (with memcpy per piece, the copies of a load were slower than one large memcpy of the same bytes: see
    docs/design/measurements.md)."""
    head = min(size, (64 - dst % 64) % 64)
    if head:
        _MEMCPY(dst, src, head)
    done = head + stream_lines(dst + head, src + head, size - head)
    if done < size:
        _MEMCPY(dst + done, src + done, size - done)


@njit(nogil=True, inline="always")
def _copy_slots(dst, src, geometry, lo, hi):  # noqa: ANN001, ANN202
    """Tokens [lo, hi) of one block [H, 2, B*D] from address src to address dst, and no other slot: vLLM writes
    the rest of the block itself. geometry: (H, B, D, itemsize, K dim-major, V dim-major); a token-major region
    [B, D] holds the tokens' vectors as one range, a dim-major one [D, B] as a range in each of its D rows."""
    heads, size, dim, itemsize = geometry[0], geometry[1], geometry[2], geometry[3]
    region = size * dim * itemsize
    for head in range(heads):
        for which in range(2):
            at = (head * 2 + which) * region
            if geometry[4 + which]:
                for d in range(dim):
                    offset = at + (d * size + lo) * itemsize
                    _MEMCPY(dst + offset, src + offset, (hi - lo) * itemsize)
            else:
                offset = at + lo * dim * itemsize
                _MEMCPY(dst + offset, src + offset, (hi - lo) * dim * itemsize)


PIECE_BYTES = 128 << 10  # a piece read, copied and hashed while it is in L2 (2 MiB a core here)


@njit(nogil=True)
def _place(fd, file_offset, src, slab_bytes, staging, state, dst, runs, block_bytes, geometry, piece_blocks,
           clock):  # noqa: ANN001, ANN202
    """Layers placed (all of dst's, or fewer: the file fell short). Each layer's slab goes piece by piece
    (piece_blocks blocks): fd >= 0: read from the file at file_offset + l * slab_bytes into staging, else it lies
    at src + l * slab_bytes; the parts of `runs` [R, 5] (first block in the slab, first block in the layer,
    blocks, first and end token in a block: 0 and B for whole blocks) that it holds are copied; then, state != 0,
    the piece is hashed (its time added to clock[2], ns).
    Copy first: a piece in memory is read from DRAM once, by the copy (which a load pays anyway), and the hash
    reads it again from L2 (2 MiB a core here, the piece 128 KiB): hashed first, the hash took the DRAM reads."""
    num_blocks = slab_bytes // block_bytes
    for layer in range(dst.shape[0]):
        for first in range(0, num_blocks, piece_blocks):
            last = min(num_blocks, first + piece_blocks)
            size = (last - first) * block_bytes
            base = src + layer * slab_bytes  # the address block 0 of this slab has (or would have)
            if fd >= 0:
                if _PREAD(fd, staging, size, file_offset + layer * slab_bytes + first * block_bytes) != size:
                    store_fence()
                    return layer
                base = staging - first * block_bytes
            for r in range(runs.shape[0]):
                lo, hi = max(runs[r, 0], first), min(runs[r, 0] + runs[r, 2], last)
                if lo >= hi:
                    continue
                into = dst[layer] + (runs[r, 1] + lo - runs[r, 0]) * block_bytes
                if runs[r, 3] == 0 and runs[r, 4] == geometry[1]:
                    _copy(into, base + lo * block_bytes, (hi - lo) * block_bytes)
                else:  # a partial block (a run of one)
                    _copy_slots(into, base + lo * block_bytes, geometry, runs[r, 3], runs[r, 4])
            if state != 0:  # after the copy, which brought the piece into cache: the hash reads it from there
                started = _now(clock)
                _UPDATE(state, base + first * block_bytes, size)
                clock[2] += _now(clock) - started
    store_fence()  # the streamed stores are weakly ordered: all of them land before the load is reported done
    return dst.shape[0]


class ChunkPlacer:
    """One per loader thread (it owns an xxh3 state): the destination layers' block arrays [N, H, 2, B*D] in the
    block layout `blocks`, in layer order, and the thread's staging buffer for slabs read from files."""

    def __init__(self, block_arrays: list[np.ndarray], blocks: BlockLayout, staging: np.ndarray) -> None:
        self._dst = np.array([array.ctypes.data for array in block_arrays], dtype=np.int64)
        self._block_bytes = block_arrays[0][0].nbytes
        _, heads, _, width = block_arrays[0].shape
        self._geometry = np.array([heads, blocks.block_size, width // blocks.block_size, block_arrays[0].itemsize,
                                   blocks.key_dt, blocks.value_dt], dtype=np.int64)
        self._staging = staging  # held: its address is passed on every call
        self._state = _CREATE()
        if not self._state:
            raise MemoryError("XXH3_createState failed")
        self._clock = np.zeros(3, dtype=np.int64)  # timespec, then the hashing time (ns) of the last place
        self._cpu_ns = self._wall_ns = 0
        # compiled now, on this thread, before the first load needs it
        self.place(np.zeros((0, 5), dtype=np.int64), 0, src=np.zeros(0, dtype=np.uint8), check=True)

    def place(self, runs: np.ndarray, slab_bytes: int, *, src: np.ndarray | None = None, fd: int = -1,
              file_offset: int = 0, check: bool) -> tuple[bool, int | None]:
        """Copy `runs` [R, 5] (see `_place`) of every layer's slab (from src, the payload [L * slab_bytes] in
        memory, or read from the file fd) into the layers: (whether every slab was there, the payload's xxh3-64 when
        `check`).
        `cpu_ns`: the CPU time the call took; `hash_ns`: the CPU time of its hashing."""
        if runs.ndim != 2 or runs.shape[1] != 5:
            raise ValueError(f"runs must be [R, 5], got {runs.shape}")
        if fd >= 0 and len(self._staging) < slab_bytes:
            raise ValueError(f"staging holds {len(self._staging)} bytes, a slab is {slab_bytes}")
        if src is not None and src.nbytes < slab_bytes * len(self._dst):
            raise ValueError(f"src holds {src.nbytes} bytes, {len(self._dst)} slabs are {slab_bytes} each")
        if check:
            _RESET(self._state)
        self._clock[2] = 0
        address = 0 if src is None else src.ctypes.data
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        placed = _place(fd, file_offset, address, slab_bytes, self._staging.ctypes.data,
                        self._state if check else 0, self._dst, runs, self._block_bytes, self._geometry,
                        max(1, PIECE_BYTES // self._block_bytes), self._clock)
        self._cpu_ns, self._wall_ns = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
        if placed != len(self._dst):
            return False, None
        return True, int(_DIGEST(self._state)) if check else None

    @property
    def cpu_ns(self) -> int:
        return self._cpu_ns

    @property
    def hash_ns(self) -> int:
        """The hashing's wall time in the last call (timed per piece) x that call's CPU / wall time. Why not a CPU
        clock per piece: each read is a system call (the wall clock is read in user space), a noticeable share of
        a piece's work. Why not wall time: two loader threads share a core beside vLLM's engine thread, and a
        piece's wall time then also counts the other threads' time slices (the sum came out well above the CPU
        time). Figures: docs/design/measurements.md."""
        return int(self._clock[2] * min(1.0, self._cpu_ns / self._wall_ns)) if self._wall_ns else 0

    def close(self) -> None:
        if self._state:
            _FREE(self._state)
            self._state = 0
