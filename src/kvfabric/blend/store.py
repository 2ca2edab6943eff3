"""Passage-level KV storage through a kvfabric :class:`~kvfabric.CacheEngine`, one key set per layer group.

Contract
--------
* A passage's KV is computed on its own, from position 0 (K after RoPE at positions ``[0, n)``), and stored under
  keys of its own tokens only, in the namespace ``"<model_id>/blend"``: the same passage is found wherever it
  later appears in a prompt; its K is re-rotated there by the caller (:func:`kvfabric.blend.runner.rotate`).
* The KV is split into groups of ``layers_per_group`` layers (default 1: one entry per layer), each stored as an
  ordinary prompt of the engine whose tokens are the passage's tokens tagged with the group number in the high
  bits (``t | (g + 1) << 24``; token ids must be < 2**24). So a loader can fetch layer i+1 while layer i is being
  computed, from any tier, and every group is an independent, checked entry of the engine.
* The engine runs with ``save_partial_chunk=True`` (a passage shorter than a chunk is one partial chunk); a passage
  longer than a chunk spans several chained chunks. ``contains`` is true only when every group is fully cached.
* Nothing here raises for a missing or damaged entry: :meth:`load_group` returns False and the caller recomputes.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvfabric.cache.engine import CacheEngine
from kvfabric.config import Config
from kvfabric.kv.layout import KVLayout
from kvfabric.tiers.base import Tier

TAG_SHIFT = 24
MAX_TOKEN_ID = 1 << TAG_SHIFT


def passage_digest(tokens: Sequence[int] | np.ndarray) -> bytes:
    """sha256 of the token ids as little-endian uint32: the full hash that confirms a rolling-hash match."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<u4").tobytes()).digest()


class PassageStore:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, model_id: str,
                 config: Config | None = None, kv_dtype: str = "float16", layers_per_group: int = 1,
                 tiers: Sequence[Tier] | None = None) -> None:
        if layers_per_group <= 0 or num_layers % layers_per_group:
            raise ValueError(f"layers_per_group must divide num_layers={num_layers}, got {layers_per_group}")
        self.num_layers = num_layers
        self.group = layers_per_group
        self.num_groups = num_layers // layers_per_group
        if self.num_groups >= 1 << (32 - TAG_SHIFT):
            raise ValueError(f"{self.num_groups} layer groups do not fit the key tag; use larger groups")
        self.layout = KVLayout(layers_per_group, num_kv_heads, head_dim, kv_dtype)
        config = config or Config(chunk_size=1024, tiers=("cpu",))
        config = dataclasses.replace(config, save_partial_chunk=True)
        self.namespace = f"{model_id}/blend"
        self.cache = CacheEngine(config, self.layout, self.namespace, tiers=tiers)

    @classmethod
    def for_runner(cls, runner: Any, model_id: str, **kwargs: Any) -> PassageStore:
        return cls(num_layers=runner.num_layers, num_kv_heads=runner.num_kv_heads, head_dim=runner.head_dim,
                   model_id=model_id, **kwargs)

    # ---- keys --------------------------------------------------------------------------------------------
    def group_of(self, layer: int) -> int:
        return layer // self.group

    def tagged(self, tokens: Sequence[int] | np.ndarray, g: int) -> np.ndarray:
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError("a passage needs one or more token ids")
        if arr.min() < 0 or arr.max() >= MAX_TOKEN_ID:
            raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}) for passage keys")
        return (arr | ((g + 1) << TAG_SHIFT)).astype(np.uint32)

    # ---- API ---------------------------------------------------------------------------------------------
    def contains(self, tokens: Sequence[int] | np.ndarray) -> bool:
        n = len(tokens)
        return all(self.cache.lookup(self.tagged(tokens, g)) == n for g in range(self.num_groups))

    def store(self, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor) -> int:
        """kv [L, 2, H, n, D] (any float dtype) of ``tokens`` computed alone from position 0. Returns the number
        of chunks written (0 when already cached)."""
        n = len(tokens)
        if kv.dim() != 5 or kv.shape[0] != self.num_layers or kv.shape[3] != n:
            raise ValueError(f"kv must be [{self.num_layers}, 2, H, {n}, D], got {tuple(kv.shape)}")
        stored = 0
        for g in range(self.num_groups):
            stored += self.cache.store(self.tagged(tokens, g), kv[g * self.group:(g + 1) * self.group])
        return stored

    def load_group(self, tokens: Sequence[int] | np.ndarray, g: int, out: torch.Tensor) -> bool:
        """Copy group g of the passage's KV into ``out`` [layers_per_group, 2, H, n, D] (any float dtype, a view
        of a workspace is fine). False on a miss (then ``out`` holds garbage)."""
        got = self.cache.retrieve(self.tagged(tokens, g), out=out)
        return got.shape[3] == len(tokens)

    def bytes_per_token_group(self) -> int:
        return self.layout.num_bytes(1)

    def delete(self, tokens: Sequence[int] | np.ndarray) -> int:
        return sum(self.cache.delete(self.tagged(tokens, g)) for g in range(self.num_groups))

    def flush(self) -> None:
        self.cache.flush()

    def close(self) -> None:
        self.cache.close()
