"""Lossless level (0) of the cachegen codec: byte planes, the high byte of each value entropy-coded."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvfabric.codec.cachegen.planes import decode_bytes, encode_bytes, slots_for, table_from_counts
from kvfabric.codec.cachegen.rans import PB
from kvfabric.codec.cachegen.wire import SEG_BYTES, SEG_RAW, Reader, as_out, bits_to_f32, dtype_bits, round_to_layout
from kvfabric.codec.format import ChunkFormatError
from kvfabric.kv.layout import KVLayout


def encode_lossless(kv: torch.Tensor, layout: KVLayout, out: np.ndarray) -> list[np.ndarray]:
    """Level 0: per segment, the high byte of every value (sign + exponent: few distinct values) rANS-coded with
    a table of its own, the low bytes stored; a segment that would not shrink is stored raw. `out` is scratch
    (uint16, >= 2 * values + 64 words)."""
    L, _, H, T, D = (int(s) for s in kv.shape)
    S, isz = 2 * L, layout.itemsize
    bits = round_to_layout(kv, layout).reshape(S, -1)  # [S, H*T*D] bit patterns
    n = bits.shape[1]
    kinds = np.full(S, SEG_BYTES, np.uint8)
    segs: list[np.ndarray] = []
    lengths = np.zeros(S, "<u4")
    for s in range(S):
        b = bits[s].view(np.uint8).reshape(n, isz)  # little-endian: the last byte holds sign + exponent
        hi = np.ascontiguousarray(b[:, isz - 1])
        counts = np.bincount(hi, minlength=256)
        if (counts > 0).sum() < 2:  # a table needs two symbols (12-bit frequencies stay below 4096)
            counts[(int(hi[0]) + 1) % 256] = 1
        freq = table_from_counts(counts)
        cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
        start = encode_bytes(hi, freq.astype(np.int32), cum.astype(np.int32), out)
        low = np.ascontiguousarray(b[:, : isz - 1]).reshape(-1)
        seg = np.concatenate([freq.astype("<u2").view(np.uint8), low,
                              np.zeros(low.nbytes % 2, np.uint8), out[start:].view(np.uint8)])
        if seg.nbytes >= n * isz:
            kinds[s] = SEG_RAW
            seg = bits[s].view(np.uint8)
        segs.append(seg)
        lengths[s] = seg.nbytes
    return [kinds, lengths] + segs



def decode_lossless(rd: Reader, kinds: np.ndarray, lengths: np.ndarray, layout: KVLayout, o5: np.ndarray,
                    shape: tuple[int, ...], split: Callable[[Callable[[np.ndarray], int], np.ndarray], list[int]]
                    ) -> None:
    """Inverse of encode_lossless into o5 [L, 2, H, T, D]: float32, or uint16 holding fp16 values (an fp16 chunk's
    bits are copied as they are). Every segment's table and size are checked first, in this thread; the segments
    then decode in the codec's threads (`split`). Raises ChunkFormatError on any mismatch."""
    L, _, H, T, D = shape
    isz = layout.itemsize
    n = H * T * D
    low_n = n * (isz - 1)
    head_n = 512 + low_n + (low_n % 2)
    segs, slots = [], []
    for s in range(2 * L):
        seg = rd.take(int(lengths[s]))
        segs.append(seg)
        if kinds[s] == SEG_RAW:
            slots.append(None)
            continue
        if len(seg) < head_n + 8 or (len(seg) - head_n) % 2:
            raise ChunkFormatError("cachegen lossless segment too short")
        freq = seg[:512].view("<u2").astype(np.int64)
        if freq.sum() != 1 << PB or freq.max() >= 1 << PB:
            raise ChunkFormatError("cachegen lossless table invalid")
        slots.append(slots_for(freq))
    same_bits = o5.dtype == np.uint16 and layout.dtype == "float16"

    def work(part: np.ndarray) -> int:
        bad = 0
        bits = np.empty((n, isz), np.uint8)
        hi = np.empty(n, np.uint8)
        for s in part:
            seg = segs[s]
            if slots[s] is None:
                flat = seg
            else:
                words = seg[head_n:].view("<u2")
                if not words.flags.aligned:
                    words = words.copy()
                if not decode_bytes(words, 0, len(words), slots[s], hi):
                    bad += 1
                    continue
                bits[:, : isz - 1] = seg[512:512 + low_n].reshape(n, isz - 1)
                bits[:, isz - 1] = hi
                flat = bits.reshape(-1)
            dst = o5[s // 2, s % 2]
            if same_bits:
                dst[...] = flat.view(np.uint16).reshape(H, T, D)
                continue
            vals = bits_to_f32(flat.view(dtype_bits(layout)), layout).reshape(H, T, D)
            dst[...] = as_out(vals, o5)
        return bad
    if sum(split(work, np.arange(2 * L, dtype=np.int64))):
        raise ChunkFormatError("cachegen lossless segment failed to decode")
