"""Copy token ranges between a paged KV cache and kvfabric's chunk tensors (no vLLM import).

Contract:
- A request's tokens live in a paged cache through its block table: token p sits in block `block_ids[p // B]`
  at offset `p % B` (B = block size), i.e. slot `block_ids[p // B] * B + p % B`.
- `CpuPagedLayer` wraps one layer of vLLM's CPU attention cache: a tensor (num_blocks, kv_heads, B, 2*head_dim)
  whose every (block, head) is really a K region of B*D values followed by a V region of B*D values, so
  `[b, h, n, :]` is NOT "K then V of token n". Inside a region the values are token-major ("td": [B, D], token
  n's vector is row n) or dim-major ("dt": [D, B], token n's vector is column n). vLLM 0.32's "vec" ISA (x86
  without AMX, fp32) stores K dim-major and V token-major; the connector measures this at start-up by letting
  the attention kernel write known values (see `kvfabric.connectors.vllm.config.detect_cpu_kv_layout`).
- `layer.gather(block_ids, start, end, out)` copies tokens [start, end) into out [2, H, end-start, D];
  `layer.scatter(block_ids, start, end, src)` copies src [2, H, end-start, D] into the cache. Both copy one
  segment (a partial block, or a run of whole blocks with consecutive ids) at a time straight between the two
  layouts (no temporary), and touch only the slots of tokens [start, end) - never the rest of a partially
  covered block.
- Block layout (kvfabric.kv.blocks): `layer.blocks` names the layer's own block layout; `layer.save_blocks` copies the
  blocks holding tokens [start, end) into a chunk payload slab [n, H, 2, B*D] as they are (one copy per run of
  consecutive blocks, no transpose), `layer.load_blocks` copies such a slab back; only a partial block is copied
  slot by slot (its free slots are zero in the slab, and a load touches only the slots of [start, end)).
- The same four calls, with the same arguments, copy a GPU backend's layer (connectors.paged_views.DeviceLayer): a
  connector moves KV with one set of names whatever the device.
- `populate(tensors)` maps every page of the tensors' memory now (`kvfabric.host.pages`), so
  that the first load into a block does not pay the page faults: vLLM's CPU KV cache is allocated but not
  touched until a forward writes it, and a load into a fresh engine would otherwise fault every page it writes.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np
import torch

from kvfabric.host import pages
from kvfabric.kv.blocks import BlockLayout, as_words, region_tokens

RegionLayout = Literal["td", "dt"]
REGION_LAYOUTS: tuple[RegionLayout, ...] = ("td", "dt")


class CpuPagedLayer:
    """One layer of vLLM's CPU paged KV cache, with K and V regions viewed per their layouts."""

    def __init__(self, kv: torch.Tensor, block_size: int, key_layout: RegionLayout = "dt",
                 value_layout: RegionLayout = "td") -> None:
        if kv.dim() != 4 or kv.shape[2] != block_size or kv.shape[3] % 2:
            raise ValueError(f"expected a CPU paged KV layer (num_blocks, kv_heads, {block_size}, 2*head_dim), "
                             f"got {tuple(kv.shape)}")
        if key_layout not in REGION_LAYOUTS or value_layout not in REGION_LAYOUTS:
            raise ValueError(f"region layouts must be one of {REGION_LAYOUTS}, got {key_layout}, {value_layout}")
        num_blocks, num_heads, _, two_d = kv.shape
        self.block_size = block_size
        self.num_heads = num_heads
        self.head_dim = head_dim = two_d // 2
        self.dtype = kv.dtype
        self.layouts = (key_layout, value_layout)
        # .view (never reshape): writes must land in the engine's buffer; raises if the layer is not viewable.
        regions = kv.view(num_blocks, num_heads, 2, block_size * head_dim)
        by_kind = [
            regions[:, :, i].view(num_blocks, num_heads, block_size, head_dim) if layout == "td"
            else regions[:, :, i].view(num_blocks, num_heads, head_dim, block_size)
            for i, layout in enumerate(self.layouts)
        ]
        # the K and V regions as numpy views, token-major [num_blocks, H, B, D] (for gather and scatter)
        self.arrays = [as_words(region) if layout == "td" else as_words(region).transpose(0, 1, 3, 2)
                       for region, layout in zip(by_kind, self.layouts)]
        self.blocks = BlockLayout(block_size, key_layout == "dt", value_layout == "dt")
        self.block_array = as_words(regions)  # [num_blocks, H, 2, B*D]: whole blocks, as they are

    def gather(self, block_ids: Sequence[int], start: int, end: int, out: torch.Tensor) -> None:
        """Copy the KV of tokens [start, end) of one layer into out [2, H, end-start, D].

        By numpy, for the reason `scatter` gives: the save path gathers on the engine's own thread right after each
        layer's attention, and torch's copy_ of a segment this large forks its intra-op OpenMP team, whose join
        waits for a core another process or thread holds (on the loaded 2-core machine the save gathers of `bench
        serve` ran many times slower than numpy in one thread, which also beats torch's one-thread copy: see
        docs/design/measurements.md).
        An `out` of another float dtype gets the values converted (through a buffer of the cache's dtype)."""
        if out.dtype != self.dtype:
            same = torch.empty(out.shape, dtype=self.dtype)
            self.gather(block_ids, start, end, same)
            out.copy_(same)
            return
        kv = as_words(out)
        num_heads, head_dim = kv.shape[1], kv.shape[3]
        for block, n, lo, hi, at in segments(block_ids, self.block_size, start, end):
            num_tokens = hi - lo
            for which in (0, 1):  # [H, n*m, D] viewed as [n, H, m, D] (tokens are contiguous rows)
                part = kv[which, :, at:at + n * num_tokens, :].reshape(num_heads, n, num_tokens, head_dim)
                np.copyto(part.transpose(1, 0, 2, 3), self.arrays[which][block:block + n, :, lo:hi, :])

    def scatter(self, block_ids: Sequence[int], start: int, end: int, src: torch.Tensor) -> None:
        """Copy src [2, H, end-start, D] (KV of tokens [start, end)) into the layer's slots.

        By numpy, not torch: loads scatter on background threads, where torch's copy_ of a segment over 32k values
        starts an OpenMP team of its own that competes with the engine's forward for the same cores (and took
        an order of magnitude longer on a busy machine); numpy copies in the calling thread, releases the GIL, moved
        the transposed K regions faster, and its views cost a fraction of torch's (less time holding the GIL, which
        the forward of the other requests needs). Figures: docs/design/measurements.md."""
        kv = as_words(src)
        num_heads, head_dim = kv.shape[1], kv.shape[3]
        for block, n, lo, hi, at in segments(block_ids, self.block_size, start, end):
            num_tokens = hi - lo
            for which in (0, 1):  # [H, n*m, D] -> [n, H, m, D]: a view (tokens are contiguous rows)
                part = kv[which, :, at:at + n * num_tokens, :].reshape(num_heads, n, num_tokens, head_dim)
                np.copyto(self.arrays[which][block:block + n, :, lo:hi, :], part.transpose(1, 0, 2, 3))

    def save_blocks(self, block_ids: Sequence[int], start: int, end: int, out: np.ndarray) -> None:
        """Copy the blocks holding tokens [start, end) (start block-aligned) into out [n, H, 2, B*D] (an integer view
        of a payload slab in `self.blocks`): whole runs as they are; a partial last block whole, its slots from
        `end` on zeroed (they may hold another request's stale KV)."""
        size = self.block_size
        if start % size:
            raise ValueError(f"a block-layout save starts at a block boundary, got token {start}")
        for block, n, lo, hi, at in segments(block_ids, size, start, end):
            j = at // size
            np.copyto(out[j:j + n], self.block_array[block:block + n])
            if hi < size:
                for which, is_dt in enumerate((self.blocks.key_dt, self.blocks.value_dt)):
                    region_tokens(out[j, :, which], size, is_dt)[:, hi:, :] = 0

    def load_blocks(self, block_ids: Sequence[int], start: int, end: int, src: np.ndarray,
                    first: int) -> None:
        """Copy tokens [start, end) out of src [n, H, 2, B*D] (a payload slab in `self.blocks` holding tokens from
        `first`, block-aligned) into the layer: runs of whole blocks as they are, a partial block slot by slot."""
        size = self.block_size
        for block, n, lo, hi, at in segments(block_ids, size, start, end):
            j = (start + at - lo - first) // size
            if hi - lo == size:
                np.copyto(self.block_array[block:block + n], src[j:j + n])
                continue
            for which, is_dt in enumerate((self.blocks.key_dt, self.blocks.value_dt)):
                dst_region = region_tokens(self.block_array[block, :, which], size, is_dt)  # [H, B, D]
                np.copyto(dst_region[:, lo:hi, :], region_tokens(src[j, :, which], size, is_dt)[:, lo:hi, :])


