"""Raw codec: the payload is the KV tensor's bytes in the layout dtype, C order [L, 2, H, T, D].

Fast path on both sides: encode copies the (possibly strided) tensor once, straight into the blob's payload
region; decode views the payload as a tensor without copying and copies it once into the caller's buffer.
"""
from __future__ import annotations

import warnings

import torch

from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, write_blob
from kvfabric.layout import KVLayout


def payload_view(blob: bytearray | memoryview | bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero-copy tensor over the payload region of `blob`."""
    with warnings.catch_warnings():  # read-only buffers (bytes, mmap) are fine: we only read or copy into them
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(blob, dtype=torch.uint8, offset=HEADER_BYTES)
    return flat.view(dtype).view(shape)


class RawCodec:
    name = "raw"
    codec_id = 0
    is_lossless = True

    def encode(self, kv: torch.Tensor, key: bytes, layout: KVLayout) -> bytearray:
        layout.check(kv)
        shape = tuple(kv.shape)
        num_bytes = layout.num_bytes(shape[3])
        blob = bytearray(HEADER_BYTES + num_bytes)
        payload_view(blob, layout.torch_dtype, shape).copy_(kv)
        header = ChunkHeader(self.codec_id, layout.dtype_code, 0, layout.fingerprint, shape, key, num_bytes)  # type: ignore[arg-type]
        write_blob(header, blob)
        return blob

    def decode(self, header: ChunkHeader, blob: memoryview, layout: KVLayout, out: torch.Tensor) -> None:
        if header.payload_len != layout.num_bytes(header.num_tokens) or header.dtype_code != layout.dtype_code:
            raise ChunkFormatError("raw payload does not match the layout")
        if tuple(out.shape) != header.shape:
            raise ChunkFormatError(f"chunk shape {header.shape} does not fit the output {tuple(out.shape)}")
        out.copy_(payload_view(blob, layout.torch_dtype, header.shape))
