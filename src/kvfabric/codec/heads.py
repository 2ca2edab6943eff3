"""Head digests: the chunk format's table of one xxh3-64 per (layer, KV head) of a raw payload, so that a reader of
some layers' heads (a tensor-parallel rank, a pipeline stage) reads and checks only those, never the whole chunk.

A raw payload holds, per layer, every head's values (token-major `[S, H, T, D]`, or a block layout's
`[n, *block_shape]`). One head of one layer is `head_rows`: rows [R, C], each row contiguous, in payload order
(token-major: K then V, [2, T*D]; vllm-cpu and vllm HND blocks: one row a block; vllm NHD: one row a token of a
block). Its digest is xxh3-64 over those rows one after another, the same value whether hashed row by row (a few
long rows: no copy) or gathered first (many short rows: one call instead of hundreds).

The table is `[num_layers, num_kv_heads]` little-endian uint64, stored after the KV bytes (kvfabric.codec.format
says where, and protects it with its own checksum in the header). Pure numpy + xxhash: nothing compiled, so the
format layer that imports it stays importable everywhere.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import xxhash

from kvfabric.kv.blocks import WORD_DTYPES, BlockLayout

DIGEST = np.dtype("<u8")
STREAM_ROWS = 8  # up to this many rows a head is hashed row by row; more (short rows) are gathered first


def table_bytes(shape: Sequence[int]) -> int:
    """Bytes of the table of a raw chunk of decoded shape [L, S, H, T, D]."""
    return int(shape[0]) * int(shape[2]) * DIGEST.itemsize


def head_axis(blocks: BlockLayout | None) -> int:
    """The KV-head axis of one layer of a raw payload: [S, H, T, D], [n, H, ...], or vllm NHD [n, B, H, S*D]."""
    return 2 if blocks is not None and blocks.family == "vllm" and blocks.token_major else 1


def payload_words(payload: memoryview | np.ndarray, shape: Sequence[int], itemsize: int,
                  blocks: BlockLayout | None) -> np.ndarray:
    """The KV bytes of a raw payload as integer words of the layout's itemsize, in its payload shape:
    [L, S, H, T, D] or [L, n, *block_shape]."""
    num_layers, num_states, num_heads, num_tokens, head_dim = (int(d) for d in shape)
    dims = (num_layers, num_states, num_heads, num_tokens, head_dim) if blocks is None else \
        blocks.payload_shape(num_layers, num_heads, num_tokens, head_dim, num_states)
    count = math.prod(dims)
    return np.frombuffer(payload, dtype=WORD_DTYPES[itemsize], count=count).reshape(dims)


def head_rows(layer: np.ndarray, axis: int, head: int) -> np.ndarray:
    """One head of one layer's payload (`layer`: the payload shape without L) as rows [R, C], in payload order."""
    picked = layer[(slice(None),) * axis + (head,)]
    return picked.reshape(-1, math.prod(picked.shape[axis:]))


def rows_digest(rows: np.ndarray) -> int:
    if rows.shape[0] <= STREAM_ROWS:
        digest = xxhash.xxh3_64()
        for row in rows:
            digest.update(row)
        return digest.intdigest()
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(rows))


def digest_table(words: np.ndarray, axis: int, whole: xxhash.xxh3_64 | None = None) -> np.ndarray:
    """words [L, ...] (payload_words) -> the table [L, H] of head digests. `whole`: a hash of the KV bytes fed each
    layer right after its heads, while the layer is still in cache (one pass over memory for both)."""
    num_heads = words.shape[axis + 1]
    table = np.empty((words.shape[0], num_heads), dtype=DIGEST)
    for layer in range(words.shape[0]):
        slab = words[layer]
        for head in range(num_heads):
            table[layer, head] = rows_digest(head_rows(slab, axis, head))
        if whole is not None:
            whole.update(slab)
    return table


def mismatched(words: np.ndarray, axis: int, table: np.ndarray, layers: Sequence[int],
               heads: Sequence[int]) -> tuple[int, int] | None:
    """The first (layer, head) of those asked whose bytes in `words` do not match the table, or None."""
    for layer in layers:
        for head in heads:
            if rows_digest(head_rows(words[layer], axis, head)) != int(table[layer, head]):
                return layer, head
    return None
