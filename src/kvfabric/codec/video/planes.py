"""Values <-> pixels for the two modes of the video codec. Grids are [S, C, tokens] (segment, channel, token).

Near-lossless (levels 1-9): per (segment, channel) a step 2^(e/8) and a center; pixel = round((x - center) / step)
+ 2^(bits-1), so that every value decodes within half a step: |x - x_hat| <= step / 2 (plus float32 arithmetic and
the rounding to the output dtype). The step is the CacheGen profile's step for the level (its per-(layer, K/V,
channel) sensitivity; without a profile, the channel's std scaled by the level), raised where the channel's
range would not fit in `bits`: e >= e_fit, the smallest exponent with (range / 2) / step <= 2^(bits-1) - 1.
The center is the channel's mid-range as fp16. Range and center are those of tokens 1..: token 0 is stored exactly
beside the frames. A segment with a non-finite value, or whose range needs e > 127, is stored raw in the layout
dtype (its frames are flat).

Lossless (level 0): each value's layout-dtype bits as two byte planes. The high byte (sign, exponent, top mantissa
bits) is the frame; the low bytes are stored as they are (they are as good as random: nothing for a codec to find;
docs/design/measurements.md). Before coding, each channel's high byte is aligned: sign | ((magnitude - shift + 64)
mod 128), shift = the channel's mean magnitude byte, so that channels of different scales share one code table (a
bijection per channel: exact).
"""
from __future__ import annotations

import numpy as np

from kvfabric.codec.cachegen.quant import steps_from_exponents as steps  # the profile's grid: step = 2^(e/8)


def fit_exponents(need: np.ndarray) -> np.ndarray:
    """Smallest e with steps(e) >= need (need > 0; -128 for need <= 0)."""
    with np.errstate(divide="ignore"):
        e = np.ceil(8.0 * np.log2(np.maximum(need, 1e-38))).astype(np.int64)
    e = np.maximum(e, -128)
    e -= (steps(e - 1) >= need) & (e > -128)  # log2 rounding: step one down where that already fits
    e += steps(e) < need
    return e


def level_exponents(e_level: np.ndarray) -> np.ndarray:
    """A profile's exponents at a level, on the int8 grid every stream uses."""
    return np.clip(e_level, -128, 127).astype(np.int64)


def quantize(x: np.ndarray, e_level: np.ndarray | None, level: int, bits: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x [S, C, T] float32, a chunk's tokens. Returns (raw segments bool [S], centers fp16 [S, C], exponents int8
    [S, C], grid [S, C, T] uint8 / uint16). Centers and steps fit tokens 1.. (token 0 too in a 1-token chunk):
    token 0 is kept exact beside the frames (in a first chunk it is the attention sink, which the next tokens are
    very sensitive to and which would widen every channel it is an outlier in); its pixels are clipped.
    e_level: the profile's exponents at `level`, or None for the heuristic (std * 2^((level - 1) / 2 - 4))."""
    S, C, T = x.shape
    qmax = (1 << (bits - 1)) - 1
    finite = np.isfinite(x).all(axis=(1, 2))
    fit = x[:, :, 1:] if T > 1 else x
    with np.errstate(invalid="ignore", over="ignore"):
        lo, hi = fit.min(axis=2), fit.max(axis=2)
        center = np.clip(np.nan_to_num((lo + hi) / 2), -65504, 65504).astype(np.float16)
        c32 = center.astype(np.float32)
        need = np.nan_to_num(np.maximum(hi - c32, c32 - lo) / qmax, nan=0.0, posinf=1e38)
    e_fit = fit_exponents(need)
    if e_level is None:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            e_level = np.ceil(8.0 * np.log2(np.nan_to_num(fit.std(axis=2)) * 2.0 ** ((level - 1) / 2 - 4)))
        e_level = np.nan_to_num(e_level, nan=-128, neginf=-128, posinf=127)
    e = np.maximum(level_exponents(e_level), e_fit)
    raw = ~finite | (e > 127).any(axis=1)
    e = np.where(raw[:, None], 0, np.minimum(e, 127)).astype(np.int8)
    step = steps(e)
    off = 1 << (bits - 1)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.nan_to_num(np.rint((x - c32[:, :, None]) / step[:, :, None]))
    q = np.clip(q, -qmax, qmax) + off
    q[raw] = off
    return raw, center, e, q.astype(np.uint8 if bits == 8 else np.uint16)


def dequantize(pixels: np.ndarray, center: np.ndarray, step: np.ndarray, bits: int) -> np.ndarray:
    """pixels [H, n, D] of one segment -> float32 values [H, n, D] (center [C] fp16, step [C] float32, C = H * D)."""
    H, _, D = pixels.shape
    offset = np.float32(1 << (bits - 1))
    return (pixels.astype(np.float32) - offset) * step.reshape(H, 1, D) + center.astype(np.float32).reshape(H, 1, D)


def split_bytes(words: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """words [..., ] layout-dtype bits -> (high byte [...] uint8, low bytes [..., itemsize - 1] uint8)."""
    b = words.view(np.uint8).reshape(words.shape + (itemsize,))  # little-endian: the last byte is the high one
    return np.ascontiguousarray(b[..., itemsize - 1]), np.ascontiguousarray(b[..., :itemsize - 1])


def join_bytes(high: np.ndarray, low: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of split_bytes: (high [...], low [..., itemsize - 1]) -> uint16 / uint32 words."""
    wdt = np.uint16 if itemsize == 2 else np.uint32
    words = high.astype(wdt) << wdt(8 * (itemsize - 1))
    for i in range(itemsize - 1):
        words |= low[..., i].astype(wdt) << wdt(8 * i)
    return words


def align_shift(high: np.ndarray) -> np.ndarray:
    """Per channel of high [S, C, T]: the mean magnitude byte (uint8, 0..127)."""
    if high.shape[2] == 0:
        return np.zeros(high.shape[:2], np.uint8)
    return np.rint((high & 0x7F).mean(axis=2, dtype=np.float64)).astype(np.uint8)


def align(high: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """high [S, C, T] -> aligned pixels: sign | ((magnitude - shift + 64) mod 128)."""
    mag = (high & 0x7F).astype(np.int16) - shift[:, :, None].astype(np.int16) + 64
    return (high & 0x80) | (mag & 0x7F).astype(np.uint8)


def unalign(rows: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Inverse of align for one segment: rows [C, n] pixels, shift [C] -> high bytes [C, n]."""
    mag = (rows & 0x7F).astype(np.int16) + shift[:, None].astype(np.int16) - 64
    return (rows & 0x80) | (mag & 0x7F).astype(np.uint8)
