"""Paged KV caches as vLLM 0.32 describes them, on any device, and the copies between them and kvfabric's tensors.

vLLM 0.32 (`vllm/v1/kv_cache_layout.py`, `vllm/v1/kv_cache_interface.py`) hands every attention layer over as a
logical view [B, H, N, C] (blocks, head slots, tokens of a block, content) of one backing buffer; a group's
`KVCacheLayout` is the stride permutation of the logical axes [L, B, H, N, C] in memory (LBHNC, LBNHC, LHBNC,
BLHNC, BLNHC, BHLNC). Torch follows the strides, so one copy routine serves every layout and every device.

Contract:
- `Content` says what C holds. "kv" (FLASH_ATTN, FLASHINFER NHD / HND, TRITON_ATTN): token n's K (head_size
  values) then its V (head_size_v), per head slot. "latent" (the MLA backends): one vector per token, H = 1. vLLM's
  CPU backend keeps a K region then a V region per (block, head) instead: `paged.CpuPagedLayer`, not this module.
- `layer_views(raw, spec)` views a flat backing buffer exactly as vLLM's `create_kv_cache_views` does (a test
  compares the two): the GPU check builds caches without vLLM, and a layout means the same here and there.
- `DeviceLayer.of(view, layout, content)`: one layer's copies, with connectors.paged.CpuPagedLayer's names and
  arguments. `gather(block_ids, start, end, out)` copies tokens [start, end) into out [S, H, T, D] (S = 2 for
  "kv": K then V; 1 for "latent"); `scatter` copies such a tensor back. One copy per content state and per
  segment (a partial block, or a run of whole blocks with consecutive ids), never per token; only the slots of
  [start, end) are touched. `out` / `src` may live on another device (a pinned host buffer): torch moves it.
- `physical_blocks(view, layout)` is the layer's blocks in their memory order with the block axis first (`Blocks`:
  [B, H, N, C] or [B, N, H, C]): what a chunk in the writer's block layout stores per block. `save_blocks` /
  `load_blocks` copy runs of whole blocks of it as they are (no transpose); in a layer-compact, block-contiguous
  layout (LBHNC, LBNHC) a run is one contiguous range of memory. Such a payload is a chunk in
  `block_layout(name, block_size)` (kvfabric.kv.blocks family "vllm"): kvfabric.kv.blocks converts it to any other
  layout, exactly, so a chunk saved in one layout loads into every other; an MLA latent (H = 1) the same way.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvfabric.connectors.paged import segments
from kvfabric.kv.blocks import BlockLayout
from kvfabric.kv.layout import KVLayout

Content = Literal["kv", "latent"]
LOGICAL_AXES = "LBHNC"
# vLLM 0.32's KVCacheLayout members: name -> stride order (the physical order of the logical axes [L, B, H, N, C])
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
# the backends' names for their layouts (FlashInfer's NHD / HND; vLLM's default is LBNHC)
ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


def content_of(layout: KVLayout) -> Content:
    """What a paged cache of `layout` holds per token: "latent" (MLA) or "kv"."""
    return "latent" if layout.is_latent else "kv"


def layout_order(name: str) -> tuple[int, ...]:
    """The stride order of a KVCacheLayout name (or a FlashInfer alias); ValueError for anything else."""
    order = LAYOUTS.get(ALIASES.get(name, name))
    if order is None:
        raise ValueError(f"unknown KV cache layout {name!r}; known: {', '.join([*LAYOUTS, *ALIASES])}")
    return order


def block_layout(name: str, block_size: int) -> BlockLayout:
    """The chunk block layout of a K|V cache in this layout: a block as `physical_blocks` holds it."""
    order = [axis for axis in layout_order(name) if axis not in (0, 1)]  # H, N, C in memory order
    return BlockLayout(block_size, family="vllm", token_major=order[0] == 3)


def is_cross_layer(name: str) -> bool:
    """Block-outermost: a block's KV for every layer is one contiguous run."""
    return layout_order(name)[0] == 1


@dataclass(frozen=True, slots=True)
class PagedSpec:
    """One group's cache: num_layers layers of num_blocks blocks, each [num_heads, block_size, width] of dtype."""
    layout: str
    content: Content
    num_layers: int
    num_blocks: int
    num_heads: int
    block_size: int
    head_dim: int  # K's (= V's) head size for "kv"; the latent width for "latent"
    dtype: torch.dtype

    def __post_init__(self) -> None:
        layout_order(self.layout)
        if self.content not in ("kv", "latent"):
            raise ValueError(f"content must be 'kv' or 'latent', got {self.content!r}")
        if self.content == "latent" and self.num_heads != 1:
            raise ValueError(f"a latent (MLA) cache has one head slot, got {self.num_heads}")

    @property
    def width(self) -> int:
        """C in elements."""
        return 2 * self.head_dim if self.content == "kv" else self.head_dim

    @property
    def num_states(self) -> int:
        return 2 if self.content == "kv" else 1

    @property
    def logical_shape(self) -> tuple[int, int, int, int, int]:
        return self.num_layers, self.num_blocks, self.num_heads, self.block_size, self.width

    @property
    def num_bytes(self) -> int:
        n = 1
        for size in self.logical_shape:
            n *= size
        return n * torch.empty(0, dtype=self.dtype).element_size()


def strides(spec: PagedSpec) -> tuple[int, ...]:
    """Element strides of the logical axes [L, B, H, N, C] (dense, in the layout's memory order)."""
    shape, out, step = spec.logical_shape, [0] * 5, 1
    for axis in reversed(layout_order(spec.layout)):
        out[axis] = step
        step *= shape[axis]
    return tuple(out)


