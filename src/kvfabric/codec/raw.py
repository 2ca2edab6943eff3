"""Raw codec: the payload is the KV tensor's bytes in the layout dtype, C order [L, 2, H, T, D].

Fast path on both sides: encode copies the (possibly strided) tensor once, straight into the blob's payload
region (a buffer the caller passes in, e.g. a recycled one, or fresh memory), and checksums each layer while it
is still in cache; decode views the payload as a tensor without copying and copies it once into the caller's
buffer.
A caller that produces the KV itself (the vLLM connector gathers it from the paged cache) skips the encode copy:
`new_payload` hands out a blob whose payload region is a tensor to fill, and `seal` writes the header afterwards.
A blob for process memory may be left unsealed (`with_checksums=False`: no hash on the store path; the tier
stack fills the checksums in before the blob leaves the process, see codec.format).
`view` is the zero-copy read: the checked payload of a blob as a tensor, valid while the blob is.
Block layouts (kvfabric.kv.blocks): a payload may instead hold a paged engine's blocks as they are (`blocks` in
`new_payload` / `seal`, named in the header); `decode` converts it to [L, 2, H, T, D] (kvfabric.kv.blocks.to_tokens,
the one conversion), and a reader of that layout takes such a payload's blocks as they are (`Decoders.block_words`,
as integer words: the engine of that layout copies whole blocks).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from kvfabric.codec.format import (
    HEADER_BYTES,
    ChunkFormatError,
    ChunkHeader,
    fill_table,
    pack_header,
    pack_unsealed,
    write_blob,
)
from kvfabric.codec.heads import table_bytes
from kvfabric.codec.stream_copy import can_copy_chunks, copy_chunks, copy_rows, is_streamed, rows
from kvfabric.kv.blocks import BlockLayout, to_tokens
from kvfabric.kv.layout import KVLayout


def payload_view(blob: bytearray | memoryview | bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero-copy tensor over the KV of `blob`'s payload region (the head table after it left out)."""
    count = math.prod(shape) * dtype.itemsize  # no allocation: this runs on every zero-copy read
    if isinstance(blob, bytes) or memoryview(blob).readonly:
        with warnings.catch_warnings():  # read-only buffers (bytes, mmap) are fine: we only read or copy from them
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(blob, dtype=torch.uint8, count=count, offset=HEADER_BYTES)
    else:
        flat = torch.frombuffer(blob, dtype=torch.uint8, count=count, offset=HEADER_BYTES)
    return flat.view(dtype).view(shape)


