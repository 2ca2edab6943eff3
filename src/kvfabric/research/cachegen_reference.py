"""CacheGen's reference coder: the same quantization in plain numpy and the same models coded with constriction's
range coder.

This module is a `SegmentCoder` (codec.cachegen.wire): `CacheGenCodec(coder=cachegen_reference)` codes and decodes
stream coder 1 with it (`kvfabric bench codec`'s "naive" baseline). The tests check that the compiled kernels
quantize bit-identically to `quantize_ref`, reconstruct identically to `dequantize_ref`, and code within a few
percent of what a well-kept entropy coding library achieves with the same models. constriction is imported only
here, so the runtime (rANS) path does not need it.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvfabric.codec.cachegen.family import PROB_SCALE, base_of, family, shift_of
from kvfabric.codec.cachegen.rans import QMAX


def anchor_mask(T: int, G: int) -> np.ndarray:
    t = np.arange(T)
    return (t % G == 0) & (t >= 1)


def quantize_ref(x: np.ndarray, head: np.ndarray, mu: np.ndarray, steps: np.ndarray, asteps: np.ndarray,
                 dflag: np.ndarray, G: int) -> np.ndarray:
    """q [T, C] (int32) for segment x [H, T, D]; token 0 is the stored head (q = 0). Same float32 arithmetic
    as quant.quantize."""
    H, T, D = x.shape
    C = H * D
    xs = np.ascontiguousarray(x.transpose(1, 0, 2).reshape(T, C), dtype=np.float32)
    inv = (np.float32(1.0) / steps).astype(np.float32)
    ainv = (np.float32(1.0) / asteps).astype(np.float32)
    half = np.float32(0.5)
    q = np.zeros((T, C), np.int64)
    am = anchor_mask(T, G)
    qa = np.clip(np.floor((xs[am] - mu) * ainv + half), -QMAX, QMAX)
    ra = (mu + qa.astype(np.float32) * asteps).astype(np.float32)
    q[am] = qa
    group = np.arange(T) // G  # anchor of token t is group * G (group 0: the head)
    refs = np.concatenate([np.where(dflag != 0, head, mu)[None].astype(np.float32),
                           np.where(dflag != 0, ra, mu).astype(np.float32)])  # [groups, C]
    rest = ~am
    rest[0] = False
    q[rest] = np.clip(np.floor((xs[rest] - refs[group[rest]]) * inv + half), -QMAX, QMAX)
    return q.astype(np.int32)


def dequantize_ref(q: np.ndarray, head: np.ndarray, mu: np.ndarray, steps: np.ndarray, asteps: np.ndarray,
                   dflag: np.ndarray, G: int, H: int, D: int) -> np.ndarray:
    T, C = q.shape
    am = anchor_mask(T, G)
    out = np.empty((T, C), np.float32)
    out[0] = head
    ra = (mu + q[am].astype(np.float32) * asteps).astype(np.float32)
    out[am] = ra
    refs = np.concatenate([np.where(dflag != 0, head, mu)[None].astype(np.float32),
                           np.where(dflag != 0, ra, mu).astype(np.float32)])
    rest = ~am
    rest[0] = False
    group = np.arange(T) // G
    out[rest] = refs[group[rest]] + q[rest].astype(np.float32) * steps
    return out.reshape(T, H, D).transpose(1, 0, 2)


def fit_indices(q: np.ndarray, dflag: np.ndarray, G: int) -> tuple[np.ndarray, np.ndarray]:
    """Model indices (anchor, other; anchor 255 for flat channels) fitted like quant.encode_segments."""
    T, C = q.shape
    am = anchor_mask(T, G)
    rest = ~am
    rest[0] = False
    q2 = q.astype(np.float64) ** 2
    sa, sd = q2[am].sum(0), q2[rest].sum(0)
    na, nd = int(am.sum()), int(rest.sum())

    def index(sumsq: np.ndarray, n: int) -> np.ndarray:
        with np.errstate(divide="ignore"):
            i = np.floor((0.5 * np.log2(np.where(sumsq > 0, sumsq, 1.0) / max(n, 1)) + 4.0) * 4.0 + 0.5)
        i = np.where((sumsq > 0) & (n > 0), i, 0)
        return np.clip(i, 0, 63).astype(np.int64)

    ia = np.where(dflag != 0, index(sa, na), 255)
    idx = np.where(dflag != 0, index(sd, nd), index(sa + sd, na + nd))
    return ia.astype(np.uint8), idx.astype(np.uint8)


@lru_cache(maxsize=None)
def _categorical(j: int):  # noqa: ANN202
    import constriction
    return constriction.stream.model.Categorical(family().freqs[j] / PROB_SCALE, perfect=False)


@lru_cache(maxsize=None)
def _uniform(size: int):  # noqa: ANN202
    import constriction
    return constriction.stream.model.Uniform(size)


def _kinds(T: int, G: int) -> tuple[np.ndarray, np.ndarray]:
    am = anchor_mask(T, G)
    rest = ~am
    rest[0] = False
    return np.flatnonzero(am), np.flatnonzero(rest)


def encode_segment(x: np.ndarray, head: np.ndarray, mu: np.ndarray, steps: np.ndarray, asteps: np.ndarray,
                   dflag: np.ndarray, ia: np.ndarray, idx: np.ndarray, choose: bool, G: int) -> np.ndarray:
    """Code one segment with constriction's range coder; returns its uint32 words. When `choose`, fits the
    models into ia/idx (in place), as the rANS path does."""
    import constriction
    q = quantize_ref(x, head, mu, steps, asteps, dflag, G)
    if choose:
        ia[:], idx[:] = fit_indices(q, dflag, G)
    T, C = q.shape
    enc = constriction.stream.queue.RangeEncoder()
    for c in range(C):
        for tokens, i in zip(_kinds(T, G), (int(ia[c]) if ia[c] != 255 else int(idx[c]), int(idx[c]))):
            if not len(tokens):
                continue
            k, j = int(shift_of(i)), int(base_of(i))
            qs = q[tokens, c].astype(np.int64)
            half = (1 << (k - 1)) if k else 0
            hi = (qs + half) >> k
            lo = qs + half - (hi << k)
            sym = hi + 128
            ok = (sym >= 1) & (sym <= 255)
            ok[ok] = family().freqs[j, sym[ok]] > 0
            enc.encode(np.where(ok, sym, 0).astype(np.int32), _categorical(j))
            if (~ok).any():
                enc.encode((qs[~ok] + 32768).astype(np.int32), _uniform(1 << 16))
            if k and ok.any():
                enc.encode(lo[ok].astype(np.int32), _uniform(1 << k))
    return enc.get_compressed().astype("<u4")


def decode_segment(words: np.ndarray, T: int, C: int, ia: np.ndarray, idx: np.ndarray, G: int) -> np.ndarray:
    """Inverse of encode_segment's coding: q [T, C]. Raises ValueError on a stream that does not decode."""
    import constriction
    data = np.ascontiguousarray(words).view("<u4") if words.dtype != np.uint32 else words
    if len(words) % 2 and words.dtype == np.uint16:
        raise ValueError("odd number of 16-bit words")
    dec = constriction.stream.queue.RangeDecoder(np.ascontiguousarray(data, dtype=np.uint32))
    q = np.zeros((T, C), np.int64)
    try:
        for c in range(C):
            for tokens, i in zip(_kinds(T, G), (int(ia[c]) if ia[c] != 255 else int(idx[c]), int(idx[c]))):
                if not len(tokens):
                    continue
                k, j = int(shift_of(i)), int(base_of(i))
                sym = np.asarray(dec.decode(_categorical(j), len(tokens)), dtype=np.int64)
                esc = sym == 0
                vals = (sym - 128) << k
                if esc.any():
                    vals[esc] = np.asarray(dec.decode(_uniform(1 << 16), int(esc.sum())), dtype=np.int64) - 32768
                if k and (~esc).any():
                    lo = np.asarray(dec.decode(_uniform(1 << k), int((~esc).sum())), dtype=np.int64)
                    vals[~esc] += lo - (1 << (k - 1))
                q[tokens, c] = vals
    except Exception as exc:  # constriction raises its own errors on malformed input
        raise ValueError(f"constriction decode failed: {exc}") from exc
    return np.clip(q, -QMAX, QMAX).astype(np.int32)
