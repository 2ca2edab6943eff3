"""Raw codec: the payload is the KV tensor's bytes in the layout dtype, C order [L, 2, H, T, D].

Fast path on both sides: encode copies the (possibly strided) tensor once, straight into the blob's payload
region; decode views the payload as a tensor without copying and copies it once into the caller's buffer.
A caller that produces the KV itself (the vLLM connector gathers it from the paged cache) skips the encode copy:
`new_payload` hands out a blob whose payload region is a tensor to fill, and `seal` writes the header afterwards.
`view` is the zero-copy read: the checked payload of a blob as a tensor, valid while the blob is.
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


def new_payload(layout: KVLayout, num_tokens: int) -> tuple[memoryview, torch.Tensor]:
    """(blob, kv): an unsealed raw blob for `num_tokens` tokens and its payload region as a tensor
    [L, 2, H, T, D] in the layout dtype, to be filled by the caller and then `seal`ed. Uninitialized memory
    (torch.empty): no page is touched before the caller writes it (this runs on an inference engine's step)."""
    buf = torch.empty(HEADER_BYTES + layout.num_bytes(num_tokens), dtype=torch.uint8)
    return memoryview(buf.numpy()), buf[HEADER_BYTES:].view(layout.torch_dtype).view(layout.shape(num_tokens))


def seal(blob: bytearray | memoryview, key: bytes, layout: KVLayout) -> None:
    """Write the header of a raw blob whose payload holds the KV of `key` (checksums over the payload as it is)."""
    num_bytes = len(blob) - HEADER_BYTES
    header = ChunkHeader(RawCodec.codec_id, layout.dtype_code, 0, layout.fingerprint,
                         layout.shape(num_bytes // layout.num_bytes(1)), key, num_bytes)
    write_blob(header, blob)


class RawCodec:
    name = "raw"
    codec_id = 0
    is_lossless = True

    def encode(self, kv: torch.Tensor, key: bytes, layout: KVLayout) -> bytearray:
        layout.check(kv)
        blob = bytearray(HEADER_BYTES + layout.num_bytes(kv.shape[3]))
        copy_into(payload_view(blob, layout.torch_dtype, tuple(kv.shape)), kv)
        seal(blob, key, layout)
        return blob

    def view(self, header: ChunkHeader, blob: bytes | bytearray | memoryview, layout: KVLayout) -> torch.Tensor:
        """The payload of a parsed blob as a tensor [L, 2, H, T, D] in the layout dtype, without a copy."""
        if header.payload_len != layout.num_bytes(header.num_tokens) or header.dtype_code != layout.dtype_code:
            raise ChunkFormatError("raw payload does not match the layout")
        return payload_view(blob, layout.torch_dtype, header.shape)

    def decode(self, header: ChunkHeader, blob: memoryview, layout: KVLayout, out: torch.Tensor) -> None:
        if tuple(out.shape) != header.shape:
            raise ChunkFormatError(f"chunk shape {header.shape} does not fit the output {tuple(out.shape)}")
        copy_into(out, self.view(header, blob, layout))