# torch runs a copy on its intra-op thread pool once it exceeds this many elements; on a small machine whose
# other core is busy that fork/join makes the copy many times slower than a single-threaded one (see
# docs/design/measurements.md).
_SERIAL_ELEMENTS = 32768 - 1
_NUMPY_SAME = {torch.float16: torch.float16, torch.float32: torch.float32, torch.bfloat16: torch.int16}


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) on the calling thread only: memory-bound copies gain nothing from more threads, and a
    copy must not stall on a thread pool shared with the model. Same dtype: a KV chunk [L, 2, H, T, D] is
    copied row by row with streaming stores (stream_copy.py), anything else by numpy (both release the GIL);
    dtype conversion: torch copies in pieces small enough to stay serial."""
    if dst.dtype == src.dtype:
        view = _NUMPY_SAME[dst.dtype]
        d, s = dst.view(view).numpy(), src.view(view).numpy()
        d_rows = s_rows = None
        if is_streamed(d.nbytes):
            d_rows, s_rows = rows(d), rows(s)
        if d_rows is not None and s_rows is not None:
            copy_rows(d_rows, s_rows)
        else:
            np.copyto(d, s)
        return
    d, s = dst.flatten(0, -3), src.flatten(0, -3)  # [N, T, D]
    step = max(1, _SERIAL_ELEMENTS // d.shape[-1])
    for i in range(d.shape[0]):
        for t in range(0, d.shape[1], step):
            d[i, t:t + step].copy_(s[i, t:t + step])


def payload_bytes(layout: KVLayout, num_tokens: int, blocks: BlockLayout | None = None) -> int:
    """Bytes of a raw payload of num_tokens (in whole blocks, with a block layout)."""
    return layout.num_bytes(num_tokens if blocks is None else blocks.num_blocks(num_tokens) * blocks.block_size)


def blob_bytes(layout: KVLayout, num_tokens: int, blocks: BlockLayout | None = None) -> int:
    """Bytes of a raw blob of num_tokens: the header, the KV payload, its head table (codec.format)."""
    return HEADER_BYTES + payload_bytes(layout, num_tokens, blocks) + table_bytes(layout.shape(num_tokens))


def payload_shape(layout: KVLayout, num_tokens: int, blocks: BlockLayout | None = None) -> tuple[int, ...]:
    """[L, 2, H, T, D], or with a block layout [L, num_blocks, H, 2, B*D]."""
    if blocks is None:
        return layout.shape(num_tokens)
    return blocks.payload_shape(layout.num_layers, layout.num_kv_heads, num_tokens, layout.head_dim,
                                layout.num_states)


def new_payload(layout: KVLayout, num_tokens: int, out: memoryview | None = None,
                blocks: BlockLayout | None = None) -> tuple[memoryview, torch.Tensor]:
    """(blob, kv): an unsealed raw blob for `num_tokens` tokens and its payload region as a tensor
    [L, 2, H, T, D] (with `blocks`: [L, num_blocks, H, 2, B*D]) in the layout dtype, to be filled by the caller
    and then `seal`ed. In `out` (a writable buffer of exactly that size, e.g. a recycled one), else uninitialized
    memory (torch.empty): no page is touched before the caller writes it (this runs on an inference engine's
    step)."""
    size = blob_bytes(layout, num_tokens, blocks)
    if out is None:
        out = memoryview(torch.empty(size, dtype=torch.uint8).numpy())
    elif len(out) != size:
        raise ValueError(f"out holds {len(out)} bytes, the blob needs {size}")
    return out, payload_view(out, layout.torch_dtype, payload_shape(layout, num_tokens, blocks))


def _raw_header(num_tokens: int, key: bytes, layout: KVLayout, blocks: BlockLayout | None = None) -> ChunkHeader:
    shape = layout.shape(num_tokens)
    return ChunkHeader(RawCodec.codec_id, layout.dtype_code, 0, layout.fingerprint, shape, key,
                       payload_bytes(layout, num_tokens, blocks) + table_bytes(shape), blocks, table_bytes(shape))


def seal(blob: bytearray | memoryview, key: bytes, layout: KVLayout, with_checksums: bool = True,
         num_tokens: int | None = None, blocks: BlockLayout | None = None) -> None:
    """Write the header of a raw blob whose payload holds the KV of `key` (num_tokens, default all the payload
    holds; with `blocks`, in that block layout): with checksums over the payload as it is, or unsealed
    (format.pack_unsealed: for process memory, sealed by format.fill_checksums when it leaves)."""
    if num_tokens is None:
        num_tokens = (len(blob) - HEADER_BYTES - table_bytes(layout.shape(1))) // layout.num_bytes(1)
    header = _raw_header(num_tokens, key, layout, blocks)
    if with_checksums:
        write_blob(header, blob)
    else:
        blob[:HEADER_BYTES] = pack_unsealed(header)


def copy_and_checksum(dst: torch.Tensor, src: torch.Tensor, payload: memoryview) -> int:
    """copy_into(dst, src) for a contiguous dst [L, 2, H, T, D] over `payload`, and the xxh3-64 of the payload.
    Same dtype: layer by layer, and each layer's rows are hashed from the source right after their copy, while
    they are still in cache (the payload itself was written with streaming stores, around the cache; a separate
    pass over it would read it from memory again, adding a large part of the copy's own time: see
    docs/design/measurements.md)."""
    same = _NUMPY_SAME.get(dst.dtype) if dst.dtype == src.dtype else None
    d_rows = s_rows = None
    if same is not None:
        d_rows, s_rows = rows(dst.view(same).numpy()), rows(src.view(same).numpy())
    if d_rows is None or s_rows is None:
        copy_into(dst, src)
        return xxhash.xxh3_64_intdigest(payload)
    digest = xxhash.xxh3_64()
    num_layers, num_kv, num_heads = s_rows.shape[:3]
    for layer in range(num_layers):
        copy_rows(d_rows[layer:layer + 1], s_rows[layer:layer + 1])
        for kv in range(num_kv):
            for head in range(num_heads):
                digest.update(s_rows[layer, kv, head])
    return digest.intdigest()


class RawCodec:
    name = "raw"
    codec_id = 0
    is_lossless = True

    def encode(self, kv: torch.Tensor, key: bytes, layout: KVLayout, out: bytearray | memoryview | None = None,
               with_checksums: bool = True) -> bytearray | memoryview:
        """The blob of kv [L, 2, H, T, D]: in `out` when given (exactly HEADER_BYTES + the payload's bytes,
        writable), else in fresh memory. with_checksums=False: unsealed (see `seal`), one copy and no hash."""
        layout.check(kv)
        size = blob_bytes(layout, kv.shape[3])
        blob = bytearray(size) if out is None else out
        if len(blob) != size:
            raise ValueError(f"out holds {len(blob)} bytes, the blob needs {size}")
        view = memoryview(blob)
        payload = payload_view(blob, layout.torch_dtype, tuple(kv.shape))
        header = _raw_header(kv.shape[3], key, layout)
        if with_checksums:
            kv_sum = copy_and_checksum(payload, kv, view[HEADER_BYTES:HEADER_BYTES + header.kv_len])
            view[:HEADER_BYTES] = pack_header(header, kv_sum, fill_table(header, view))
        else:
            copy_into(payload, kv)
            view[:HEADER_BYTES] = pack_unsealed(header)
        return blob

    def encode_chunks(self, kv: torch.Tensor, spans: list[tuple[int, int]], keys: list[bytes], layout: KVLayout,
                      new_blob: Callable[[int], bytes | bytearray | memoryview]) -> list[memoryview] | None:
        """Unsealed blobs (`encode(..., with_checksums=False)`) of the token spans [s, e) of kv [L, 2, H, T, D]
        under `keys`, in buffers from `new_blob(size)`, with one streamed pass over kv (stream_copy.copy_chunks:
        kv is read in address order, not a chunk at a time). None, having taken no buffer, where that pass cannot
        take kv (stream_copy.can_copy_chunks): encode the chunks one by one."""
        layout.check(kv)
        same = _NUMPY_SAME.get(kv.dtype)
        src = kv.view(same).numpy() if same is not None else None
        if src is None or not can_copy_chunks(src):
            return None
        outs = [memoryview(new_blob(blob_bytes(layout, e - s))) for s, e in spans]
        payloads = [payload_view(out, layout.torch_dtype, layout.shape(e - s)).view(same).numpy()
                    for out, (s, e) in zip(outs, spans)]
        if not copy_chunks(src, spans, payloads):
            return None
        for out, key, (s, e) in zip(outs, keys, spans):
            out[:HEADER_BYTES] = pack_unsealed(_raw_header(e - s, key, layout))
        return outs

    def view(self, header: ChunkHeader, blob: bytes | bytearray | memoryview, layout: KVLayout) -> torch.Tensor:
        """The payload of a parsed blob as a tensor in the layout dtype, without a copy: [L, 2, H, T, D], or for a
        payload in a block layout [L, num_blocks, H, 2, B*D] (`header.blocks` says which)."""
        if header.kv_len != payload_bytes(layout, header.num_tokens, header.blocks) or \
                header.dtype_code != layout.dtype_code:
            raise ChunkFormatError("raw payload does not match the layout")
        return payload_view(blob, layout.torch_dtype, payload_shape(layout, header.num_tokens, header.blocks))

    def decode(self, header: ChunkHeader, blob: memoryview, layout: KVLayout, out: torch.Tensor) -> None:
        if tuple(out.shape) != header.shape:
            raise ChunkFormatError(f"chunk shape {header.shape} does not fit the output {tuple(out.shape)}")
        payload = self.view(header, blob, layout)
        if header.blocks is None:
            copy_into(out, payload)
            return
        same = out if out.dtype == payload.dtype else torch.empty(header.shape, dtype=payload.dtype)
        view = _NUMPY_SAME[payload.dtype]
        to_tokens(payload.view(view).numpy(), header.blocks, same.view(view).numpy())
        if same is not out:
            copy_into(out, same)
