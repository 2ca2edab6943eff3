"""Codec protocol: KV tensor <-> chunk blob (header + payload, see codec.format).

Contract for every codec (tests/test_codec_contract.py runs the same suite on each):
- `encode(kv, key, layout)` takes kv [num_layers, 2, num_kv_heads, num_tokens, head_dim] (any float dtype, any
  strides) and returns one blob: header + payload, checksummed, ready to store or send.
- `decode(header, blob, layout, out)` writes the chunk into `out` (a [L, 2, H, T, D] view of any float dtype) and
  never reads outside the blob; a payload that does not decode raises ChunkFormatError (a miss for the caller).
- Lossless codecs return exactly the stored values (in the layout dtype); lossy ones say so in `is_lossless`.
Codecs are made from the registry (codec.registry): by name and level, or by a header's codec id.
"""
from __future__ import annotations

from typing import Protocol

import torch

from kvfabric.codec.format import ChunkHeader
from kvfabric.codec.registry import codec_for_id
from kvfabric.layout import KVLayout


class Codec(Protocol):
    name: str
    codec_id: int
    is_lossless: bool

    def encode(self, kv: torch.Tensor, key: bytes, layout: KVLayout) -> bytearray: ...

    def decode(self, header: ChunkHeader, blob: memoryview, layout: KVLayout, out: torch.Tensor) -> None: ...


class Decoders:
    """One decoder per codec id, made on first use and kept: a codec may hold scratch buffers and worker threads
    (cachegen) that are worth reusing from chunk to chunk. One instance per engine or receiver."""

    def __init__(self) -> None:
        self._by_id: dict[int, Codec] = {}

    def __getitem__(self, codec_id: int) -> Codec:
        codec = self._by_id.get(codec_id)
        if codec is None:
            codec = self._by_id[codec_id] = codec_for_id(codec_id)
        return codec
