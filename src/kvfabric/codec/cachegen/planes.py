"""Lossless byte planes of the cachegen codec: a 4-lane rANS coder of one byte sequence with one frequency table
(level 0 codes the high byte of every value with it), and the helpers that build its tables.

A stream starts with the four final encoder states (lane 0 first, low word first); symbol i goes to lane i % 4.
Decoding checks that every word was used and every state is back at 2^16: a stream that does not decode exactly
is refused."""
from __future__ import annotations

import numpy as np

from kvfabric.codec.cachegen.jit import SIG, inline, jit
from kvfabric.codec.cachegen.rans import MASK, PB, RL, flush_states, load_states


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
    xs = np.full(4, RL, np.int64)  # the lanes' states
    for i in range(n - 1, -1, -1):
        s = sym[i]
        xs[i & 3], pos = _put_sym(xs[i & 3], pos, out, np.int64(freqs[s]), np.int64(cums[s]))
    return flush_states(out, pos, xs[0], xs[1], xs[2], xs[3])


@jit(SIG.get("decode_bytes"))
def decode_bytes(words, pos, end, slots, out):  # noqa: ANN001, ANN201
    """Inverse of encode_bytes into out (uint8, length n). Returns True iff the stream decoded exactly."""
    n = out.shape[0]
    if end - pos < 8:
        return False
    xs = np.empty(4, np.int64)  # the lanes' states
    xs[0], xs[1], xs[2], xs[3] = load_states(words, pos)
    pos += 8
    for i in range(n):
        x = xs[i & 3]
        e = np.int64(slots[x & MASK])
        x = ((e >> 8) & 0xFFF) * (x >> PB) + (e >> 20)
        out[i] = e & 0xFF
        xs[i & 3], pos = _read(x, pos, words, end)
    return pos == end and xs[0] == RL and xs[1] == RL and xs[2] == RL and xs[3] == RL


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

