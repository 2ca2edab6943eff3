"""The lossy decode side of the cachegen codec (codec.py has the stream format and validates the prelude):
`decode_lossy` reads the head tokens, means and model choices of a lossy stream, checks every index and length,
and decodes the segments in the codec's threads (`split`); `stated_error_bound` is the contract's per-element bound.
Nothing here trusts the stream: any inconsistency raises ChunkFormatError before a kernel runs, and a segment
that does not decode exactly raises it after."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvfabric.codec.cachegen import profile as P
from kvfabric.codec.cachegen import quant as Q
from kvfabric.codec.cachegen import rans_decode
from kvfabric.codec.cachegen.family import NUM_SCALES, family
from kvfabric.codec.cachegen.wire import (
    CODER_RANS,
    FLAG_HEAD,
    FLAG_PROFILE,
    PRELUDE,
    SEG_EMBEDDED,
    SEG_PROFILE,
    SEG_RAW,
    Reader,
    SegmentCoder,
    as_out,
    bits_to_f32,
    dtype_bits,
    pad4,
)
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader
from kvfabric.kv.layout import KVLayout


def decode_lossy(rd: Reader, kinds: np.ndarray, lengths: np.ndarray, layout: KVLayout, o5: np.ndarray,
                 header: ChunkHeader, flags: int, pid: int, coder: int, G: int, ab: int,
                 split: Callable[[Callable[[np.ndarray], int], np.ndarray], list[int]],
                 reference: SegmentCoder | None = None) -> None:
    """Decode into o5: float32, or uint16 holding fp16 values (written by the kernel itself: no float32
    pass, no cast). On ChunkFormatError o5 may be partly written: the caller treats the chunk as a miss.
    A coder-1 stream needs `reference`, the codec's SegmentCoder (codec.py); without one it is refused."""
    L, _, H, T, D = header.shape
    S, C = 2 * L, H * D
    if not flags & FLAG_HEAD:
        raise ChunkFormatError("cachegen lossy stream without its head token")
    head = bits_to_f32(rd.array(dtype_bits(layout).str, (S, C)), layout)
    mu = rd.array("<f2", (S, C)).astype(np.float32)
    lossy = kinds != SEG_RAW
    if not np.isfinite(mu).all() or not np.isfinite(head[lossy]).all():
        raise ChunkFormatError("cachegen means or head not finite")
    e = np.zeros((S, C), np.int64)
    ia = np.zeros((S, C), np.int64)
    idx = np.zeros((S, C), np.int64)
    emb = np.flatnonzero(kinds == SEG_EMBEDDED)
    if len(emb):
        e[emb] = rd.array("i1", (len(emb), C))
        ia[emb] = rd.array("u1", (len(emb), C))
        idx[emb] = rd.array("u1", (len(emb), C))
    prof_rows = np.flatnonzero(kinds == SEG_PROFILE)
    if len(prof_rows):
        prof = P.by_id(pid, layout) if flags & FLAG_PROFILE and pid else None
        if prof is None or prof.e_base.shape != (S, C) or prof.group_size != G or prof.anchor_bits != ab:
            raise ChunkFormatError(f"cachegen stream needs profile {pid:#x}, which this build does not have")
        e_p, ia_p, id_p, _ = prof.params(header.level)
        e[prof_rows], ia[prof_rows], idx[prof_rows] = e_p[prof_rows], ia_p[prof_rows], id_p[prof_rows]
    elif flags & FLAG_PROFILE:
        raise ChunkFormatError("cachegen profile flag without profile segments")
    if ((ia >= NUM_SCALES) & (ia != 255)).any() or (idx >= NUM_SCALES).any():
        raise ChunkFormatError("cachegen model index out of range")
    dflag = (ia != 255).astype(np.uint8)
    steps = Q.steps_from_exponents(e)
    asteps = np.where(dflag != 0, Q.steps_from_exponents(e - 8 * ab), steps).astype(np.float32)
    i_a = np.where(dflag != 0, ia, idx)
    ka = np.maximum(0, (i_a - 32 + 3) // 4)
    kd = np.maximum(0, (idx - 32 + 3) // 4)
    ja, jd = (i_a - 4 * ka).astype(np.int32), (idx - 4 * kd).astype(np.int32)
    ka, kd = ka.astype(np.int32), kd.astype(np.int32)
    # segment data: lossy segments are u16 words, raw ones layout-dtype values; each starts 4-byte aligned
    base = rd.pos
    starts = np.zeros(S, np.int64)
    pos = base
    for s in range(S):
        if lengths[s] % 2 and kinds[s] != SEG_RAW:
            raise ChunkFormatError("cachegen segment length is odd")
        starts[s] = pos
        pos = pad4(pos + int(lengths[s]))
    if pos > len(rd.pay):
        raise ChunkFormatError("cachegen segment data runs past the payload")
    rd.pos = pos
    words_all = rd.pay[base:base + (pos - base) // 2 * 2].view("<u2")
    if not words_all.flags.aligned:
        words_all = words_all.copy()
    offs = (starts - base) // 2  # segment s: words_all[offs[s]:ends[s]]
    ends = offs + lengths // 2
    for s in np.flatnonzero(kinds == SEG_RAW):
        vals = bits_to_f32(rd.pay[starts[s]:starts[s] + lengths[s]].view(dtype_bits(layout)), layout)
        o5[s // 2, s % 2] = as_out(vals, o5).reshape(H, T, D)
    segs = np.flatnonzero(lossy).astype(np.int64)
    if not len(segs):
        return
    if coder != CODER_RANS and reference is None:
        raise ChunkFormatError("cachegen stream coded by the reference coder (coder 1): only a codec given that "
                               "coder decodes it")
    if coder == CODER_RANS:
        slots = family().slots

        def work(part: np.ndarray) -> int:
            bad = 0
            for s in part:
                l, k = divmod(int(s), 2)
                bad += not rans_decode.decode_lossy(words_all, offs[s], ends[s], o5[l, k], head[s], mu[s], steps[s],
                                          asteps[s], dflag[s], ja[s], ka[s], jd[s], kd[s], G, True, slots)
            return bad
        bad = sum(split(work, segs))
    else:
        assert reference is not None
        bad = 0
        for s in segs:
            try:
                q = reference.decode_segment(words_all[offs[s]:ends[s]], T, C, ia[s], idx[s], G)
            except ValueError:
                bad += 1
                continue
            seg = np.empty((H, T, D), np.float32)
            Q.dequantize(q, head[s], mu[s], steps[s], asteps[s], dflag[s], G, True, seg)
            o5[s // 2, s % 2] = as_out(seg, o5)
    if bad:
        raise ChunkFormatError(f"cachegen: {bad} segment(s) failed to decode")


def stated_error_bound(kv: torch.Tensor, blob: bytes | bytearray | memoryview, layout: KVLayout) -> torch.Tensor:
    """Per-element bound on |decode(encode(kv)) - kv| stated by this stream: half a quantization step of the
    element's channel (0 in the exact head token and raw segments), plus rounding to the layout dtype."""
    from kvfabric.codec.format import parse
    header = parse(blob)
    L, _, H, T, D = header.shape
    S, C = 2 * L, H * D
    if header.level == 0:
        return torch.zeros(header.shape)
    pay = np.frombuffer(memoryview(blob), np.uint8, offset=HEADER_BYTES)
    rd = Reader(pay)
    (*_, pid) = PRELUDE.unpack(rd.take(PRELUDE.size).tobytes())
    kinds = rd.array("u1", (S,))
    rd.array("<u4", (S,))
    rd.take(S * C * layout.itemsize)
    rd.take(S * C * 2)
    e = np.zeros((S, C), np.int64)
    emb = np.flatnonzero(kinds == SEG_EMBEDDED)
    if len(emb):
        e[emb] = rd.array("i1", (len(emb), C))
    prof_rows = np.flatnonzero(kinds == SEG_PROFILE)
    if len(prof_rows):
        e[prof_rows] = P.by_id(pid, layout).params(header.level)[0][prof_rows]  # type: ignore[union-attr]
    half = torch.from_numpy(Q.steps_from_exponents(e).astype(np.float64) / 2).reshape(L, 2, H, 1, D)
    half = half.expand(L, 2, H, T, D).clone()
    half[torch.from_numpy(kinds == SEG_RAW).reshape(L, 2)] = 0.0
    half[:, :, :, 0, :] = 0.0
    ulp = kv.float().abs() * (2.0 ** -10 if layout.dtype == "float16" else 2.0 ** -7 if layout.dtype == "bfloat16"
                              else 2.0 ** -23)
    return half + ulp + 1e-30
