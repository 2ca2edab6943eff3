"""Codec protocol: KV tensor <-> chunk blob (header + payload, see codec.format).

Contract for every codec (tests/test_codec_contract.py runs the same suite on each):
- `encode(kv, key, layout)` takes kv [num_layers, 2, num_kv_heads, num_tokens, head_dim] (any float dtype, any
  strides) and returns one blob: header + payload, checksummed, ready to store or send. A codec the registry
  marks `handles_latent` takes a latent layout's [L, 1, 1, T, D] (MLA) as well; `check_codec` refuses the others.
- `decode(header, blob, layout, out)` writes the chunk into `out` (a [L, 2, H, T, D] view of any float dtype) and
  never reads outside the blob; a payload that does not decode raises ChunkFormatError (a miss for the caller).
- Lossless codecs return exactly the stored values (in the layout dtype); lossy ones say so in `is_lossless`.
Codecs are made from the registry (codec.registry): by name and level, or by a header's codec id.
"""
from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch

from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader
from kvfabric.codec.raw import RawCodec, payload_bytes, payload_shape
from kvfabric.codec.registry import CodecChoice, codec_for_id, entry, handles_latent
from kvfabric.kv.blocks import WORD_DTYPES
from kvfabric.kv.layout import KVLayout


class Codec(Protocol):
    name: str
    codec_id: int
    is_lossless: bool

    def encode(self, kv: torch.Tensor, key: bytes, layout: KVLayout) -> bytearray: ...

    def decode(self, header: ChunkHeader, blob: memoryview, layout: KVLayout, out: torch.Tensor) -> None: ...


class LatentCodecError(ValueError):
    """A codec that codes K and V only, chosen for a latent (MLA) layout."""


def check_codec(choice: CodecChoice, layout: KVLayout) -> None:
    """LatentCodecError unless the codec chosen can store chunks of `layout` (checked where an engine is made)."""
    if layout.is_latent and not entry(choice.name).handles_latent:
        raise LatentCodecError(f"{choice.name} codes K and V; an MLA latent layout stores with a codec that "
                               "codes latents too: raw or int8")


class WrongLayoutError(ChunkFormatError):
    """A well-formed chunk made for another layout, or another number of tokens, than the reader expects."""


class Decoders:
    """One decoder per codec id, made on first use and kept: a codec may hold scratch buffers and worker threads
    (cachegen) that are worth reusing from chunk to chunk. One instance per engine or receiver.

    `decode` and `view` are the one "check the header against the layout, then decode" step of every reader:
    both raise WrongLayoutError for a chunk made for another layout or length, ChunkFormatError for a payload
    that does not decode (the caller discards the chunk and counts a miss)."""

    def __init__(self) -> None:
        self._by_id: dict[int, Codec] = {}

    def __getitem__(self, codec_id: int) -> Codec:
        codec = self._by_id.get(codec_id)
        if codec is None:
            codec = self._by_id[codec_id] = codec_for_id(codec_id)
        return codec

    def decode(self, header: ChunkHeader, blob: bytes | bytearray | memoryview, layout: KVLayout,
               out: torch.Tensor) -> None:
        """Decode a parsed chunk into out [L, 2, H, T, D] (any float dtype; T the chunk's tokens)."""
        _check_layout(header, layout, out.shape[3])
        self[header.codec_id].decode(header, memoryview(blob), layout, out)

    def view(self, header: ChunkHeader, blob: bytes | bytearray | memoryview, layout: KVLayout,
             num_tokens: int) -> torch.Tensor:
        """The chunk's KV [L, 2, H, num_tokens, D] in the layout dtype: a raw payload as a zero-copy view (valid
        while `blob` is; read it, never write it), any other codec decoded into a new tensor."""
        _check_layout(header, layout, num_tokens)
        codec = self[header.codec_id]
        if isinstance(codec, RawCodec) and header.blocks is None:
            return codec.view(header, blob, layout)
        kv = torch.empty(header.shape, dtype=layout.torch_dtype)
        codec.decode(header, memoryview(blob), layout, kv)
        return kv


    def block_words(self, header: ChunkHeader, blob: bytes | bytearray | memoryview, layout: KVLayout,
                    num_tokens: int) -> np.ndarray:
        """A raw payload in a block layout as it is: integer words of the layout's itemsize [L, num_blocks, H, 2,
        B*D] (a zero-copy numpy view; read only where the blob is). numpy, not a torch view: this runs on every
        chunk a loader opens, and the first open after the caches went cold spent most of its time in torch's
        view calls (docs/design/measurements.md)."""
        self.check_blocks(header, layout, num_tokens)
        shape = payload_shape(layout, header.num_tokens, header.blocks)
        return np.frombuffer(blob, dtype=WORD_DTYPES[layout.itemsize], count=math.prod(shape),
                             offset=HEADER_BYTES).reshape(shape)

    def check_blocks(self, header: ChunkHeader, layout: KVLayout, num_tokens: int) -> None:
        """`block_words`' checks alone (for a payload read piece by piece)."""
        if header.blocks is None:
            raise ChunkFormatError("not a raw payload in a block layout")
        self.check_raw(header, layout, num_tokens)

    def check_raw(self, header: ChunkHeader, layout: KVLayout, num_tokens: int) -> None:
        """That the payload is raw KV of `layout` (token-major or in a block layout), as a reader of parts of it
        needs; ChunkFormatError (WrongLayoutError: another layout or length) otherwise."""
        _check_layout(header, layout, num_tokens)
        if not isinstance(self[header.codec_id], RawCodec):
            raise ChunkFormatError("not a raw payload")
        if header.kv_len != payload_bytes(layout, header.num_tokens, header.blocks) or \
                header.dtype_code != layout.dtype_code:
            raise ChunkFormatError("raw payload does not match the layout")


def _check_layout(header: ChunkHeader, layout: KVLayout, num_tokens: int) -> None:
    if header.fingerprint != layout.fingerprint or header.shape != layout.shape(num_tokens):
        raise WrongLayoutError(f"chunk made for another layout or length {header.shape}, expected "
                               f"{layout.shape(num_tokens)}")
    if layout.is_latent and not handles_latent(header.codec_id):  # a forged header: never decoded
        raise ChunkFormatError(f"a latent chunk under codec id {header.codec_id}, which codes K and V only")