def layer_views(raw: torch.Tensor, spec: PagedSpec) -> list[torch.Tensor]:
    """Per-layer logical views [B, H, N, C] of `raw` (at least spec.num_bytes, any dtype, any device)."""
    flat = raw.view(-1).view(torch.uint8)[:spec.num_bytes].view(spec.dtype)
    whole = torch.as_strided(flat, spec.logical_shape, strides(spec))
    return [whole[layer] for layer in range(spec.num_layers)]


def states(view: torch.Tensor, content: Content) -> list[torch.Tensor]:
    """[B, H, N, C] -> one [B, H, N, D] view per state (K and V for "kv", the latent alone)."""
    if content == "latent":
        return [view]
    head_dim = view.shape[-1] // 2
    return [view[..., :head_dim], view[..., head_dim:]]




@dataclass(frozen=True, slots=True)
class Blocks:
    """A layer's blocks in memory order, block axis first: `tensor` [B, H, N, C] or [B, N, H, C] (a view)."""
    tensor: torch.Tensor
    token_axis: int  # N's axis within one block: 1 for [H, N, C], 0 for [N, H, C]

    @property
    def block_size(self) -> int:
        return self.tensor.shape[1 + self.token_axis]


def physical_blocks(view: torch.Tensor, layout: str) -> Blocks:
    """The layer's blocks with the block axis first and the rest in memory order: [B, H, N, C] for LBHNC,
    [B, N, H, C] for LBNHC (no copy)."""
    order = [axis - 1 for axis in layout_order(layout) if axis != 0]  # the per-layer memory order of [B, H, N, C]
    order.remove(0)
    return Blocks(view.permute(0, *order), order.index(2))



def zero_tail(out: torch.Tensor, token_axis: int, num_tokens: int) -> None:
    """Zero the free slots of the partial last block of out [n, ...] (blocks holding num_tokens tokens)."""
    size = out.shape[1 + token_axis]
    if num_tokens % size:
        out[-1].narrow(token_axis, num_tokens % size, size - num_tokens % size).zero_()


@dataclass(frozen=True, slots=True)
class DeviceLayer:
    """One layer of a paged cache in a vLLM 0.32 layout, on any device: its logical view [B, H, N, C], what C holds,
    and its blocks in memory order (`physical_blocks`). The copies have connectors.paged.CpuPagedLayer's names and
    arguments: gather / scatter move tokens [start, end) to and from [S, H, T, D]; save_blocks / load_blocks move
    runs of whole blocks as they are."""
    view: torch.Tensor
    content: Content
    blocks: Blocks

    @classmethod
    def of(cls, view: torch.Tensor, layout: str, content: Content = "kv") -> DeviceLayer:
        return cls(view, content, physical_blocks(view, layout))

    @property
    def block_size(self) -> int:
        return self.view.shape[2]

    def gather(self, block_ids: Sequence[int], start: int, end: int, out: torch.Tensor) -> None:
        """Tokens [start, end) of one layer into out [S, H, end-start, D]."""
        block_size = self.view.shape[2]
        parts = states(self.view, self.content)
        for block, n, lo, hi, at in segments(block_ids, block_size, start, end):
            m = hi - lo
            for which, part in enumerate(parts):  # [n, H, m, D] -> out's [H, n, m, D]
                dst = out[which, :, at:at + n * m, :].unflatten(1, (n, m))
                dst.copy_(part[block:block + n, :, lo:hi, :].transpose(0, 1), non_blocking=True)

    def scatter(self, block_ids: Sequence[int], start: int, end: int, src: torch.Tensor) -> None:
        """src [S, H, end-start, D] (tokens [start, end)) into one layer's slots."""
        block_size = self.view.shape[2]
        parts = states(self.view, self.content)
        for block, n, lo, hi, at in segments(block_ids, block_size, start, end):
            m = hi - lo
            for which, part in enumerate(parts):
                piece = src[which, :, at:at + n * m, :].unflatten(1, (n, m)).transpose(0, 1)
                part[block:block + n, :, lo:hi, :].copy_(piece, non_blocking=True)

    def save_blocks(self, block_ids: Sequence[int], start: int, end: int, out: torch.Tensor) -> None:
        """The blocks holding tokens [start, end) (start block-aligned) into out [n, ...] (the blocks' shape),
        runs of consecutive ids whole, a partial last block whole too: `zero_tail(out, ...)` clears its slots from
        `end` on (stale KV of another request) once the copies have landed (on a device they are asynchronous)."""
        size = self.blocks.block_size
        if start % size:
            raise ValueError(f"a block-layout save starts at a block boundary, got token {start}")
        for block, n, _, _, at in segments(block_ids, size, start, end):
            j = at // size
            out[j:j + n].copy_(self.blocks.tensor[block:block + n], non_blocking=True)

    def load_blocks(self, block_ids: Sequence[int], start: int, end: int, src: torch.Tensor,
                    first: int) -> None:
        """Tokens [start, end) out of src [n, ...] (whole blocks as `save_blocks` wrote them, holding tokens from
        `first`, block-aligned) into the layer: runs of whole blocks as they are, a partial block slot by slot."""
        size, axis = self.blocks.block_size, self.blocks.token_axis
        for block, n, lo, hi, at in segments(block_ids, size, start, end):
            j = (start + at - lo - first) // size
            if hi - lo == size:
                self.blocks.tensor[block:block + n].copy_(src[j:j + n], non_blocking=True)
            else:
                self.blocks.tensor[block].narrow(axis, lo, hi - lo).copy_(src[j].narrow(axis, lo, hi - lo), non_blocking=True)

