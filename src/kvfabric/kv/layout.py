"""KV layout: the shape and dtype of one model's attention KV, its layer groups, and its fingerprint.

Contract: a `KVLayout` is an immutable value. Two layouts with the same fields have the same `fingerprint`
on every machine; the fingerprint goes into chunk keys and chunk headers, so a cache written for another
model shape, layer-group map or dtype can never be served (it is a different key, and the header check rejects it).
Tensor convention for a run of tokens: `[num_layers, 2, num_kv_heads, num_tokens, head_dim]` (2 = K, V).
A latent layout (`is_latent`: multi-head latent attention, DeepSeek-V2/V3's MLA as vLLM's MLA backends cache it)
holds one latent vector per token and layer instead of K and V: `[num_layers, 1, 1, num_tokens, head_dim]`
(`num_states` 1, one head slot; head_dim is the latent's width, kv_lora_rank + qk_rope_head_dim, 576 for
DeepSeek-V3). Its fingerprint says so, so a latent chunk never reads as K|V of the same size.

Layer groups (`LayerGroup`): layers with full attention (window 0) or with a sliding window of W tokens (a query
at position q reads keys q-W < p <= q, W keys including itself: Gemma 3, Mistral). A layout with no window
group has `groups == ()` (one implicit full group; the fingerprint is the one of a plain layout).

What a chunk holds, for every group (the one place this is defined; docs/design/layer-groups.md):
chunk i holds the K/V of ITS OWN tokens [iC, (i+1)C) at their own positions, for every layer, window layers
included. After a cached prefix of N tokens a window group reads only positions [N-W+1, N) (`window_start`):
W-1 rows, exactly what the engine itself keeps; rows before that are never read again, so a loader may skip
them (`stale_rows`) but must leave finite values there (zeros), because the mask excludes them by position.

Parts (`LayoutPart`, `KVLayout.part`): a layout of some of another layout's layers, as one stored part of a chunk
(the engine stores a window layout's chunk as its full-attention layers and, under a derived key, its window
layers: kvfabric.kv.shapes). `KVLayout.share(layers, heads)`: some layers and a range of KV heads, a rank's share
under pipeline and tensor parallelism. A part's fingerprint names its parent's, the layers and the heads it holds,
so a codec's per-model tables can be sliced to it and a part is never mistaken for a whole layout of the same shape.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

DTYPES: dict[str, tuple[torch.dtype, np.dtype, int]] = {
    # name -> (torch dtype, numpy dtype used for raw bytes, dtype code in the chunk header)
    "float16": (torch.float16, np.dtype(np.float16), 1),
    "bfloat16": (torch.bfloat16, np.dtype(np.uint16), 2),  # numpy has no bf16: raw 16-bit words
    "float32": (torch.float32, np.dtype(np.float32), 3),
}


def _positive(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers sharing one attention kind and one KV shape."""

    layers: tuple[int, ...]  # sorted layer indices
    num_kv_heads: int
    head_dim: int
    window: int = 0  # 0: full attention; W > 0: sliding window of W tokens (keys q-W < p <= q)

    def __post_init__(self) -> None:
        _positive("LayerGroup", "num_kv_heads", self.num_kv_heads)
        _positive("LayerGroup", "head_dim", self.head_dim)
        if not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"LayerGroup.window must be an int >= 0 (0 = full attention), got {self.window!r}")
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 0:
            raise ValueError(f"LayerGroup.layers must be sorted, distinct, non-negative, got {self.layers!r}")

    @property
    def is_window(self) -> bool:
        return self.window > 0

    def window_start(self, num_tokens: int) -> int:
        """First position this group still reads after a prefix of num_tokens (0 for full attention)."""
        return max(0, num_tokens - self.window + 1) if self.window else 0

    def describe(self) -> str:
        kind = f"window {self.window}" if self.window else "full"
        return f"{kind}: layers {list(self.layers)}, {self.num_kv_heads}x{self.head_dim}"


