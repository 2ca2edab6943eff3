"""Raw codec: the payload is the KV tensor's bytes in the layout dtype, C order [L, 2, H, T, D].

Fast path on both sides: encode copies the (possibly strided) tensor once, straight into the blob's payload
region; decode views the payload as a tensor without copying and copies it once into the caller's buffer.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, write_blob
from kvfabric.layout import KVLayout


def payload_view(blob: bytearray | memoryview | bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero-copy tensor over the payload region of `blob`."""
    with warnings.catch_warnings():  # read-only buffers (bytes, mmap) are fine: we only read or copy into them
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(blob, dtype=torch.uint8, offset=HEADER_BYTES)
    return flat.view(dtype).view(shape)


# torch runs a copy on its intra-op thread pool once it exceeds this many elements; on a small machine whose
# other core is busy that fork/join costs 20-40x (measured here: 0.3 GB/s vs 8-13 GB/s single-threaded).
_SERIAL_ELEMENTS = 32768 - 1
_NUMPY_SAME = {torch.float16: torch.float16, torch.float32: torch.float32, torch.bfloat16: torch.int16}


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) on the calling thread only: memory-bound copies gain nothing from more threads, and a
    copy must not stall on a thread pool shared with the model. Same dtype: numpy memcpy (releases the GIL);
    dtype conversion: torch copies in pieces small enough to stay serial."""
    if dst.dtype == src.dtype:
        view = _NUMPY_SAME[dst.dtype]
        np.copyto(dst.view(view).numpy(), src.view(view).numpy())
        return
    d, s = dst.flatten(0, -3), src.flatten(0, -3)  # [N, T, D]
    step = max(1, _SERIAL_ELEMENTS // d.shape[-1])
    for i in range(d.shape[0]):
        for t in range(0, d.shape[1], step):
            d[i, t:t + step].copy_(s[i, t:t + step])


class RawCodec:
    name = "raw"
    codec_id = 0
    is_lossless = True

    def encode(self, kv: torch.Tensor, key: bytes, layout: KVLayout) -> bytearray:
        layout.check(kv)
        shape = tuple(kv.shape)
        num_bytes = layout.num_bytes(shape[3])
        blob = bytearray(HEADER_BYTES + num_bytes)
        copy_into(payload_view(blob, layout.torch_dtype, shape), kv)
        header = ChunkHeader(self.codec_id, layout.dtype_code, 0, layout.fingerprint, shape, key, num_bytes)  # type: ignore[arg-type]
        write_blob(header, blob)
        return blob

    def decode(self, header: ChunkHeader, blob: memoryview, layout: KVLayout, out: torch.Tensor) -> None:
        if header.payload_len != layout.num_bytes(header.num_tokens) or header.dtype_code != layout.dtype_code:
            raise ChunkFormatError("raw payload does not match the layout")
        if tuple(out.shape) != header.shape:
            raise ChunkFormatError(f"chunk shape {header.shape} does not fit the output {tuple(out.shape)}")
        copy_into(out, payload_view(blob, layout.torch_dtype, header.shape))
