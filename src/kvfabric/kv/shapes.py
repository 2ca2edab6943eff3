"""Chunk shapes: how the cache stores one logical chunk of a layout, as one object or as parts under derived keys.

Contract:
- `kvfabric.kv.shares.shape_of(layout, share)` is the one place that decides. `ChunkShape`: the chunk is one object
  under its key (a layout whose layers all have a window; a plain layout's shape, `ShareShape`, adds the other ways
  a parallel engine may have stored it). `WindowSplit` (Gemma 3): the
  full-attention layers' KV `[Lf, 2, H, T, D]` under the chunk's own key and the window layers' KV
  `[Lw, 2, H, T, D]` under a derived key, so that a load reads only the window rows a continuation still needs.
- Every part is an ordinary checked chunk (kvfabric.codec.format) in its part layout (`ChunkPart.layout`, whose
  fingerprint names the parent layout and its layers). `parts[0]` is stored under the chunk's own key; the others'
  keys are derived from it (`ChunkPart.key`: same length, never equal to any chunk key).
- Writes: `split(kv)` gives each part's KV of a whole chunk `[L, 2, H, T, D]` (a copy where a part's layers are
  not a slice). Reads: `into(out, part)` is the view of `out` a part can be decoded straight into (None: decode into
  a buffer, then `put(out, part, kv)`); `parts_for(layers)` names the parts a reader of those layers needs.
- Prefixes: after N tokens a window layer reads only positions >= `layout.live_start(N)` (`first_needed`: the first
  chunk whose part a load of N tokens reads). `live_prefix` is the
  longest prefix of chunks (each with parts[0] present) whose other needed parts are present too, asking
  `has(part, chunk indices)` once per round; lookup and retrieve serve exactly that, so a missing window part
  shortens a hit and never yields wrong KV. `clear_stale_rows(out, end, chunk_size)` zeroes the rows no continuation reads.
- `present(keys, has)` and `prefix(keys, num_tokens, chunk_size, has)` answer lookups (`has`: which stored keys
  a tier holds). A rank of a parallel engine stores its share of a chunk (kvfabric.kv.shares.ShareShape: the same
  calls, plus `alternatives`: the other ways a chunk may be stored, read where its own part is missing);
  `shape_of` there picks the shape of an engine.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvfabric.kv.layout import KVLayout

if TYPE_CHECKING:
    from kvfabric.kv.shares import Piece

_WINDOW_TAG = b"kvfabric/window-part\0"
HasParts = Callable[["ChunkPart", Sequence[int]], list[bool]]  # has(part, chunk indices) -> present, in order


@dataclass(frozen=True, slots=True)
class ChunkPart:
    name: str  # "whole", "full" or "window": names its counters
    layout: KVLayout  # the part's own layout (the parent's for a whole chunk)
    layers: tuple[int, ...]  # the parent layout's layers it holds, in order
    tag: bytes = b""  # b"": stored under the chunk's key; else its key is derived with this tag

    def key(self, chunk_key: bytes) -> bytes:
        if not self.tag:
            return chunk_key
        return hashlib.sha256(self.tag + chunk_key).digest()[:len(chunk_key)]


class ChunkShape:
    """The whole chunk as one object (the base: the calls a split shape overrides)."""

    parent: KVLayout
    parts: tuple[ChunkPart, ...]
    is_writer: bool = True  # False: a replica of another rank's share, which writes it
    alternatives: tuple[tuple[Piece, ...], ...] = ()  # other ways a chunk may be stored (kvfabric.kv.shares)

    def __init__(self, layout: KVLayout, is_writer: bool = True) -> None:
        self.parent = layout
        self.parts = (ChunkPart("whole", layout, tuple(range(layout.num_layers))),)
        self.is_writer = is_writer

    @property
    def layout(self) -> KVLayout:
        """The layout of the tensors an engine of this shape stores and reads: the model's (a share's: its own)."""
        return self.parent

    @property
    def is_whole(self) -> bool:
        return len(self.parts) == 1

    def present(self, keys: Sequence[bytes], has: Callable[[list[bytes]], list[bool]]) -> list[bool]:
        """Whether every part of each chunk is there (`has`: which stored keys are present)."""
        found = [has([part.key(k) for k in keys]) for part in self.parts]
        return [all(hits) for hits in zip(*found)]

    def held(self, keys: Sequence[bytes], has: Callable[[list[bytes]], list[bool]]) -> list[bool]:
        """For a writer: whether each chunk is stored already, so a store skips it (here: `present`)."""
        return self.present(keys, has)

    def prefix(self, keys: Sequence[bytes], num_tokens: int, chunk_size: int,
               has: Callable[[list[bytes]], list[bool]]) -> int:
        """The longest prefix of chunks a load of num_tokens tokens can read: parts[0] of each, and the other parts
        a load needs (`live_prefix`)."""
        first = has([self.parts[0].key(k) for k in keys])
        num = first.index(False) if False in first else len(keys)
        if num and len(self.parts) > 1:
            num = self.live_prefix(num, num_tokens, chunk_size, lambda part, chunks: has(
                [part.key(keys[i]) for i in chunks]))
        return num

    def part_keys(self, key: bytes) -> list[bytes]:
        return [part.key(key) for part in self.parts]

    def split(self, kv: torch.Tensor) -> list[torch.Tensor]:
        """Each part's KV of a whole chunk kv [L, 2, H, T, D], in `parts` order."""
        return [kv]

    def into(self, out: torch.Tensor, part: ChunkPart) -> torch.Tensor | None:
        """The rows of out [L, 2, H, T, D] that `part` fills, as a view it can be decoded straight into, or None."""
        return out

    def put(self, out: torch.Tensor, part: ChunkPart, kv: torch.Tensor) -> None:
        """Copy a part's KV [L', 2, H, T, D] into its layers of out [L, 2, H, T, D] (any float dtype)."""
        out.copy_(kv)

    def parts_for(self, layers: Sequence[int] | None) -> tuple[ChunkPart, ...]:
        """The parts a reader of `layers` (None: every layer) must read."""
        return self.parts

    def first_needed(self, part: ChunkPart, num_tokens: int, chunk_size: int) -> int:
        """The first chunk whose `part` a load of num_tokens tokens reads (the ones before it: no row is read)."""
        return 0

    def live_prefix(self, num_chunks: int, num_tokens: int, chunk_size: int, has: HasParts) -> int:
        return num_chunks

    def clear_stale_rows(self, out: torch.Tensor, end: int, chunk_size: int) -> None:
        """Nothing is stale in a whole chunk."""


