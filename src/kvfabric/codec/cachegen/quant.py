"""Quantization kernels of the cachegen codec (numba): per-channel steps from integer exponents, trial and
closed-loop quantization (token groups: an anchor coded around the channel mean, the others as deltas to the
anchor's reconstruction), reconstruction, per-chunk statistics, and `encode_segments`, which quantizes and
entropy-codes a thread's share of a chunk's segments in one call."""
from __future__ import annotations

import math

import numpy as np

from kvfabric.codec.cachegen.jit import SIG, inline, jit, widen
from kvfabric.codec.cachegen.rans import QMAX, encode_lossy

# 2^(i/8) for i = 0..7 as exact float32 constants: steps are ldexp(POW8[e & 7], e >> 3), bit-identical everywhere.
POW8 = np.array([2.0 ** (i / 8.0) for i in range(8)], dtype=np.float32)


def steps_from_exponents(e: np.ndarray) -> np.ndarray:
    """float32 step 2^(e/8) for integer exponents e (exact same bits on every platform)."""
    e = np.asarray(e, dtype=np.int64)
    return np.ldexp(POW8[e & 7], (e >> 3).astype(np.int32)).astype(np.float32)


@jit()
def quantize_stats(x, head, mus, steps, asteps, G, has_head, sq, stride):  # noqa: ANN001, ANN201
    """Trial quantization of a segment x [H, T, D] (float32) in both modes, for the choice of mode, on the token
    groups g with g % stride == 0 (group 0, after the head, included).

    sq [C, 5] (float64, out): sums of q^2 for (flat, delta anchors, delta others), the anchor count and the
    token count."""
    H, T, D = x.shape
    C = H * D
    ref = np.empty(C, np.float32)
    inv = np.empty(C, np.float32)
    ainv = np.empty(C, np.float32)
    for c in range(C):
        inv[c] = np.float32(1.0) / steps[c]
        ainv[c] = np.float32(1.0) / asteps[c]
        ref[c] = head[c] if has_head else mus[c]
        sq[c, 0] = 0.0
        sq[c, 1] = 0.0
        sq[c, 2] = 0.0
        sq[c, 3] = 0.0
        sq[c, 4] = 0.0
    half = np.float32(0.5)
    for t in range(1 if has_head else 0, T):
        if (t // G) % stride != 0:
            continue
        anchor = t % G == 0
        for h in range(H):
            for d in range(D):
                c = h * D + d
                v = x[h, t, d]
                mu = mus[c]
                qf = math.floor((v - mu) * inv[c] + half)
                sq[c, 0] += qf * qf
                sq[c, 4] += 1.0
                if anchor:
                    qa = min(max(math.floor((v - mu) * ainv[c] + half), -QMAX), QMAX)
                    ref[c] = mu + np.float32(qa) * asteps[c]
                    sq[c, 1] += qa * qa
                    sq[c, 3] += 1.0
                else:
                    qd = math.floor((v - ref[c]) * inv[c] + half)
                    sq[c, 2] += qd * qd


@jit()
def quantize(x, head, mus, steps, asteps, dflag, G, has_head, q, sq):  # noqa: ANN001, ANN201
    """Closed-loop quantization of segment x [H, T, D] into q [T, C] (int32); sq [C, 2] gets sum q^2 of
    (anchors, others). A non-anchor of a delta channel is coded against its anchor's *reconstruction* (the head
    token's exact value for group 0), so its error is its own rounding only: |x - x_hat| <= step / 2.
    Why the loops look like this: the inner loop runs over the D contiguous values of one (head, token) with
    per-channel accumulators and a select instead of a branch, so LLVM vectorizes it (x is C-contiguous)."""
    H, T, D = x.shape
    C = H * D
    ref = np.empty(C, np.float32)
    inv = np.empty(C, np.float32)
    ainv = np.empty(C, np.float32)
    isd = np.empty(C, np.bool_)
    acc_a = np.zeros(C)
    acc_d = np.zeros(C)
    for c in range(C):
        inv[c] = np.float32(1.0) / steps[c]
        ainv[c] = np.float32(1.0) / asteps[c]
        ref[c] = mus[c]
        isd[c] = dflag[c] != 0
    t0 = 0
    if has_head:
        t0 = 1
        for c in range(C):
            q[0, c] = 0
            if isd[c]:
                ref[c] = head[c]
    half = np.float32(0.5)
    lim = np.float32(QMAX)
    for t in range(t0, T):
        qt = q[t]
        if t % G == 0:
            for h in range(H):
                xr = x[h, t]
                b = h * D
                for d in range(D):
                    c = b + d
                    mu = mus[c]
                    qf = min(max(np.float32(math.floor((xr[d] - mu) * ainv[c] + half)), -lim), lim)
                    qt[c] = np.int32(qf)
                    acc_a[c] += np.float64(qf) * np.float64(qf)
                    ref[c] = mu + qf * asteps[c] if isd[c] else ref[c]
        else:
            for h in range(H):
                xr = x[h, t]
                b = h * D
                for d in range(D):
                    c = b + d
                    qf = min(max(np.float32(math.floor((xr[d] - ref[c]) * inv[c] + half)), -lim), lim)
                    qt[c] = np.int32(qf)
                    acc_d[c] += np.float64(qf) * np.float64(qf)
    for c in range(C):
        sq[c, 0] = acc_a[c]
        sq[c, 1] = acc_d[c]


@jit(SIG.get("dequantize"))
def dequantize(q, head, mus, steps, asteps, dflag, G, has_head, out):  # noqa: ANN001, ANN201
    """Reconstruction from residuals q [T, C] into out [H, T, D] (float32): the same arithmetic as
    decode_lossy, for the reference coder."""
    H, T, D = out.shape
    for h in range(H):
        for d in range(D):
            c = h * D + d
            mu = mus[c]
            ref = mu
            t0 = 0
            if has_head:
                out[h, 0, d] = head[c]
                if dflag[c] != 0:
                    ref = head[c]
                t0 = 1
            for t in range(t0, T):
                if t % G == 0:
                    v = mu + np.float32(q[t, c]) * asteps[c]
                    out[h, t, d] = v
                    ref = v if dflag[c] != 0 else mu
                else:
                    out[h, t, d] = ref + np.float32(q[t, c]) * steps[c]


@jit(SIG.get("chunk_stats"))
def chunk_stats(x, t0, st):  # noqa: ANN001, ANN201
    """Per channel of x [L, 2, H, T, D] (float32, C-contiguous), over tokens t >= t0: st [S, C, 4] =
    (sum, sum of squares, min, max), S = 2L segments, C = H * D channels."""
    L, _, H, T, D = x.shape
    sm = np.empty(D)
    sq = np.empty(D)
    lo = np.empty(D, np.float32)
    hi = np.empty(D, np.float32)
    for s in range(2 * L):
        l = s // 2
        k = s % 2
        for h in range(H):
            sm[:] = 0.0
            sq[:] = 0.0
            lo[:] = np.inf
            hi[:] = -np.inf
            for t in range(t0, T):
                for d in range(D):
                    v = x[l, k, h, t, d]
                    w = np.float64(v)
                    sm[d] += w
                    sq[d] += w * w
                    lo[d] = min(lo[d], v)
                    hi[d] = max(hi[d], v)
            for d in range(D):
                c = h * D + d
                st[s, c, 0] = sm[d]
                st[s, c, 1] = sq[d]
                st[s, c, 2] = lo[d]
                st[s, c, 3] = hi[d]


@jit(SIG.get("widen_f16"))
def widen_f16(bits, x):  # noqa: ANN001, ANN201
    """x = the float32 values of fp16 bits [2, H, T, D] (both any strides): exact, at memory speed."""
    K2, H, T, D = bits.shape
    for k in range(K2):
        for h in range(H):
            for t in range(T):
                for d in range(D):
                    x[k, h, t, d] = widen(bits[k, h, t, d])


@jit(SIG.get("mode_costs"))
def mode_costs(x, segs, head, mus, steps, asteps, G, has_head, sq, cost, stride):  # noqa: ANN001, ANN201
    """For the listed segments: cost [S, C, 2] = estimated bits per token of (flat, delta) coding of each
    channel (Gaussian model: half the log2 of the mean squared residual), from every `stride`-th group."""
    L, _, H, T, D = x.shape
    for i in range(segs.shape[0]):
        s = segs[i]
        quantize_stats(x[s // 2, s % 2], head[s], mus[s], steps[s], asteps[s], G, has_head, sq, stride)
        for c in range(H * D):
            n = max(sq[c, 4], 1.0)
            na = sq[c, 3]
            nd = n - na
            cost[s, c, 0] = 0.5 * n * math.log2(max(sq[c, 0] / n, 0.01))
            cost[s, c, 1] = 0.5 * na * math.log2(max(sq[c, 1] / max(na, 1.0), 0.01)) + \
                0.5 * nd * math.log2(max(sq[c, 2] / max(nd, 1.0), 0.01))


@inline
def _index_for(sumsq, n):  # noqa: ANN001, ANN202
    """Nearest model index (log scale: four per octave, sigma 1/16 at index 0) of the residual scale
    sqrt(sumsq / n)."""
    if n <= 0 or sumsq <= 0.0:
        return 0
    i = math.floor((0.5 * math.log2(sumsq / n) + 4.0) * 4.0 + 0.5)
    return min(max(i, 0), 63)


@jit(SIG.get("encode_segments"))
def encode_segments(x, segs, head, mus, steps, asteps, dflag, ia, idx, choose, G, has_head, fc, rcps,  # noqa: ANN001, ANN201, E501
                    qbuf, sq, words, starts):
    """Quantize and rANS-code the listed segments of x [L, 2, H, T, D]. Per segment s (rows of the [S, C]
    parameter arrays): when choose[s], the models ia/idx [S, C] are fitted here (ia = 255 keeps a flat
    channel's anchors on the delta model); words[s] receives the code at its tail, starts[s] its first word."""
    L, _, H, T, D = x.shape
    C = H * D
    t0 = 1 if has_head else 0
    na = 0
    for t in range(t0, T):
        if t % G == 0:
            na += 1
    nd = T - t0 - na
    ja = np.empty(C, np.int32)
    ka = np.empty(C, np.int32)
    jd = np.empty(C, np.int32)
    kd = np.empty(C, np.int32)
    for i in range(segs.shape[0]):
        s = segs[i]
        quantize(x[s // 2, s % 2], head[s], mus[s], steps[s], asteps[s], dflag[s], G, has_head, qbuf, sq)
        for c in range(C):
            if choose[s]:
                if dflag[s, c] != 0:
                    ia[s, c] = _index_for(sq[c, 0], na)
                    idx[s, c] = _index_for(sq[c, 1], nd)
                else:
                    ia[s, c] = 255
                    idx[s, c] = _index_for(sq[c, 0] + sq[c, 1], na + nd)
            i_d = np.int64(idx[s, c])
            i_a = np.int64(ia[s, c]) if ia[s, c] != 255 else i_d
            kd[c] = max(0, (i_d - 32 + 3) // 4)
            jd[c] = i_d - 4 * kd[c]
            ka[c] = max(0, (i_a - 32 + 3) // 4)
            ja[c] = i_a - 4 * ka[c]
        starts[s] = encode_lossy(qbuf, ja, ka, jd, kd, G, has_head, fc, rcps, words[s])