def segments(block_ids: Sequence[int], block_size: int, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(first block id, number of blocks, offset lo, offset hi, position of lo relative to start) for tokens
    [start, end): a run of whole blocks with consecutive ids is one segment (offsets [0, block_size) of each),
    so a copy per segment, not per block (vLLM hands a fresh request consecutive blocks)."""
    if start < 0 or end < start:
        raise ValueError(f"bad token range [{start}, {end})")
    if end > len(block_ids) * block_size:
        raise ValueError(f"tokens [{start}, {end}) exceed the {len(block_ids)} blocks of the block table")
    pos = start
    while pos < end:
        j, lo = divmod(pos, block_size)
        hi = min(block_size, lo + end - pos)
        n = 1
        if hi - lo == block_size:
            while pos + (n + 1) * block_size <= end and block_ids[j + n] == block_ids[j] + n:
                n += 1
        yield block_ids[j], n, lo, hi, pos - start
        pos += n * (hi - lo)


def blocks_of(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Ids of the blocks holding tokens [start, end)."""
    if end <= start:
        return []
    return list(block_ids[start // block_size:(end - 1) // block_size + 1])


def render_region(values: torch.Tensor, layout: RegionLayout) -> torch.Tensor:
    """How a region stores `values` [B, D] (token n's vector in row n), flattened: the calibration reference."""
    return (values if layout == "td" else values.t()).reshape(-1)


def populate(tensors: Sequence[torch.Tensor]) -> int:
    """Map every page of the (CPU) tensors' storages for writing now, values unchanged (`kvfabric.host.pages`); a
    storage shared by several tensors once. Bytes populated."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type == "cpu"}
    for address, size in storages.items():
        pages.populate(address, size)
    return sum(storages.values())