class WindowSplit(ChunkShape):
    """Full-attention layers under the chunk's key, window layers under a derived key (see the module doc)."""

    def __init__(self, layout: KVLayout, is_writer: bool = True) -> None:
        self.parent = layout
        self.is_writer = is_writer
        window = layout.window_layers
        full = tuple(layer for layer in range(layout.num_layers) if layer not in set(window))
        self.full = ChunkPart("full", layout.part(full), full)
        self.window = ChunkPart("window", layout.part(window), window, _WINDOW_TAG)
        self.parts = (self.full, self.window)

    def split(self, kv: torch.Tensor) -> list[torch.Tensor]:
        return [kv[list(part.layers)] for part in self.parts]

    def into(self, out: torch.Tensor, part: ChunkPart) -> torch.Tensor | None:
        return None  # a layer subset is not a view

    def put(self, out: torch.Tensor, part: ChunkPart, kv: torch.Tensor) -> None:
        for i, layer in enumerate(part.layers):
            out[layer].copy_(kv[i])

    def parts_for(self, layers: Sequence[int] | None) -> tuple[ChunkPart, ...]:
        if layers is not None and set(layers) <= set(self.full.layers):
            return (self.full,)
        return self.parts

    def first_live_chunk(self, num_tokens: int, chunk_size: int) -> int:
        """The first chunk holding a window row that a continuation after num_tokens tokens still reads."""
        return self.parent.live_start(num_tokens) // chunk_size

    def first_needed(self, part: ChunkPart, num_tokens: int, chunk_size: int) -> int:
        return self.first_live_chunk(num_tokens, chunk_size) if part is self.window else 0

    def live_prefix(self, num_chunks: int, num_tokens: int, chunk_size: int, has: HasParts) -> int:
        known: dict[int, bool] = {}
        while num_chunks:
            end = min(num_chunks * chunk_size, num_tokens)
            needed = range(self.first_live_chunk(end, chunk_size), num_chunks)
            ask = [i for i in needed if i not in known]
            if ask:
                known.update(zip(ask, has(self.window, ask)))
            missing = [i for i in needed if not known[i]]
            if not missing:
                return num_chunks
            num_chunks = missing[-1]  # every prefix reaching past a missing part needs it
        return 0

    def clear_stale_rows(self, out: torch.Tensor, end: int, chunk_size: int) -> None:
        """Zero the window layers' rows before the first live chunk of a prefix of `end` tokens: rows no
        continuation reads, left finite because attention masks them by position (0 * NaN would still be NaN)."""
        first_row = self.first_live_chunk(end, chunk_size) * chunk_size
        if first_row > 0:
            for layer in self.window.layers:
                out[layer, :, :, :first_row].zero_()

