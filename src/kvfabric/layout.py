"""KV layout: the shape and dtype of one model's attention KV, and its fingerprint.

Contract: a `KVLayout` is an immutable value. Two layouts with the same fields have the same `fingerprint`
on every machine; the fingerprint goes into chunk keys and chunk headers, so a cache written for another
model shape or dtype can never be served (it is a different key, and the header check rejects it).
Tensor convention for a run of tokens: `[num_layers, 2, num_kv_heads, num_tokens, head_dim]` (2 = K, V).
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


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def dtype_code(self) -> int:
        return DTYPES[self.dtype][2]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1].itemsize

    def shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_dim)

    def num_bytes(self, num_tokens: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * num_tokens * self.head_dim * self.itemsize

    @property
    def fingerprint(self) -> bytes:
        """8 stable bytes naming (layers, heads, head_dim, dtype); independent of Python's hash seed."""
        text = f"L{self.num_layers}/H{self.num_kv_heads}/D{self.head_dim}/{self.dtype}"
        return hashlib.sha256(text.encode()).digest()[:8]

    def check(self, kv: torch.Tensor, num_tokens: int | None = None) -> None:
        """Raise ValueError unless `kv` is [L, 2, H, T, D] for this layout (T = num_tokens if given)."""
        expected = self.shape(kv.shape[3] if kv.dim() == 5 and num_tokens is None else (num_tokens or 0))
        if kv.dim() != 5 or tuple(kv.shape) != expected:
            raise ValueError(f"kv must have shape {expected} [layers, 2, kv_heads, tokens, head_dim], "
                             f"got {tuple(kv.shape)}")
