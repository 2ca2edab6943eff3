"""The two KV pools of paged decode: a fixed fast pool of blocks and a slower backing pool of pages.

Contract:
- `FastPool(num_blocks, page_size, head_dim, reserved)`: K and V blocks ``[num_blocks, P, D]`` fp32, allocated
  once; `alloc(n)` hands out n free block ids (a LongTensor) from a free stack and `free(ids)` puts them back, so a
  freed block is reused without any allocation. Blocks [0, reserved) are not in the stack: they are the fixed,
  contiguous ranges of heads that never evict (FULL heads: attention reads them in place, no gather), counted in
  use page by page with `claim(n)`. Asking for more blocks than are free raises PoolFull (a budget bug, never
  silent). `used` / `peak` count blocks in use.
- `SlowPool(num_layers, num_heads, num_pages, page_size, head_dim, kind)`: one slot per (layer, head, page),
  ``[L, H, pages, 2, P, D]`` fp32, in process memory (`memory`) or in a file mapped from /dev/shm (`shm`, unlinked
  once mapped, so nothing is left behind). `write(layer, heads, pages, k, v)` and `read(layer, heads, pages, fast,
  blocks)` are real copies, timed and counted (`Transfers`). Pages are immutable once full, so a page offloaded
  once never needs to be written again: evicting it from the fast pool is just freeing its block.
"""
from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

FP32 = 4


class PoolFull(RuntimeError):
    pass


class FastPool:
    def __init__(self, num_blocks: int, page_size: int, head_dim: int, reserved: int = 0) -> None:
        self.k = torch.empty(num_blocks, page_size, head_dim)  # [blocks, P, D]
        self.v = torch.empty(num_blocks, page_size, head_dim)
        self.num_blocks, self.reserved = num_blocks, reserved
        self.block_bytes = 2 * page_size * head_dim * FP32
        # blocks [0, reserved) are fixed ranges of heads that never evict (claimed page by page); the rest is the
        # free stack, whose top is the end
        self._stack = torch.arange(num_blocks - 1, reserved - 1, -1, dtype=torch.long)
        self._top = num_blocks - reserved
        self.claimed = 0
        self.peak = 0

    @property
    def used(self) -> int:
        return self.claimed + self.num_blocks - self.reserved - self._top

    def claim(self, n: int) -> None:
        """Count n more blocks of the reserved ranges as in use."""
        if self.claimed + n > self.reserved:
            raise PoolFull(f"fast pool: {self.claimed + n} reserved blocks claimed, {self.reserved} reserved")
        self.claimed += n
        self.peak = max(self.peak, self.used)

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._top:
            raise PoolFull(f"fast pool: {n} blocks wanted, {self._top} of {self.num_blocks - self.reserved} free")
        self._top -= n
        self.peak = max(self.peak, self.used)
        return self._stack[self._top:self._top + n].clone()

    def free(self, ids: torch.Tensor) -> None:
        self._stack[self._top:self._top + ids.numel()] = ids
        self._top += ids.numel()


@dataclass(slots=True)
class Transfers:
    """Bytes and seconds of real copies between the pools (mutable counters of one decode)."""
    to_fast_bytes: int = 0
    to_slow_bytes: int = 0
    seconds: float = 0.0


class SlowPool:
    def __init__(self, num_layers: int, num_heads: int, num_pages: int, page_size: int, head_dim: int,
                 kind: str = "memory") -> None:
        shape = (num_layers, num_heads, num_pages, 2, page_size, head_dim)
        self.kind = kind
        self._map: mmap.mmap | None = None
        if kind == "memory":
            self.pages = torch.empty(shape)
        elif kind == "shm":
            self.pages = self._shm_tensor(shape)
        else:
            raise ValueError(f"slow pool kind {kind!r}: expected memory or shm")
        self.num_heads, self.num_pages = num_heads, num_pages
        self._flat = self.pages.view(-1, 2, page_size * head_dim)  # [L * H * pages, 2, P*D]: one row per slot
        self.page_bytes = 2 * page_size * head_dim * FP32
        self.transfers = Transfers()

    def _shm_tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        size = int(np.prod(shape)) * FP32
        path = f"/dev/shm/kvfabric-flexi-{os.getpid()}-{id(self):x}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping keeps the memory; no file outlives the process
        return torch.frombuffer(self._map, dtype=torch.float32).view(shape)

    def _slots(self, layer: int, heads: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        return (layer * self.num_heads + heads) * self.num_pages + pages

    def write(self, layer: int, heads: torch.Tensor, pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy pages in: k / v [n, P, D] for the (heads[i], pages[i]) slots of `layer`."""
        start = time.perf_counter()
        slots = self._slots(layer, heads, pages)
        self._flat[:, 0].index_copy_(0, slots, k.reshape(slots.numel(), -1))
        self._flat[:, 1].index_copy_(0, slots, v.reshape(slots.numel(), -1))
        self.transfers.seconds += time.perf_counter() - start
        self.transfers.to_slow_bytes += heads.numel() * self.page_bytes

    def read(self, layer: int, heads: torch.Tensor, pages: torch.Tensor, fast: FastPool, blocks: torch.Tensor) -> None:
        """Copy the (heads[i], pages[i]) pages of `layer` into fast blocks[i]."""
        start = time.perf_counter()
        src = self._flat.index_select(0, self._slots(layer, heads, pages))  # [n, 2, P*D]
        fast.k.view(fast.num_blocks, -1).index_copy_(0, blocks, src[:, 0])
        fast.v.view(fast.num_blocks, -1).index_copy_(0, blocks, src[:, 1])
        self.transfers.seconds += time.perf_counter() - start
        self.transfers.to_fast_bytes += heads.numel() * self.page_bytes

    def close(self) -> None:
        self.pages = self._flat = torch.empty(0)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still refers to it; the mapping goes with the last reference
                pass
            self._map = None
