"""Ranged share reads: the rows of a stored part that one piece of a rank's share needs (kvfabric.kv.shares.Piece),
read and checked alone, so that a tensor-parallel rank reading a whole chunk (or a pipeline stage reading another
shape's share) reads its own heads and layers, not every byte of the chunk.

Contract:
- `read_piece(core, key, piece, out)`: the piece's rows of the part stored under `key`, copied into
  `piece.into(out)` [l, S, h, T, D]. Returns (tier, bytes read), a miss (`ChunkMiss`), or None where the read
  cannot be ranged (not a raw payload of the part's layout, or a chunk written before the head table) and the
  caller reads the part whole, as before.
- Where the bytes come from: a disk file is mapped and only the pages of the rows read are touched; shared memory
  is read in place (its view re-checked after the copy: a writer that reused it makes a torn read, not damage);
  any other tier hands over the blob it read.
- The check is inside the cache: from a tier the cache does not trust, the head table is checked against its sum
  in the (checked) header, then each (layer, head) the piece holds against its digest (kvfabric.codec.heads),
  before anything is copied. A mismatch drops the chunk and counts it damaged, as a whole read's would.
- Counted: `share_ranged_reads` (pieces read this way) and `share_ranged_bytes` (the bytes they read).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from kvfabric.cache.core import MISSING, EngineCore
from kvfabric.cache.sources import ChunkMiss
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, check_table
from kvfabric.codec.heads import DIGEST, head_axis, mismatched, payload_words
from kvfabric.host.pages import map_file
from kvfabric.kv.blocks import BlockLayout, as_words, to_tokens
from kvfabric.kv.shares import Piece
from kvfabric.tiers.stack import StackHit


def read_piece(c: EngineCore, key: bytes, piece: Piece, out: torch.Tensor) -> tuple[str, int] | ChunkMiss | None:
    """See the module doc. `out` [L, S, H, T, D]: the reader's share, whose `piece.into(out)` this fills."""
    found = c.stack.get(key, c.scratch(), promote=False, in_place=True, verify_payload=False, ranged=True)
    if found is None:
        return MISSING
    header, mapping = found.header, None
    try:
        try:
            c.decoders.check_raw(header, piece.part.layout, out.shape[3])
        except ChunkFormatError:
            return None  # another codec or layout: the whole read decodes it, or drops it saying why
        if not header.table_len and not found.is_verified:
            return None  # written before the head table: nothing to check a range against
        if found.ranged is None:
            payload = np.frombuffer(found.blob, np.uint8, count=header.payload_len, offset=HEADER_BYTES)
        elif found.ranged.fd < 0:
            return None
        else:
            mapping = map_file(found.ranged.fd, 0, HEADER_BYTES + header.payload_len)
            if mapping is None:
                return c.drop(key, found.tier, "truncated: the blob is shorter than its header says", is_damaged=True)
            assert mapping.array is not None
            payload = mapping.array[HEADER_BYTES:]
        got = _read(c, key, found, payload, piece, out)
        del payload  # the mapping closes only once no view of it is left
    finally:
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view kept by an error's traceback: unmapped when it goes
                mapping.close()
        if found.ranged is not None:
            found.ranged.close()
    if isinstance(got, ChunkMiss):
        return got
    c.counters.add("share_ranged_reads")
    c.counters.add("share_ranged_bytes", got)
    return found.tier, got


def _read(c: EngineCore, key: bytes, found: StackHit, payload: np.ndarray, piece: Piece,
          out: torch.Tensor) -> int | ChunkMiss:
    """The piece's rows of payload (the stored KV bytes, then the head table) checked and copied: the bytes read."""
    header = found.header
    words = payload_words(payload[:header.kv_len], header.shape, header.itemsize, header.blocks)
    if not found.is_verified:
        failure = _check(words, payload[header.kv_len:header.payload_len].data, header, piece)
        if failure:
            return _failed(c, key, found, failure)
    num_bytes = _copy(words, header.blocks, piece, out)
    if found.view is not None and not found.view.is_current():
        c.counters.add("torn_reads")
        return ChunkMiss("torn")
    return num_bytes + header.table_len


def _check(words: np.ndarray, table: memoryview, header: ChunkHeader, piece: Piece) -> str:
    """Why the piece's rows cannot be trusted, or "" when the table and their digests check out."""
    try:
        check_table(table, header)
    except ChunkFormatError as exc:
        return str(exc)
    digests = np.frombuffer(table, DIGEST).reshape(header.shape[0], header.shape[2])
    bad = mismatched(words, head_axis(header.blocks), digests, range(*piece.src_layers), range(*piece.src_heads))
    return "" if bad is None else f"head digest mismatch (layer {bad[0]}, KV head {bad[1]})"


def _failed(c: EngineCore, key: bytes, found: StackHit, why: str) -> ChunkMiss:
    if found.view is not None and not found.view.is_current():  # reused under the reader, not damaged
        c.counters.add("torn_reads")
        return ChunkMiss("torn")
    return c.drop(key, found.tier, why, is_damaged=True)


def _copy(words: np.ndarray, blocks: BlockLayout | None, piece: Piece, out: torch.Tensor) -> int:
    """The piece's rows of words [L, ...] (the stored payload) into piece.into(out); the bytes read."""
    (l0, l1), (h0, h1) = piece.src_layers, piece.src_heads
    rows = words[l0:l1][(slice(None),) * (head_axis(blocks) + 1) + (slice(h0, h1),)]
    target = piece.into(out)  # [l, S, h, T, D]
    dtype = piece.part.layout.torch_dtype
    # same dtype: a copy of bits straight into the target, strided on both sides (to_tokens splits only the
    # target's token axis: its reshapes are views, never a copy written to); another: the bits first, then converted
    dst = as_words(target) if target.dtype == dtype else np.empty(tuple(target.shape), dtype=words.dtype)
    if blocks is None:
        np.copyto(dst, rows)
    else:
        to_tokens(rows, blocks, dst)
    if target.dtype != dtype:
        target.copy_(torch.from_numpy(dst).view(dtype))
    return int(rows.nbytes)
