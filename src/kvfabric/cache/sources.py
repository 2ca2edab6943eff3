"""Chunk sources: a chunk opened for reading (`KVCache.read_chunk`, `open_chunk`, `read_many`), matched on its type.

Contract:
- `TokenSource`: `kv` [L', 2, H, T, D] in the layout dtype, holding the layout's `layers` (None: every layer).
- `BlockSource`: a raw payload in the caller's block layout `blocks`, layer by layer: `slab(i)` is layer i as integer
  words [num_blocks, *block_shape]; `place(placer, runs)` copies every layer's runs of blocks (whole, or a partial
  block's slots) in one native call (kvfabric.cache.placer).
- Both are context managers, valid only inside their `with` (a slab read from a file lives in a reused buffer, a
  view of shared memory may be reused by a writer, a server slot is leased until the exit).
- The cache verifies, never the caller. A source from a whole read was verified before it was handed out. A
  source checked as it is copied (`open_chunk` of a block-layout chunk from a tier the cache does not trust) hashes
  each slab, in payload order, right before it hands it out (the bytes are in cache then, the caller's copy reads
  them from there) and compares the sum at exit, hashing there whatever the caller skipped. A read in place is
  checked at exit for a writer that reused its memory meanwhile.
- A failure raises `ChunkFailed` (its `miss` says why): at exit, or at once where a slab turns out short. What the
  caller copied from the source must then be thrown away. The cache has already discarded and counted a damaged
  chunk; a torn read (memory reused under the reader) is counted, not discarded: the entry was fine.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import torch
import xxhash

from kvfabric.host.pages import Scratch, map_file
from kvfabric.kv.blocks import BlockLayout

if TYPE_CHECKING:
    from kvfabric.cache.placer import ChunkPlacer

MissReason = Literal["missing", "corrupt", "wrong_layout", "torn"]


@dataclass(frozen=True, slots=True)
class ChunkMiss:
    reason: MissReason  # missing: no tier holds a valid blob; corrupt / wrong_layout: found, failed, discarded;
    #                     torn: read in place while a writer reused the memory


class ChunkFailed(Exception):
    """A source failed its check after the caller started copying from it: throw the copy away."""

    def __init__(self, miss: ChunkMiss, why: str = "") -> None:
        super().__init__(why or miss.reason)
        self.miss = miss


def _nothing() -> None:
    pass


@dataclass(frozen=True, slots=True)
class Hooks:
    """What the cache that opened a source does as it ends."""
    release: Callable[[], None] = _nothing  # give back what the read holds (an open file, a lease)
    is_current: Callable[[], bool] | None = None  # a read in place: were the bytes still the entry's throughout
    drop: Callable[[str], object] = lambda why: None  # the payload failed its check: discard and count the chunk
    torn: Callable[[], None] = _nothing  # count a read whose memory was reused under it


class ChunkSource:
    tier: str  # the tier that served it ("pending": a write still queued; "server": a server's)
    num_bytes: int  # bytes of the blob read

    def __init__(self, tier: str, num_bytes: int, hooks: Hooks) -> None:
        self.tier = tier
        self.num_bytes = num_bytes
        self._hooks = hooks
        self._failure: ChunkMiss | None = None
        self._is_open = True

    def __enter__(self) -> ChunkSource:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self._is_open:
            return
        self._is_open = False
        try:
            if self._failure is None and exc_type is None:
                self._settle()
            if self._failure is None and self._hooks.is_current is not None and not self._hooks.is_current():
                self._hooks.torn()
                self._failure = ChunkMiss("torn")
        finally:
            self._hooks.release()
        if self._failure is not None and exc_type is None:
            raise ChunkFailed(self._failure)

    def _settle(self) -> None:
        """Finish the checks left to the exit (a source checked as copied)."""

    def _fail(self, reason: MissReason, why: str) -> ChunkFailed:
        if self._failure is None:
            self._failure = ChunkMiss(reason)
            if reason == "corrupt":
                self._hooks.drop(why)
        return ChunkFailed(self._failure, why)


class TokenSource(ChunkSource):
    def __init__(self, kv: torch.Tensor, tier: str, num_bytes: int, hooks: Hooks = Hooks(),
                 layers: tuple[int, ...] | None = None) -> None:
        super().__init__(tier, num_bytes, hooks)
        self.kv = kv  # [L', 2, H, T, D]
        self.layers = layers  # the layout's layers kv holds, in order (None: all of them)

    def __enter__(self) -> TokenSource:
        return self


class Ranged(Protocol):
    """A blob read piece by piece (a tier's RangedBlob): `fd` is its open file, or -1."""
    fd: int

    def read_into(self, offset: int, buf: memoryview) -> bool: ...


@dataclass(frozen=True, slots=True)
class Payload:
    """Where a block-layout payload's bytes are: `words` [L, num_blocks, *block_shape] in memory, or a ranged reader
    whose layer i starts at `offset + i * slab_bytes`."""
    words: np.ndarray | None
    ranged: Ranged | None = None
    offset: int = 0


class BlockSource(ChunkSource):
    def __init__(self, blocks: BlockLayout, slab_shape: tuple[int, ...], dtype: np.dtype, payload: Payload,
                 tier: str, num_bytes: int, hooks: Hooks, expected_sum: int | None, scratch: Scratch | None) -> None:
        super().__init__(tier, num_bytes, hooks)
        self.blocks = blocks
        self.num_layers = slab_shape[0]
        self.slab_shape = slab_shape[1:]
        self.slab_bytes = math.prod(self.slab_shape) * dtype.itemsize
        self.layers: tuple[int, ...] | None = None  # a block-layout chunk holds every layer
        self._dtype = dtype
        self._payload = payload
        self._scratch = scratch
        self._expected = expected_sum  # None: verified already
        self._digest: xxhash.xxh3_64 | None = None  # made by the first slab hashed here (`place` hashes natively)
        self._num_hashed = 0  # layers [0, n) fed to the digest
        self._placed_sum: int | None = None
        self.check_ns = 0  # CPU time this source spent hashing its payload (ns)

    def __enter__(self) -> BlockSource:
        return self

    @property
    def is_checked_on_exit(self) -> bool:
        return self._expected is not None

    def slab(self, index: int) -> np.ndarray:
        """Layer `index` as words [num_blocks, *block_shape]: a view of the payload, or read now into the read's
        buffer (valid until the next slab). Raises ChunkFailed where the stored blob is shorter than its header."""
        while self._expected is not None and self._num_hashed < index:  # what the caller skipped, in payload order
            self._hash(self._read(self._num_hashed))
        slab = self._read(index)
        if self._expected is not None and self._num_hashed == index:
            self._hash(slab)
        return slab

    def _hash(self, slab: np.ndarray) -> None:
        if self._digest is None:
            self._digest = xxhash.xxh3_64()
        started = time.thread_time_ns()  # CPU time: the GIL and other threads' slices not counted
        self._digest.update(slab.data)
        self.check_ns += time.thread_time_ns() - started
        self._num_hashed += 1

    def _read(self, index: int) -> np.ndarray:
        if self._payload.words is not None:
            return self._payload.words[index]
        ranged = self._payload.ranged
        assert ranged is not None and self._scratch is not None
        buf = self._scratch.view(self.slab_bytes)
        if not ranged.read_into(self._payload.offset + index * self.slab_bytes, buf):
            raise self._fail("corrupt", f"truncated: layer {index} of the payload is missing")
        return np.frombuffer(buf, dtype=self._dtype).reshape(self.slab_shape)

    def place(self, placer: ChunkPlacer, runs: np.ndarray) -> None:
        """Every layer's `runs` [R, 5] (first block in the slab, first block in the layer, blocks, first and end
        token in a block: see kvfabric.cache.placer) copied into the placer's layers in one call that holds no GIL,
        hashed in the same pass where the source is checked as copied. Where a source reads a chunk file, the file
        is mapped (copied straight out of the page cache), or read with pread into the placer's staging buffer.
        Only on a source nothing was read from yet."""
        if self._num_hashed:
            raise ValueError("place() reads the whole payload: call it before any slab()")
        check = self._expected is not None
        ranged = self._payload.ranged
        if self._payload.words is not None:
            words = self._payload.words
            is_whole, digest = placer.place(runs, self.slab_bytes, src=words.reshape(-1).view(np.uint8), check=check)
        else:
            assert ranged is not None
            fd, offset = ranged.fd, self._payload.offset
            mapping = map_file(fd, offset, self.slab_bytes * self.num_layers) if fd >= 0 else None
            if mapping is not None:
                try:
                    is_whole, digest = placer.place(runs, self.slab_bytes, src=mapping.array, check=check)
                finally:
                    mapping.close()
            else:  # shorter than its header says (or not a file): read by slabs, found short
                is_whole, digest = placer.place(runs, self.slab_bytes, fd=fd, file_offset=offset, check=check)
        self.check_ns = placer.hash_ns
        if not is_whole:
            raise self._fail("corrupt", "truncated: the payload is shorter than its header says")
        self._num_hashed = self.num_layers
        self._placed_sum = digest

    def _settle(self) -> None:
        if self._expected is None:
            return
        if self._placed_sum is not None:
            digest = self._placed_sum
        else:
            while self._num_hashed < self.num_layers:
                self._hash(self._read(self._num_hashed))
            digest = (self._digest or xxhash.xxh3_64()).intdigest()
        if digest != self._expected:
            raise self._fail("corrupt", "payload checksum mismatch (found while copying)")
