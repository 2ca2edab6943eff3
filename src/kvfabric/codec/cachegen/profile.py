"""Per-model profiles: offline-measured quantization steps and probability models, shared by every chunk.

CacheGen's observation is that the statistics of a model's KV (which channels matter, how spread each one is)
barely change from one context to the next, so they can be measured once per model instead of being shipped in
every chunk. A profile holds, for each (layer, K/V, channel) group:

- `e_base`: the level-1 quantization step as an exponent (step = 2^(e/8)), from the channel's sensitivity:
  the Fisher information of the next-token distribution with respect to that KV channel, measured with
  autograd on calibration text (the first token of each text, the attention sink, is left out: the codec keeps
  each chunk's first token exact anyway). A step proportional to 1/sqrt(Fisher) gives every channel the same
  expected share of the output error, which is the rate-optimal allocation for a fixed mean KL;
- `dflag`: whether the channel is coded as anchor + deltas (token locality) or flat around its mean;
- `ia4` / `id4`: the scale of the residuals of anchors / other tokens at level 1, as a model index
  (family.py) in quarter steps, so that any level's index is exact integer arithmetic.

A chunk coded with a profile stores only its per-channel means; the stream names the profile by `profile_id`
(a checksum of its arrays), and a decoder without that profile refuses the chunk (a miss, never garbage).
Profiles ship as `tables/profile_<layout fingerprint hex>.npz` (plain arrays, loaded with allow_pickle=False);
their meta (not part of the id) may name the model's default level (`default_level`).
`build` makes one from a Fisher diagonal and calibration KV; `kvfabric profile cachegen` (kvfabric.research.
calibrate) measures those on the model and rebuilds the shipped file (minutes on a CPU).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import xxhash

from kvfabric.codec.cachegen.family import NUM_SCALES
from kvfabric.codec.cachegen.wire import DEFAULT_LEVEL, MAX_LEVEL
from kvfabric.kv.layout import KVLayout

TABLES = Path(__file__).with_name("tables")
PROFILE_VERSION = 1


@dataclass(frozen=True, eq=False)
class Profile:
    fingerprint: bytes
    group_size: int
    anchor_bits: int
    e_base: np.ndarray  # int16 [S, C]
    ia4: np.ndarray  # int16 [S, C]; anchor model index x4 at level 1 (ignored for flat channels)
    id4: np.ndarray  # int16 [S, C]
    dflag: np.ndarray  # uint8 [S, C]
    meta: dict

    @property
    def id(self) -> int:
        return profile_id(self)

    def params(self, level: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(step exponents, anchor model index (255 = flat), other model index, dflag) at `level`."""
        return _params(self, level)


def profile_id(p: Profile) -> int:
    h = xxhash.xxh3_64()
    h.update(np.array([PROFILE_VERSION, p.group_size, p.anchor_bits], dtype="<i4").tobytes())
    h.update(p.fingerprint)
    for a in (p.e_base.astype("<i2"), p.ia4.astype("<i2"), p.id4.astype("<i2"), p.dflag.astype("u1")):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.intdigest() or 1  # 0 means "no profile" in a stream


def level_shift(level: int) -> int:
    """Step exponent added at `level` (>= 1): each level is sqrt(2) coarser, about half a bit less a value."""
    return 4 * (level - 1)


