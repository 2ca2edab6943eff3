"""The video codec's payload (inside the chunk format's header + payload): writing it, and reading it back with
every field checked against the chunk header before any video decoder runs.

All integers little-endian; every block starts 4-byte aligned except the extradata and packets at the end.

    prelude  44 bytes: magic b"KVVD", version 1, mode (0 lossless, 1 near-lossless), backend id, bits, flags
             (1: steps from the CacheGen profile named below), reserved u8, u16 reserved, u32 segments
             (= 2 * layers), u32 channels (= heads * head_dim), u32 tile (tokens a frame), u32 frames,
             u32 extradata bytes, u32 reserved, u64 profile id (0 = none)
    lossless:      shift u8 [S, C]; low bytes u8 [L, 2, H, T, D, itemsize - 1]
    near-lossless: kinds u8 [S] (0 frames, 1 raw); centers f16 [S, C];
                   flag 1: u32 n, indices u32 [n] into [S * C], exponents i8 [n] (the channels whose step was
                           raised above the profile's: the decoder takes the rest from the profile);
                   else:   exponents i8 [S, C];
                   token 0 in the layout dtype [S, C]; the raw segments in the layout dtype [raw, H, T, D]
    then     u32 [frames] packet lengths; the codec's extradata; the packets, back to back, to the payload's end
"""
from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np

from kvfabric.codec.format import ChunkFormatError, ChunkHeader
from kvfabric.codec.video import backends as B
from kvfabric.codec.video.frames import Geometry, bits_to_f32
from kvfabric.codec.video.planes import level_exponents
from kvfabric.kv.layout import KVLayout

CODEC_ID = 3
MAGIC = b"KVVD"
STREAM_VERSION = 1
MAX_LEVEL = 9
MODE_LOSSLESS, MODE_NEAR = 0, 1
FLAG_PROFILE = 1
KIND_FRAMES, KIND_RAW = 0, 1
PRELUDE = struct.Struct("<4sBBBBBBHIIIIIIQ")
MAX_EXTRADATA = 1 << 16


def pad4(n: int) -> int:
    return (n + 3) & ~3


def word_dtype(layout: KVLayout) -> np.dtype:
    return np.dtype("<u2" if layout.itemsize == 2 else "<u4")


def write_payload(offset: int, prelude: bytes, blocks: list[np.ndarray], extradata: bytes, packets: list[bytes]
                  ) -> bytearray:
    """A buffer of `offset` free bytes (the chunk header's), then the payload: prelude, the 4-byte aligned
    blocks, packet lengths, extradata, packets."""
    head = [np.frombuffer(prelude, np.uint8)] + blocks + [np.array([len(p) for p in packets], "<u4")]
    out = bytearray(offset + sum(pad4(b.nbytes) for b in head) + len(extradata) + sum(len(p) for p in packets))
    pos = offset
    for b in head:
        out[pos:pos + b.nbytes] = b.reshape(-1).view(np.uint8).tobytes()
        pos += pad4(b.nbytes)
    for part in [extradata, *packets]:
        out[pos:pos + len(part)] = part
        pos += len(part)
    return out


def counted(values: np.ndarray) -> list[np.ndarray]:
    """A u32 count block, then the array (the form of the list of raised steps)."""
    return [np.array([len(values)], "<u4"), values]