@dataclass(frozen=True, slots=True)
class LayoutPart:
    """What a part layout is part of: the parent's fingerprint, the parent's layers it holds, in order, and (a rank's
    share under tensor parallelism) the parent's KV heads [first, last) it holds; None: every head."""

    parent: bytes  # the parent layout's fingerprint
    layers: tuple[int, ...]  # parent layer of each of the part's layers
    heads: tuple[int, int] | None = None  # parent KV heads [first, last) (None: all of them)


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    groups: tuple[LayerGroup, ...] = ()  # () = every layer full attention; else a partition of the layers
    part_of: LayoutPart | None = None  # set for a part of another layout (see `part`)
    is_latent: bool = False  # one latent vector per token (MLA), not K and V: [L, 1, 1, T, D]

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            _positive("KVLayout", name, getattr(self, name))
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.is_latent and (self.num_kv_heads != 1 or any(group.is_window for group in self.groups)):
            raise ValueError("a latent (MLA) KVLayout has one head slot (num_kv_heads=1) and no window groups, got "
                             f"num_kv_heads={self.num_kv_heads}, {[g.describe() for g in self.groups]}")
        if not self.groups:
            return
        covered = sorted(layer for group in self.groups for layer in group.layers)
        if covered != list(range(self.num_layers)):
            raise ValueError(f"KVLayout.groups must cover layers 0..{self.num_layers - 1} exactly once, "
                             f"got {[g.describe() for g in self.groups]}")
        for group in self.groups:
            # one KV tensor [L, 2, H, T, D] per chunk needs one H x D; groups that differ are refused here,
            # at start-up, rather than stored in a shape nothing could load
            if (group.num_kv_heads, group.head_dim) != (self.num_kv_heads, self.head_dim):
                raise ValueError(f"layer group ({group.describe()}) has another KV shape than "
                                 f"{self.num_kv_heads}x{self.head_dim}: kvfabric stores one [L, 2, H, T, D] "
                                 "tensor per chunk and does not support per-group KV shapes yet")
        if not any(group.is_window for group in self.groups):  # all full attention: the plain layout
            object.__setattr__(self, "groups", ())

    @classmethod
    def from_layer_types(cls, layer_types: list[str] | tuple[str, ...], num_kv_heads: int, head_dim: int,
                         window: int | None, dtype: str = "float16") -> KVLayout:
        """Layout of a model whose layer i is `layer_types[i]` ("full_attention" or "sliding_attention", as in
        transformers' `config.layer_types`), with sliding window `window`."""
        kinds = sorted(set(layer_types))
        unknown = set(kinds) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"unsupported attention layer types {sorted(unknown)}: kvfabric knows full_attention "
                             "and sliding_attention")
        if "sliding_attention" in kinds and not window:
            raise ValueError("sliding_attention layers need a positive sliding window")
        groups = tuple(
            LayerGroup(tuple(i for i, t in enumerate(layer_types) if t == kind), num_kv_heads, head_dim,
                       int(window) if kind == "sliding_attention" else 0)
            for kind in kinds)
        return cls(len(layer_types), num_kv_heads, head_dim, dtype, groups)

    @property
    def window_groups(self) -> tuple[LayerGroup, ...]:
        return tuple(group for group in self.groups if group.is_window)

    @property
    def window_layers(self) -> tuple[int, ...]:
        """Layers with a sliding window, sorted (() for a layout without window groups)."""
        return tuple(sorted(layer for group in self.window_groups for layer in group.layers))

    def live_start(self, num_tokens: int) -> int:
        """First position any window layer still reads after a prefix of num_tokens (num_tokens without windows)."""
        return min((g.window_start(num_tokens) for g in self.window_groups), default=num_tokens)

    def part(self, layers: tuple[int, ...]) -> KVLayout:
        """The plain layout of `layers` of this one (each layer's KV shape and the dtype unchanged)."""
        if not layers or any(not 0 <= layer < self.num_layers for layer in layers):
            raise ValueError(f"a part needs layers in 0..{self.num_layers - 1}, got {layers!r}")
        return KVLayout(len(layers), self.num_kv_heads, self.head_dim, self.dtype,
                        part_of=LayoutPart(self.fingerprint, tuple(layers)), is_latent=self.is_latent)

    def share(self, layers: tuple[int, ...], heads: tuple[int, int]) -> KVLayout:
        """The plain layout of `layers` and KV heads [first, last) of this one: a rank's share of the model's KV
        under pipeline / tensor parallelism (its fingerprint names the parent, the layers and the heads)."""
        first, last = heads
        if not 0 <= first < last <= self.num_kv_heads:
            raise ValueError(f"a share needs heads within 0..{self.num_kv_heads}, got [{first}, {last})")
        if (first, last) == (0, self.num_kv_heads):
            return self.part(layers)
        part = self.part(layers)
        return KVLayout(part.num_layers, last - first, self.head_dim, self.dtype,
                        part_of=LayoutPart(self.fingerprint, tuple(layers), (first, last)), is_latent=self.is_latent)

    def stale_rows(self, num_tokens: int) -> tuple[tuple[tuple[int, ...], int], ...]:
        """(layers, end) per window group: after a prefix of num_tokens those layers never read positions
        [0, end) again (end = num_tokens - W + 1, or 0)."""
        return tuple((g.layers, g.window_start(num_tokens)) for g in self.window_groups if g.window_start(num_tokens))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def dtype_code(self) -> int:
        return DTYPES[self.dtype][2]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1].itemsize

    @property
    def num_states(self) -> int:
        """What a token holds per layer and head slot: 2 (K, V), or 1 (a latent)."""
        return 1 if self.is_latent else 2

    def shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_states, self.num_kv_heads, num_tokens, self.head_dim)

    def num_bytes(self, num_tokens: int) -> int:
        return self.num_layers * self.num_states * self.num_kv_heads * num_tokens * self.head_dim * self.itemsize

    @property
    def fingerprint(self) -> bytes:
        """8 stable bytes naming (layers, heads, head_dim, dtype, layer groups, latent); independent of Python's hash
        seed. A K|V layout without window groups keeps the fingerprint plain layouts always had."""
        text = f"L{self.num_layers}/H{self.num_kv_heads}/D{self.head_dim}/{self.dtype}"
        for group in self.groups:
            text += f"/G{group.window}:{','.join(map(str, group.layers))}:{group.num_kv_heads}x{group.head_dim}"
        if self.is_latent:
            text += "/latent"
        if self.part_of is not None:
            text += f"/P{self.part_of.parent.hex()}:{','.join(map(str, self.part_of.layers))}"
            if self.part_of.heads is not None:
                text += f":K{self.part_of.heads[0]}-{self.part_of.heads[1]}"
        return hashlib.sha256(text.encode()).digest()[:8]

    def check(self, kv: torch.Tensor, num_tokens: int | None = None) -> None:
        """Raise ValueError unless `kv` is [L, S, H, T, D] for this layout (T = num_tokens if given)."""
        expected = self.shape(kv.shape[3] if kv.dim() == 5 and num_tokens is None else (num_tokens or 0))
        if kv.dim() != 5 or tuple(kv.shape) != expected:
            states = "1 (latent)" if self.is_latent else "2"
            raise ValueError(f"kv must have shape {expected} [layers, {states}, kv_heads, tokens, head_dim], "
                             f"got {tuple(kv.shape)}")
