"""Chunk parts: how CacheEngine stores a chunk of a layout with sliding-window layers (Gemma 3), so that a load
reads only the window rows a continuation still needs.

Contract:
- `ChunkParts.of(layout)` is None for a layout without window layers, or one whose layers all have a window
  (nothing to split off: the chunk is stored whole, as always). Otherwise a chunk is stored as two objects:
  the full-attention layers' KV `[Lf, 2, H, T, D]` under the chunk's own key, in the part layout `full`, and the
  window layers' KV `[Lw, 2, H, T, D]` under `window_key(key)`, in the part layout `window`. Both are ordinary
  checked chunks (kvfabric.codec.format); a part layout's fingerprint names the parent layout and its layers.
- After a prefix of N tokens a window layer reads only positions >= `layout.live_start(N)`; `first_live_chunk`
  is the first chunk holding such a position. A load of N tokens needs the full part of every chunk and the
  window part of chunks `first_live_chunk(N)..`; `live_prefix` finds the longest prefix whose needed parts are
  all present, which is what lookup and retrieve serve (a missing window part shortens the hit, never yields
  wrong KV).
- `split` / `join` move between the whole chunk `[L, 2, H, T, D]` and the parts (a copy each way: a layer
  subset is not a view).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvfabric.layout import KVLayout

_WINDOW_TAG = b"kvfabric/window-part\0"


@dataclass(frozen=True, slots=True)
class ChunkParts:
    full: KVLayout  # the full-attention layers, stored under the chunk's key
    window: KVLayout  # the window layers, stored under window_key(key)
    full_layers: tuple[int, ...]
    window_layers: tuple[int, ...]
    parent: KVLayout

    @classmethod
    def of(cls, layout: KVLayout) -> ChunkParts | None:
        window = layout.window_layers
        if not window or len(window) == layout.num_layers:
            return None
        full = tuple(layer for layer in range(layout.num_layers) if layer not in set(window))
        return cls(layout.part(full), layout.part(window), full, window, layout)

    @staticmethod
    def window_key(key: bytes) -> bytes:
        """The window part's key: derived from the chunk's key (same length), never equal to any chunk key."""
        return hashlib.sha256(_WINDOW_TAG + key).digest()[:len(key)]

    def first_live_chunk(self, num_tokens: int, chunk_size: int) -> int:
        return self.parent.live_start(num_tokens) // chunk_size

    def live_prefix(self, num_chunks: int, num_tokens: int, chunk_size: int,
                    has_window: Callable[[Sequence[int]], list[bool]]) -> int:
        """The longest prefix of num_chunks chunks (all with their full part present) whose needed window parts
        are present too; has_window(chunk indices) says which window parts are present (asked once per round)."""
        known: dict[int, bool] = {}
        while num_chunks:
            end = min(num_chunks * chunk_size, num_tokens)
            needed = range(self.first_live_chunk(end, chunk_size), num_chunks)
            ask = [i for i in needed if i not in known]
            if ask:
                known.update(zip(ask, has_window(ask)))
            missing = [i for i in needed if not known[i]]
            if not missing:
                return num_chunks
            num_chunks = missing[-1]  # every prefix reaching past a missing part needs it
        return 0

    def split(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(full part [Lf, 2, H, T, D], window part [Lw, 2, H, T, D]) of a chunk's kv [L, 2, H, T, D]."""
        return kv[list(self.full_layers)], kv[list(self.window_layers)]

    def put_full(self, out: torch.Tensor, part: torch.Tensor) -> None:
        """Copy a full part [Lf, 2, H, T, D] into its layers of out [L, 2, H, T, D] (any float dtype)."""
        for i, layer in enumerate(self.full_layers):
            out[layer].copy_(part[i])

    def put_window(self, out: torch.Tensor, part: torch.Tensor) -> None:
        for i, layer in enumerate(self.window_layers):
            out[layer].copy_(part[i])

    def zero_window_rows(self, out: torch.Tensor, end: int) -> None:
        """Zero positions [0, end) of the window layers of out [L, 2, H, T, D]: rows no continuation reads, left
        finite because attention masks them by position (0 * NaN would still be NaN)."""
        if end > 0:
            for layer in self.window_layers:
                out[layer, :, :, :end].zero_()
