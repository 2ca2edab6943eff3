"""Lossless byte planes of the cachegen codec: a 4-lane rANS coder of one byte sequence with one frequency table
(level 0 codes the high byte of every value with it), and the helpers that build its tables.

A stream starts with the four final encoder states (lane 0 first, low word first); symbol i goes to lane i % 4.
Decoding checks that every word was used and every state is back at 2^16: a stream that does not decode exactly
is refused."""
from __future__ import annotations

import numpy as np

from kvfabric.codec.cachegen.jit import SIG, inline, jit
from kvfabric.codec.cachegen.rans import MASK, PB, RL


@inline
def _read(x, pos, words, end):  # noqa: ANN001, ANN202
    if x < RL:
        if pos < end:
            x = (x << 16) | np.int64(words[pos])
        else:
            x = x << 16
        pos += 1
    return x, pos


@inline
def _put_sym(x, pos, out, f, c):  # noqa: ANN001, ANN202
    if x >= (f << (32 - PB)):
        pos -= 1
        out[pos] = x & 0xFFFF
        x = x >> 16
    return ((x // f) << PB) + (x % f) + c, pos


@jit(SIG.get("encode_bytes"))
def encode_bytes(sym, freqs, cums, out):  # noqa: ANN001, ANN201
    """rANS-encode a byte sequence (4 lanes, symbol i in lane i % 4) with one table; returns the start index."""
    n = sym.shape[0]
    pos = out.shape[0]
    x0 = np.int64(RL)
    x1 = np.int64(RL)
    x2 = np.int64(RL)
    x3 = np.int64(RL)
    for i in range(n - 1, -1, -1):
        s = sym[i]
        f = np.int64(freqs[s])
        cc = np.int64(cums[s])
        lane = i & 3
        if lane == 0:
            x0, pos = _put_sym(x0, pos, out, f, cc)
        elif lane == 1:
            x1, pos = _put_sym(x1, pos, out, f, cc)
        elif lane == 2:
            x2, pos = _put_sym(x2, pos, out, f, cc)
        else:
            x3, pos = _put_sym(x3, pos, out, f, cc)
    for x in (x3, x2, x1, x0):
        pos -= 1
        out[pos] = x >> 16
        pos -= 1
        out[pos] = x & 0xFFFF
    return pos


@jit(SIG.get("decode_bytes"))
def decode_bytes(words, pos, end, slots, out):  # noqa: ANN001, ANN201
    """Inverse of encode_bytes into out (uint8, length n). Returns True iff the stream decoded exactly."""
    n = out.shape[0]
    if end - pos < 8:
        return False
    x0 = np.int64(words[pos]) | (np.int64(words[pos + 1]) << 16)
    x1 = np.int64(words[pos + 2]) | (np.int64(words[pos + 3]) << 16)
    x2 = np.int64(words[pos + 4]) | (np.int64(words[pos + 5]) << 16)
    x3 = np.int64(words[pos + 6]) | (np.int64(words[pos + 7]) << 16)
    pos += 8
    for i in range(n):
        lane = i & 3
        if lane == 0:
            x = x0
        elif lane == 1:
            x = x1
        elif lane == 2:
            x = x2
        else:
            x = x3
        e = np.int64(slots[x & MASK])
        x = ((e >> 8) & 0xFFF) * (x >> PB) + (e >> 20)
        out[i] = e & 0xFF
        x, pos = _read(x, pos, words, end)
        if lane == 0:
            x0 = x
        elif lane == 1:
            x1 = x
        elif lane == 2:
            x2 = x
        else:
            x3 = x
    return pos == end and x0 == RL and x1 == RL and x2 == RL and x3 == RL


def table_from_counts(counts: np.ndarray) -> np.ndarray:
    """Frequencies (sum 2^PB, >= 1 for every symbol that occurs) from byte counts [256]."""
    counts = np.asarray(counts, dtype=np.int64)
    present = counts > 0
    n = int(present.sum())
    if n == 0:
        raise ValueError("no symbols")
    budget = (1 << PB) - n
    total = counts.sum()
    raw = counts * (budget / total)
    freq = np.floor(raw).astype(np.int64)
    rest = budget - int(freq.sum())
    order = np.argsort(-(raw - freq), kind="stable")
    freq[order[:rest]] += 1
    freq[present] += 1
    return freq


def slots_for(freq: np.ndarray) -> np.ndarray:
    """Packed decode table [2^PB] (sym | freq << 8 | bias << 20) of one frequency row summing to 2^PB."""
    freq = np.asarray(freq, dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
    sym = np.repeat(np.arange(len(freq), dtype=np.int64), freq)
    bias = np.arange(1 << PB, dtype=np.int64) - cum[sym]
    return (sym | (freq[sym] << 8) | (bias << 20)).astype(np.uint32)

