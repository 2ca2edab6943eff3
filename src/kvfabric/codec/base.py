"""Codec protocol: KV tensor <-> chunk blob (header + payload, see codec.format).

Contract for every codec (tests/test_codec_contract.py runs the same suite on each):
- `encode(kv, key, layout)` takes kv [num_layers, 2, num_kv_heads, num_tokens, head_dim] (any float dtype, any
  strides) and returns one blob: header + payload, checksummed, ready to store or send.
- `decode(header, blob, layout, out)` writes the chunk into `out` (a [L, 2, H, T, D] view of any float dtype) and
  never reads outside the blob; a payload that does not decode raises ChunkFormatError (a miss for the caller).
- Lossless codecs return exactly the stored values (in the layout dtype); lossy ones say so in `is_lossless`.
"""
from __future__ import annotations

from typing import Protocol

import torch

from kvfabric.codec.format import ChunkHeader
from kvfabric.layout import KVLayout


class Codec(Protocol):
    name: str
    codec_id: int
    is_lossless: bool

    def encode(self, kv: torch.Tensor, key: bytes, layout: KVLayout) -> bytearray: ...

    def decode(self, header: ChunkHeader, blob: memoryview, layout: KVLayout, out: torch.Tensor) -> None: ...


def get_codec(name: str) -> Codec:
    from kvfabric.codec.raw import RawCodec
    codecs: dict[str, type] = {"raw": RawCodec}
    if name not in codecs:
        raise ValueError(f"unknown codec {name!r}; choose one of {sorted(codecs)}")
    return codecs[name]()


def codec_for_id(codec_id: int) -> Codec:
    from kvfabric.codec.raw import RawCodec
    by_id: dict[int, type] = {RawCodec.codec_id: RawCodec}
    if codec_id not in by_id:
        from kvfabric.codec.format import ChunkFormatError
        raise ChunkFormatError(f"unknown codec id {codec_id}")
    return by_id[codec_id]()
