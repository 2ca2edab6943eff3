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


def get_codec(name: str, level: int | None = None) -> Codec:
    """The codec called `name` ("raw", "int8", "cachegen"), at `level` (None: the codec's default). cachegen is
    imported only when asked for (it loads numba)."""
    if name == "raw":
        from kvfabric.codec.raw import RawCodec
        if level not in (None, 0):
            raise ValueError(f"the raw codec has no levels, got level={level}")
        return RawCodec()
    if name == "int8":
        from kvfabric.codec.int8 import Int8Codec
        return Int8Codec() if level is None else Int8Codec(level)
    if name == "cachegen":
        from kvfabric.codec.cachegen import CacheGenCodec
        return CacheGenCodec() if level is None else CacheGenCodec(level)
    if name == "video":  # needs PyAV: VideoUnavailable (an ImportError naming it) without
        from kvfabric.codec.video import VideoCodec
        return VideoCodec() if level is None else VideoCodec(level)
    raise ValueError(f"unknown codec {name!r}; choose one of ['cachegen', 'int8', 'raw', 'video']")


def codec_for_id(codec_id: int) -> Codec:
    """A new decoder for a chunk header's codec id (the level is read from the header by `decode`)."""
    from kvfabric.codec.format import ChunkFormatError
    from kvfabric.codec.int8 import Int8Codec
    from kvfabric.codec.raw import RawCodec
    if codec_id == RawCodec.codec_id:
        return RawCodec()
    if codec_id == Int8Codec.codec_id:
        return Int8Codec()
    if codec_id == 2:
        from kvfabric.codec.cachegen import CacheGenCodec
        return CacheGenCodec()
    if codec_id == 3:
        from kvfabric.codec.video import VideoCodec
        return VideoCodec()
    raise ChunkFormatError(f"unknown codec id {codec_id}")


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
