"""The probability-model family shared by every cachegen stream: discretized Gaussians on a log grid of scales.

Each (layer, K/V, channel) group of a chunk is entropy-coded with its own model, named by one byte: a scale
index i in [0, NUM_SCALES). Index i means "residuals are ~ N(0, sigma_i^2), sigma_i = 2^(i/4 - 4)". Tables
exist for sigma <= 16 (33 base tables, PROB_BITS precision, 256-symbol alphabet); a wider model codes the
residual's k low bits raw (bypass) and its high part with base table j = i - 4k, so one small, cache-resident
set of tables serves every scale.

Alphabet of a base table: symbol 0 is the escape (the residual follows as 16 raw bits), symbol 128 + v codes
v in [-R_j, R_j]; symbols outside the support have frequency 0 and are escaped by the encoder.

The tables are data (tables/gauss_v1.npz, integer frequencies, no pickle), generated once by `generate()` and
identified in every stream by FAMILY_ID, a checksum of their contents: a decoder with other tables refuses the
stream instead of decoding garbage.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import xxhash

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
ALPHABET = 256
CENTER = 128  # symbol of residual 0
ESCAPE = 0
NUM_SCALES = 64  # scale indices 0..63: sigma from 2^-4 to 2^11.75
NUM_BASE = 33  # base tables: sigma_j = 2^(j/4 - 4) for j = 0..32 (up to 16)
MAX_SHIFT = 15
FILE = Path(__file__).with_name("tables") / "gauss_v1.npz"


def sigma_of(index: int | np.ndarray) -> np.ndarray:
    return np.exp2(np.asarray(index, dtype=np.float64) / 4.0 - 4.0)


def shift_of(index: np.ndarray) -> np.ndarray:
    """Raw low bits k of model `index` (0 for sigma <= 16)."""
    index = np.asarray(index, dtype=np.int64)
    return np.maximum(0, (index - (NUM_BASE - 1) + 3) // 4)


def base_of(index: np.ndarray) -> np.ndarray:
    return np.asarray(index, dtype=np.int64) - 4 * shift_of(index)


def generate() -> np.ndarray:
    """Frequencies [NUM_BASE, ALPHABET] (int64, each row sums to PROB_SCALE). Deterministic on one platform."""
    freqs = np.zeros((NUM_BASE, ALPHABET), dtype=np.int64)
    for j in range(NUM_BASE):
        sigma = float(sigma_of(j))
        radius = int(min(CENTER - 1, max(2, math.ceil(7.0 * sigma) + 1)))
        values = np.arange(-radius, radius + 1, dtype=np.float64)
        cdf = np.array([0.5 * math.erfc(-(v / (sigma * math.sqrt(2.0)))) for v in np.append(values - 0.5, radius + 0.5)])
        probs = np.diff(cdf)
        tail = max(0.0, 1.0 - float(probs.sum()))
        probs = np.append(probs, tail + 2e-4)  # escape: the Gaussian tail plus a floor for outliers
        probs = probs / probs.sum()
        n = len(probs)
        budget = PROB_SCALE - n  # every symbol in the support gets at least 1
        raw = probs * budget
        q = np.floor(raw).astype(np.int64)
        rest = budget - int(q.sum())
        order = np.argsort(-(raw - q), kind="stable")
        q[order[:rest]] += 1
        q += 1
        freqs[j, CENTER - radius:CENTER + radius + 1] = q[:-1]
        freqs[j, ESCAPE] = q[-1]
        assert freqs[j].sum() == PROB_SCALE
    return freqs


class Family:
    """The loaded tables: encoder (freq, cumulative) and decoder (slot -> packed sym|freq<<8|bias<<20) views."""

    def __init__(self, freqs: np.ndarray) -> None:
        if freqs.shape != (NUM_BASE, ALPHABET) or (freqs.sum(1) != PROB_SCALE).any() or (freqs < 0).any() \
                or (freqs[:, ESCAPE] <= 0).any() or freqs.max() >= PROB_SCALE:
            raise ValueError("malformed probability table family")
        self.freqs = np.ascontiguousarray(freqs, dtype=np.int32)
        cum = np.zeros_like(self.freqs)
        cum[:, 1:] = np.cumsum(self.freqs, axis=1)[:, :-1]
        self.cums = cum
        with np.errstate(divide="ignore"):
            self.rcps = np.where(self.freqs > 0, 1.0 / np.maximum(self.freqs, 1), 0.0)  # encoder's x // f
        self.fc = np.where(self.freqs > 0, self.freqs.astype(np.int64) | (cum.astype(np.int64) << 16), 0)
        self.id = xxhash.xxh3_64_intdigest(self.freqs.astype("<u2").tobytes())
        slots = np.empty((NUM_BASE, PROB_SCALE), dtype=np.uint32)
        for j in range(NUM_BASE):
            sym = np.repeat(np.arange(ALPHABET, dtype=np.uint32), self.freqs[j])
            bias = np.arange(PROB_SCALE, dtype=np.uint32) - self.cums[j][sym].astype(np.uint32)
            slots[j] = sym | (self.freqs[j][sym].astype(np.uint32) << 8) | (bias << 20)
        self.slots = slots


@lru_cache(maxsize=1)
def family() -> Family:
    with np.load(FILE, allow_pickle=False) as data:
        return Family(data["freqs"].astype(np.int64))


if __name__ == "__main__":  # regenerate the shipped tables: python -m kvfabric.codec.cachegen.family
    FILE.parent.mkdir(exist_ok=True)
    np.savez_compressed(FILE, freqs=generate().astype(np.uint16))
    print(FILE, hex(Family(generate()).id))