class Stream:
    """A parsed, checked payload: geometry, side information (views into the payload) and the packets."""

    def __init__(self, pay: np.ndarray) -> None:
        self.pay, self.pos = pay, 0
        self.raw = np.zeros(0, bool)

    @classmethod
    def read(cls, header: ChunkHeader, pay: np.ndarray, layout: KVLayout) -> Stream:
        st = cls(pay)
        L, _, H, T, D = header.shape
        S, C, words = 2 * L, H * D, word_dtype(layout)
        magic, version, mode, bid, bits, flags, _, _, segs, chans, tile, nframes, nextra, _, pid = PRELUDE.unpack(
            st.take(PRELUDE.size).tobytes())
        if magic != MAGIC or version != STREAM_VERSION:
            raise ChunkFormatError("not a video stream (magic/version)")
        if mode != (MODE_LOSSLESS if header.level == 0 else MODE_NEAR) or header.level > MAX_LEVEL:
            raise ChunkFormatError("video stream mode does not match the chunk's level")
        if bid not in B.BY_ID or bits not in dict(B.BY_ID[bid].formats) or (mode == MODE_LOSSLESS and bits != 8):
            raise ChunkFormatError(f"video stream names an unknown backend {bid} or depth {bits}")
        if segs != S or chans != C or not 1 <= tile <= T or nextra > MAX_EXTRADATA or flags & ~FLAG_PROFILE:
            raise ChunkFormatError("video prelude does not match the chunk")
        st.backend, st.bits, st.is_lossless = B.BY_ID[bid], bits, mode == MODE_LOSSLESS
        st.geometry = g = Geometry(S, H, D, T, tile, st.backend.planes, st.backend.even)
        if nframes != g.num_frames:
            raise ChunkFormatError(f"video stream says {nframes} frames, its geometry {g.num_frames}")
        if st.is_lossless:
            st.shift = st.array("u1", (S, C))
            st.low = st.array("u1", (L, 2, H, T, D, layout.itemsize - 1))
        else:
            st._side(header, layout, flags, pid, S, C, words)
        st.lengths = st.array("<u4", (nframes,)).astype(np.int64)
        st.extradata = st.take(nextra, align=False).tobytes()
        if st.pos + int(st.lengths.sum()) != len(pay):
            raise ChunkFormatError("video packets do not end where the payload does")
        return st

    def _side(self, header: ChunkHeader, layout: KVLayout, flags: int, pid: int, S: int, C: int,
              words: np.dtype) -> None:
        from kvfabric.codec.cachegen import profile as CP
        L, _, H, T, D = header.shape
        kinds = self.array("u1", (S,))
        if (kinds > KIND_RAW).any():
            raise ChunkFormatError("video segment kind invalid")
        self.raw = kinds == KIND_RAW
        self.center = self.array("<f2", (S, C))
        if flags & FLAG_PROFILE:
            prof = CP.by_id(pid)
            if prof is None or prof.e_base.shape != (S, C):
                raise ChunkFormatError(f"video stream needs CacheGen profile {pid:#x}, which this build does not have")
            self.e = level_exponents(prof.params(header.level)[0])
            idx, e = self.listed(S * C, "i1")
            self.e.reshape(-1)[idx] = e
        else:
            self.e = self.array("i1", (S, C)).astype(np.int64)
        self.head = self.array(words, (S, C))
        self.raw_segments = self.array(words, (int(self.raw.sum()), H, T, D))
        frames = ~self.raw
        if not np.isfinite(self.center[frames]).all():
            raise ChunkFormatError("video centers not finite")
        if not np.isfinite(bits_to_f32(self.head[frames], layout.torch_dtype)).all():
            raise ChunkFormatError("video token 0 not finite")

    def take(self, nbytes: int, align: bool = True) -> np.ndarray:
        if nbytes < 0 or self.pos + nbytes > len(self.pay):
            raise ChunkFormatError(f"truncated video stream: need {nbytes} bytes at {self.pos} of {len(self.pay)}")
        block = self.pay[self.pos:self.pos + nbytes]
        self.pos = pad4(self.pos + nbytes) if align else self.pos + nbytes
        return block

    def array(self, dtype: str | np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        dt = np.dtype(dtype)
        arr = self.take(int(np.prod(shape, dtype=np.int64)) * dt.itemsize).view(dt).reshape(shape)
        return arr if arr.flags.aligned else arr.copy()

    def listed(self, limit: int, dtype: str | np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """A counted list: (indices u32 < limit, values)."""
        (n,) = self.array("<u4", (1,))
        if n > limit:
            raise ChunkFormatError(f"video list of {n} entries exceeds {limit}")
        idx = self.array("<u4", (int(n),)).astype(np.int64)
        if (idx >= limit).any():
            raise ChunkFormatError("video list index out of range")
        return idx, self.array(dtype, (int(n),))

    def packets(self) -> Iterator[memoryview]:
        pos = self.pos
        for n in self.lengths:
            yield memoryview(self.pay[pos:pos + n])
            pos += int(n)
