"""Where a chunk's values sit in the video frames, and the writer that restores a decoded frame into `out`.

A chunk [L, 2, H, T, D] has S = 2L segments (layer, K/V), each a [C = H*D channels, T tokens] picture: one row a
channel, one column a token, so neighbouring tokens of a channel are neighbouring pixels (the token locality
CacheGen measured) and a codec's left prediction is "the same channel one token earlier". Tokens are cut into
tiles of at most `tile` columns (as even as possible); frame i is tile i // S of segment i % S (the layers, K and
V, are successive frames; a long context adds tiles, never a larger frame). A frame's rows are spread over the backend's planes in
bands of `rows` channels (three bands of 64 channels are SmolLM2's three heads), padded by repeating the last row
and column (free to code). Frames are at most `planes * rows * tile` pixels whatever the context length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvfabric.codec.raw import copy_into


@dataclass(frozen=True, slots=True)
class Geometry:
    num_segments: int  # S = 2 * num_layers
    num_heads: int
    head_dim: int
    num_tokens: int  # T
    tile: int  # tokens a frame (before padding)
    planes: int
    even: bool  # the backend wants even frame sizes

    @property
    def channels(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def num_tiles(self) -> int:
        return -(-self.num_tokens // self.tile)

    @property
    def num_frames(self) -> int:
        return self.num_tiles * self.num_segments

    @property
    def rows(self) -> int:
        rows = -(-self.channels // self.planes)
        return rows + (rows % 2 if self.even else 0)

    @property
    def width(self) -> int:
        return self.tile + (self.tile % 2 if self.even else 0)

    def frame(self, i: int) -> tuple[int, int, int]:
        """(segment, first token, end token) of frame i."""
        j, s = divmod(i, self.num_segments)
        a = j * self.tile
        return s, a, min(a + self.tile, self.num_tokens)


def balanced_tile(num_tokens: int, max_tile: int) -> int:
    """Tokens a frame so that the tiles are as even as possible (little padding) and none exceeds max_tile."""
    return -(-num_tokens // math.ceil(num_tokens / max_tile))


def pack(g: Geometry, grid: np.ndarray, i: int) -> list[np.ndarray]:
    """The planes of frame i from grid [S, C, T] (pixel values)."""
    s, a, b = g.frame(i)
    block = grid[s, :, a:b]
    pad_rows, pad_cols = g.planes * g.rows - g.channels, g.width - (b - a)
    if pad_rows or pad_cols:
        block = np.pad(block, ((0, pad_rows), (0, pad_cols)), mode="edge")
    return [block[p * g.rows:(p + 1) * g.rows] for p in range(g.planes)]


def unpack(g: Geometry, planes: list[np.ndarray], num_cols: int) -> np.ndarray:
    """[C, num_cols] pixel values of a decoded frame (a view when the frame has one plane)."""
    rows = planes[0] if g.planes == 1 else np.concatenate(planes)
    return rows[:g.channels, :num_cols]


def to_heads(g: Geometry, rows: np.ndarray) -> np.ndarray:
    """[C, n] -> [H, n, D] (a view): a frame's columns back in the KV layout."""
    return rows.reshape(g.num_heads, g.head_dim, -1).transpose(0, 2, 1)


class Target:
    """The caller's out [L, 2, H, T, D] (any float dtype, any strides, any device), written a frame at a time:
    float32 values (rounded once to out's dtype) or layout-dtype bit patterns (copied when out has the layout's
    dtype, else widened to float32 first)."""

    _BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}

    def __init__(self, out: torch.Tensor, layout_dtype: torch.dtype) -> None:
        self.out = out
        self.layout_dtype = layout_dtype
        on_cpu = out.device.type == "cpu" and not out.requires_grad
        # float32: numpy writes straight in; fp16 / bf16: torch's (F16C) cast, faster than numpy's (copy_into keeps
        # it serial)
        self.values = out.detach().numpy() if on_cpu and out.dtype == torch.float32 else None
        self.bits = out.detach().view(self._BITS[out.dtype]).numpy() if on_cpu and out.dtype == layout_dtype else None

    def put_values(self, s: int, a: int, b: int, v: np.ndarray) -> None:
        """out[l, k, :, a:b, :] = v ([H, b - a, D] float32)."""
        l, k = divmod(s, 2)
        if self.values is not None:
            self.values[l, k, :, a:b, :] = v
            return
        dst, src = self.out[l, k, :, a:b, :], torch.from_numpy(v)
        copy_into(dst, src) if dst.device.type == "cpu" else dst.copy_(src)

    def put_bits(self, s: int, a: int, b: int, words: np.ndarray) -> None:
        """out[l, k, :, a:b, :] = the layout-dtype values whose bit patterns are `words` ([H, b - a, D])."""
        if self.bits is not None:
            l, k = divmod(s, 2)
            self.bits[l, k, :, a:b, :] = words.view(self.bits.dtype)
            return
        self.put_values(s, a, b, bits_to_f32(words, self.layout_dtype))


def bits_to_f32(words: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Layout-dtype bit patterns (uint16 / uint32) -> float32 values (exact)."""
    if dtype == torch.float16:
        return words.view(np.float16).astype(np.float32)
    if dtype == torch.bfloat16:
        return (words.astype(np.uint32) << 16).view(np.float32)
    return words.view(np.float32)


def layout_bits(kv: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """kv rounded to the layout dtype, as its bit patterns (uint16 / uint32, contiguous)."""
    t = kv.detach().to(dtype).contiguous()
    return t.view(torch.int32 if dtype == torch.float32 else torch.int16).numpy().view(
        np.uint32 if dtype == torch.float32 else np.uint16)