@lru_cache(maxsize=32)
def _params_cached(pid: int, level: int, p: Profile) -> tuple[np.ndarray, ...]:
    shift = level_shift(level)
    e = p.e_base.astype(np.int64) + shift
    ia = np.clip((p.ia4.astype(np.int64) - 2 * shift + 2) // 4, 0, NUM_SCALES - 1)
    idd = np.clip((p.id4.astype(np.int64) - 2 * shift + 2) // 4, 0, NUM_SCALES - 1)
    dflag = p.dflag.astype(np.uint8)
    ia = np.where(dflag != 0, ia, 255).astype(np.uint8)
    for a in (e, ia, idd, dflag):
        a.setflags(write=False)
    return e, ia, idd.astype(np.uint8), dflag


def _params(p: Profile, level: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return _params_cached(p.id, level, p)  # type: ignore[return-value]


def save(p: Profile, path: Path) -> None:
    np.savez_compressed(
        path, version=np.array([PROFILE_VERSION]), fingerprint=np.frombuffer(p.fingerprint, dtype=np.uint8),
        group_size=np.array([p.group_size]), anchor_bits=np.array([p.anchor_bits]),
        e_base=p.e_base.astype(np.int16), ia4=p.ia4.astype(np.int16), id4=p.id4.astype(np.int16),
        dflag=p.dflag.astype(np.uint8), meta=np.frombuffer(json.dumps(p.meta).encode(), dtype=np.uint8))


def load(path: Path) -> Profile:
    with np.load(path, allow_pickle=False) as z:
        if int(z["version"][0]) != PROFILE_VERSION:
            raise ValueError(f"{path}: profile version {int(z['version'][0])} unsupported")
        shapes = {z[k].shape for k in ("e_base", "ia4", "id4", "dflag")}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"{path}: malformed profile arrays")
        return Profile(fingerprint=z["fingerprint"].tobytes(), group_size=int(z["group_size"][0]),
                       anchor_bits=int(z["anchor_bits"][0]), e_base=z["e_base"].astype(np.int16),
                       ia4=z["ia4"].astype(np.int16), id4=z["id4"].astype(np.int16),
                       dflag=z["dflag"].astype(np.uint8), meta=json.loads(z["meta"].tobytes().decode() or "{}"))


@lru_cache(maxsize=None)
def shipped() -> dict[bytes, Profile]:
    """The profiles shipped as package data, by layout fingerprint (a malformed file is skipped)."""
    found: dict[bytes, Profile] = {}
    for path in sorted(TABLES.glob("profile_*.npz")):
        try:
            p = load(path)
        except (ValueError, KeyError, OSError):
            continue
        found[p.fingerprint] = p
    return found


def for_layout(layout: KVLayout) -> Profile | None:
    p = shipped().get(layout.fingerprint)
    if p is None and layout.part_of is not None:
        p = _part_profile(layout)
    if p is None or p.e_base.shape != (2 * layout.num_layers, layout.num_kv_heads * layout.head_dim):
        return None
    return p


def default_level(layout: KVLayout) -> int:
    """The one place that decides cachegen's level when none is given: the `default_level` stored with the
    layout's shipped profile (the coarsest level that kept top-1 >= 99 % on every held-out genre of `kvfabric
    bench codec --text`; set by `kvfabric profile cachegen-default`), else wire.DEFAULT_LEVEL."""
    p = for_layout(layout)
    level = p.meta.get("default_level") if p is not None else None
    return level if isinstance(level, int) and 1 <= level <= MAX_LEVEL else DEFAULT_LEVEL


def with_default_level(p: Profile, level: int) -> Profile:
    """The same profile (same id: meta is not part of it) with `level` as its default."""
    if not 1 <= level <= MAX_LEVEL:
        raise ValueError(f"default level must be in 1..{MAX_LEVEL}, got {level}")
    return Profile(p.fingerprint, p.group_size, p.anchor_bits, p.e_base, p.ia4, p.id4, p.dflag,
                   {**p.meta, "default_level": level})


@lru_cache(maxsize=64)
def _part_profile(layout: KVLayout) -> Profile | None:
    """A part layout's profile (a chunk's window layers, kvfabric.kv.shapes): its layers' rows of the parent
    layout's shipped profile, named by the part's fingerprint."""
    parent = shipped().get(layout.part_of.parent)  # type: ignore[union-attr]
    rows = [2 * layer + kv for layer in layout.part_of.layers for kv in (0, 1)]  # type: ignore[union-attr]
    if parent is None or max(rows) >= parent.e_base.shape[0]:
        return None
    return Profile(fingerprint=layout.fingerprint, group_size=parent.group_size, anchor_bits=parent.anchor_bits,
                   e_base=parent.e_base[rows], ia4=parent.ia4[rows], id4=parent.id4[rows], dflag=parent.dflag[rows],
                   meta=dict(parent.meta, part_of=parent.fingerprint.hex()))


def by_id(pid: int, layout: KVLayout | None = None) -> Profile | None:
    """The profile a stream names: the layout's own (a part's slice included), else any shipped one."""
    if layout is not None and (own := for_layout(layout)) is not None and own.id == pid:
        return own
    for p in shipped().values():
        if p.id == pid:
            return p
    return None


# ---- building a profile (offline; the model's side, Fisher information, is kvfabric.research.calibrate) ----
def build(layout: KVLayout, fisher: np.ndarray, kv_chunks: list[np.ndarray], *, alpha1: float = 2.5e-5,
          group_size: int = 10, anchor_bits: int = 1, shrink: float = 1.0, meta: dict | None = None) -> Profile:
    """Profile from a Fisher diagonal [L, 2, H, D] and calibration KV chunks ([L, 2, H, T, D] float32 each):
    steps from the Fisher information, then modes and residual scales measured by coding the chunks."""
    from kvfabric.codec.cachegen import quant as Q

    S, C = 2 * layout.num_layers, layout.num_kv_heads * layout.head_dim
    w = np.maximum(fisher.reshape(S, C), 1e-30)
    logw = np.log2(w)
    if shrink != 1.0:  # pull each channel toward its (layer, K/V) mean, in log scale
        logw = shrink * logw + (1.0 - shrink) * logw.mean(axis=1, keepdims=True)
    e_base = np.clip(np.round(8.0 * (math.log2(alpha1) - 0.5 * logw)), -120, 120).astype(np.int64)
    steps = Q.steps_from_exponents(e_base)
    asteps = Q.steps_from_exponents(e_base - 8 * anchor_bits)
    cost = np.zeros((S, C, 2))
    sums = np.zeros((S, C, 3))  # sum of mean q^2: flat, anchors, others (delta mode)
    counts = 0
    for x in kv_chunks:
        x = np.ascontiguousarray(x, dtype=np.float32)
        T = x.shape[3]
        st = np.empty((S, C, 4))
        Q.chunk_stats(x, 1, st)
        mus = (st[:, :, 0] / max(T - 1, 1)).astype(np.float16).astype(np.float32)
        head = np.ascontiguousarray(x[:, :, :, 0, :].reshape(S, C))
        sq = np.empty((C, 5))
        c2 = np.zeros((S, C, 2))
        Q.mode_costs(x, np.arange(S, dtype=np.int64), head, mus, steps, asteps, group_size, True, sq, c2, 1)
        cost += c2
        for s in range(S):
            Q.quantize_stats(x[s // 2, s % 2], head[s], mus[s], steps[s], asteps[s], group_size, True, sq, 1)
            n = T - 1
            na = sq[:, 3]
            sums[s, :, 0] += sq[:, 0] / n
            sums[s, :, 1] += sq[:, 1] / np.maximum(na, 1)
            sums[s, :, 2] += sq[:, 2] / np.maximum(n - na, 1)
        counts += 1
    # the Gaussian model that codes all chunks best has the mean of their second moments as its variance
    mean_log_var = np.log2(np.maximum(sums / max(counts, 1), 1e-6))
    dflag = (cost[:, :, 1] < cost[:, :, 0]).astype(np.uint8) if group_size > 1 else np.zeros((S, C), np.uint8)
    # model index i = 4 * log2(sigma) + 16 (family.py); in quarter units i4 = 16 * log2(sigma) + 64
    to_i4 = lambda lv: np.round(16.0 * (0.5 * lv + 4.0)).astype(np.int64)  # noqa: E731
    ia4 = to_i4(mean_log_var[:, :, 1])
    id4 = np.where(dflag != 0, to_i4(mean_log_var[:, :, 2]), to_i4(mean_log_var[:, :, 0]))
    return Profile(fingerprint=layout.fingerprint, group_size=group_size, anchor_bits=anchor_bits,
                   e_base=e_base.astype(np.int16), ia4=np.clip(ia4, -4096, 4096).astype(np.int16),
                   id4=np.clip(id4, -4096, 4096).astype(np.int16), dflag=dflag, meta=dict(meta or {}))
