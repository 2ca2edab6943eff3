"""Hot loops of the cachegen codec: the 4-lane interleaved rANS coder of quantized residuals, compiled with numba.
This module holds the stream format, its parameters and the encoder; rans_decode.py holds the decoder.

Why our own coder: constriction (the reference coder, kvfabric.research.cachegen_reference) decodes fewer symbols
a second on one thread than a 1 Gbit/s link delivers fp16 values (about 60 M/s; our target is 250 M/s; see
docs/design/measurements.md). Here each table lookup is a single load from a small shared table (family.py), four
independent rANS states hide its latency, and dequantization is fused into the decode loop, which writes straight
into the caller's (strided) output view, as float32 or as fp16 (jit.store).

rANS parameters: 32-bit states in [2^16, 2^32), 16-bit renormalization words, PROB_BITS = 12. A symbol whose
model has a raw shift k also carries k bypass bits; an escape symbol carries 16 raw bits (the residual + 32768).

Symbol order (the decoder's; the encoder runs it backwards): channels c = h * D + d are taken four at a time
(lanes 0-3 = channels 4b..4b+3, a lane past the last channel is dead); for each token t, lanes 0..3 in turn
decode one symbol: [symbol, renormalize][bypass bits, renormalize]. The stream starts with the four final
encoder states (lane 0 first, low word first); after the last symbol every state must be back at 2^16 and
every word consumed: the decoder checks both, so a stream that does not decode exactly is refused.

Robustness: every read is bounds-checked (past the end reads as 0 and marks the stream bad), table indices are
validated by the caller before a kernel runs, and all state arithmetic stays below 2^32 whatever the input, so a
hostile stream can produce only garbage values, never a crash or a hang (work is bounded by the output size).

Why the decoder's four lanes are written out by hand (the one repetition in this package): the same decoder with
an inlined per-lane helper returning (state, position, symbol) ran several times slower under numba 0.68, and
still clearly slower in a later check with the fused decode. The encoder's inlined per-lane helper
(`encode_symbol`) ran as fast as its lanes written out, so it uses one (docs/design/measurements.md).

Without numba the same functions run as plain Python (slow, for portability and tests of the fallback).
"""
from __future__ import annotations

import numpy as np

from kvfabric.codec.cachegen.jit import inline, jit

PB = 12
MASK = (1 << PB) - 1
RL = 1 << 16  # lower bound of a normalized state
QMAX = 32767  # |residual| bound (the escape codes 16 bits)


@inline
def flush_states(out, pos, x0, x1, x2, x3):  # noqa: ANN001, ANN201
    """End of an encode (which runs backwards): write the four final states before out[pos], lane 0 first and
    low word first; returns the new first word. Shared with planes.py."""
    for x in (x3, x2, x1, x0):
        pos -= 1
        out[pos] = x >> 16
        pos -= 1
        out[pos] = x & 0xFFFF
    return pos


@inline
def lane_channels(c0, C):  # noqa: ANN001, N803, ANN201
    """Channels of lanes 1-3 in the block starting at channel c0 (clamped to the last channel) and whether each
    lane is live (a lane past the last channel is dead)."""
    return min(c0 + 1, C - 1), min(c0 + 2, C - 1), min(c0 + 3, C - 1), c0 + 1 < C, c0 + 2 < C, c0 + 3 < C


@inline
def load_states(words, pos):  # noqa: ANN001, ANN201
    """The four initial decoder states at words[pos:pos + 8] (the caller checked there are 8 words)."""
    return (np.int64(words[pos]) | (np.int64(words[pos + 1]) << 16),
            np.int64(words[pos + 2]) | (np.int64(words[pos + 3]) << 16),
            np.int64(words[pos + 4]) | (np.int64(words[pos + 5]) << 16),
            np.int64(words[pos + 6]) | (np.int64(words[pos + 7]) << 16))


@inline
def encode_symbol(q, x, J, K, fc, rcps, out, pos):  # noqa: ANN001, N803, ANN201
    """Push one residual q onto state x with base table J and raw shift K, writing renormalization words
    backwards before out[pos]; returns the new (state, first word)."""
    if K > 0:
        half = np.int64(1) << (K - 1)
        hi = (q + half) >> K
        lo = q + half - (hi << K)
    else:
        hi = q
        lo = np.int64(0)
    s = hi + 128
    e = fc[J, s] if s >= 1 and s <= 255 else np.int64(0)
    if e != 0:
        r = rcps[J, s]
        if K > 0:
            n = np.int64(x >= (np.int64(1) << (32 - K)))
            out[pos - 1] = x & 0xFFFF
            pos -= n
            x = x >> (n << 4)
            x = (x << K) | lo
    else:  # escape: 16 raw bits, then the escape symbol
        e = fc[J, 0]
        r = rcps[J, 0]
        n = np.int64(x >= RL)
        out[pos - 1] = x & 0xFFFF
        pos -= n
        x = x >> (n << 4)
        x = (x << 16) | (q + 32768)
    f = e & 0xFFFF
    n = np.int64(x >= (f << (32 - PB)))
    out[pos - 1] = x & 0xFFFF
    pos -= n
    x = x >> (n << 4)
    d = np.int64(np.float64(x) * r)  # x // f via the reciprocal, then an exact fix-up
    m = x - d * f
    if m >= f:
        d += 1
        m -= f
    elif m < 0:
        d -= 1
        m += f
    return (d << PB) + m + (e >> 16), pos


@jit()
def encode_lossy(q_in, ja, ka, jd, kd, G, has_head, fc, rcps, out):  # noqa: ANN001, ANN201
    """rANS-encode residuals q_in [T, C] backwards into the tail of `out` (uint16); returns the index of the
    first word. ja/ka (anchor tokens) and jd/kd (the others): per-channel base table and raw shift; fc: the
    family's freq | cum << 16 (0 outside a table's support), rcps: 1 / freq."""
    T, C = q_in.shape
    pos = out.shape[0]
    x0 = np.int64(RL)
    x1 = np.int64(RL)
    x2 = np.int64(RL)
    x3 = np.int64(RL)
    t0 = 1 if has_head else 0
    nb = (C + 3) // 4
    for b in range(nb - 1, -1, -1):
        c0 = 4 * b
        c1, c2, c3, live1, live2, live3 = lane_channels(c0, C)
        ja0, ja1, ja2, ja3 = ja[c0], ja[c1], ja[c2], ja[c3]
        ka0, ka1, ka2, ka3 = ka[c0], ka[c1], ka[c2], ka[c3]
        jd0, jd1, jd2, jd3 = jd[c0], jd[c1], jd[c2], jd[c3]
        kd0, kd1, kd2, kd3 = kd[c0], kd[c1], kd[c2], kd[c3]
        for t in range(T - 1, t0 - 1, -1):
            if t % G == 0:
                J0, J1, J2, J3 = ja0, ja1, ja2, ja3
                K0, K1, K2, K3 = ka0, ka1, ka2, ka3
            else:
                J0, J1, J2, J3 = jd0, jd1, jd2, jd3
                K0, K1, K2, K3 = kd0, kd1, kd2, kd3
            if live3:
                x3, pos = encode_symbol(np.int64(q_in[t, c3]), x3, J3, K3, fc, rcps, out, pos)
            if live2:
                x2, pos = encode_symbol(np.int64(q_in[t, c2]), x2, J2, K2, fc, rcps, out, pos)
            if live1:
                x1, pos = encode_symbol(np.int64(q_in[t, c1]), x1, J1, K1, fc, rcps, out, pos)
            x0, pos = encode_symbol(np.int64(q_in[t, c0]), x0, J0, K0, fc, rcps, out, pos)
    return flush_states(out, pos, x0, x1, x2, x3)
