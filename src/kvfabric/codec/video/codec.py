"""The video codec (KVFetcher's idea): a KV chunk laid out as video frames (frames.py), quantized or split into
byte planes (planes.py), coded by a real video codec through PyAV (backends.py), restored frame by frame.

Levels: 0 is lossless (bit-identical in the layout dtype); 1-9 are near-lossless, with the CacheGen profile's
steps of the same level (8-bit pixels by default; 10 with the x264 backend), every value within half a step.
Decode writes each frame into the caller's `out` as soon as the video decoder returns it: the extra memory is a
few frames (at most 3 * ceil(C / 3) rows x `tile` tokens a frame, plus the decoder's own few), whatever the
context length.

Stream (the chunk payload; integers little-endian; blocks start 4-byte aligned):

    prelude  44 bytes: magic b"KVVD", version 1, mode (0 lossless, 1 near-lossless), backend id, bits, 2 reserved
             bytes, u16 reserved, u32 segments (= 2 * layers), u32 channels (= heads * head_dim), u32 tile
             (tokens a frame), u32 frames, u32 extradata bytes, u32 reserved, u64 profile id (0 = none; says
             where the steps came from, the decoder does not need the profile)
    lossless:      shift u8 [S, C]; low bytes u8 [L, 2, H, T, D, itemsize - 1]
    near-lossless: kinds u8 [S] (0 frames, 1 raw); token 0 in the layout dtype [S, C]; centers f16 [S, C];
                   step exponents i8 [S, C]; the raw segments in the layout dtype [raw, H, T, D]
    then     u32 [frames] packet lengths; the codec's extradata; the packets, back to back, to the payload's end

Decoding trusts nothing: every field is checked against the chunk header before the video decoder runs, the
frames must come out in the count and size the stream says, and any refusal by FFmpeg raises ChunkFormatError.
"""
from __future__ import annotations

import struct

import numpy as np
import torch

from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, write_blob
from kvfabric.codec.video import backends as B
from kvfabric.codec.video import planes as P
from kvfabric.codec.video.frames import (
    Geometry,
    Target,
    balanced_tile,
    bits_to_f32,
    layout_bits,
    pack,
    to_heads,
    unpack,
)
from kvfabric.layout import KVLayout

CODEC_ID = 3
MAGIC = b"KVVD"
STREAM_VERSION = 1
MAX_LEVEL = 9
DEFAULT_LEVEL = 6
MODE_LOSSLESS, MODE_NEAR = 0, 1
KIND_FRAMES, KIND_RAW = 0, 1
PRELUDE = struct.Struct("<4sBBBBBBHIIIIIIQ")
MAX_EXTRADATA = 1 << 16


def pad4(n: int) -> int:
    return (n + 3) & ~3


class VideoCodec:
    name = "video"
    codec_id = CODEC_ID

    def __init__(self, level: int = DEFAULT_LEVEL, *, backend: str = "utvideo", bits: int = 8, tile: int = 1024,
                 threads: int = 1, hwaccel: str = "auto", use_profile: bool = True) -> None:
        if not isinstance(level, int) or not 0 <= level <= MAX_LEVEL:
            raise ValueError(f"video level must be an int in 0..{MAX_LEVEL}, got {level!r}")
        if backend not in B.BACKENDS:
            raise ValueError(f"video backend must be one of {sorted(B.BACKENDS)}, got {backend!r}")
        self.backend = B.BACKENDS[backend]
        self.backend.pix_fmt(bits)  # raises for a depth the backend cannot code
        if level == 0 and bits != 8:
            raise ValueError("the lossless video level codes byte planes: bits must be 8")
        if not 1 <= tile <= 1 << 16:
            raise ValueError(f"tile must be in 1..65536 tokens, got {tile}")
        B.require(self.backend)  # a clear error now, not at the first chunk
        self.level, self.bits, self.tile, self.threads = level, bits, tile, threads
        self.hwaccel, self.use_profile = hwaccel, use_profile
        self.is_lossless = level == 0
        self._hw: dict[int, str | None] = {}  # backend id -> hardware device chosen on first decode

    def __repr__(self) -> str:
        return f"VideoCodec(level={self.level}, backend={self.backend.name!r}, bits={self.bits})"

    # ---- encode ----------------------------------------------------------------------------------------------
    def encode(self, kv: torch.Tensor, key: bytes, layout: KVLayout) -> bytearray:
        layout.check(kv)
        shape = tuple(int(s) for s in kv.shape)
        L, _, H, T, D = shape
        S, C = 2 * L, H * D
        first = 0 if self.is_lossless else 1
        g = Geometry(S, H, D, T, first, balanced_tile(T - first, self.tile), self.backend.planes, self.backend.even)
        if self.is_lossless:
            blocks, grid, pid = self._lossless_planes(kv, layout, g)
        else:
            blocks, grid, pid = self._near_planes(kv, layout, g)
        extradata, packets = B.encode_frames(self.backend, self.is_lossless, self.bits, g.width, g.rows,
                                             (pack(g, grid, i) for i in range(g.num_frames))) if g.num_frames \
            else (b"", [])
        prelude = PRELUDE.pack(MAGIC, STREAM_VERSION, MODE_LOSSLESS if self.is_lossless else MODE_NEAR,
                               self.backend.id, self.bits, 0, 0, 0, S, C, g.tile, g.num_frames, len(extradata), 0, pid)
        lengths = np.array([len(p) for p in packets], "<u4")
        head = [np.frombuffer(prelude, np.uint8)] + blocks + [lengths]
        payload_len = sum(pad4(b.nbytes) for b in head) + len(extradata) + int(lengths.sum())
        blob = bytearray(HEADER_BYTES + payload_len)
        pos = HEADER_BYTES
        for b in head:
            blob[pos:pos + b.nbytes] = b.reshape(-1).view(np.uint8).tobytes()
            pos += pad4(b.nbytes)
        for part in [extradata] + packets:
            blob[pos:pos + len(part)] = part
            pos += len(part)
        header = ChunkHeader(self.codec_id, layout.dtype_code, self.level, layout.fingerprint, shape, key,  # type: ignore[arg-type]
                             payload_len)
        write_blob(header, blob)
        return blob

    def _lossless_planes(self, kv: torch.Tensor, layout: KVLayout, g: Geometry
                         ) -> tuple[list[np.ndarray], np.ndarray, int]:
        words = layout_bits(kv, layout.torch_dtype)  # [L, 2, H, T, D]
        high, low = P.split_bytes(words, layout.itemsize)
        high = high.reshape(g.num_segments, g.num_heads, g.num_tokens, g.head_dim).transpose(0, 1, 3, 2).reshape(
            g.num_segments, g.channels, g.num_tokens)
        shift = P.align_shift(high)
        return [shift, low], P.align(high, shift), 0

    def _near_planes(self, kv: torch.Tensor, layout: KVLayout, g: Geometry) -> tuple[list[np.ndarray], np.ndarray, int]:
        from kvfabric.codec.cachegen import profile as CP
        S, H, T, D = g.num_segments, g.num_heads, g.num_tokens, g.head_dim
        words = layout_bits(kv, layout.torch_dtype)
        head = np.ascontiguousarray(words[:, :, :, 0, :]).reshape(S, g.channels)
        with torch.no_grad():
            x = kv.detach()[:, :, :, 1:, :].float().reshape(S, H, T - 1, D)
        x = x.permute(0, 1, 3, 2).reshape(S, g.channels, T - 1).numpy()  # [S, C, T - 1] float32
        prof = CP.for_layout(layout) if self.use_profile else None
        e_level = prof.params(self.level)[0] if prof is not None else None
        raw, center, e, grid = P.quantize(x, e_level, self.level, self.bits)
        raw_segments = words.reshape(S, H, T, D)[raw]
        kinds = raw.astype(np.uint8)
        return [kinds, head, center.astype("<f2"), e, raw_segments], grid, prof.id if prof is not None else 0

    # ---- decode ----------------------------------------------------------------------------------------------
    def decode(self, header: ChunkHeader, blob: memoryview, layout: KVLayout, out: torch.Tensor) -> None:
        if tuple(out.shape) != header.shape:
            raise ChunkFormatError(f"chunk shape {header.shape} does not fit the output {tuple(out.shape)}")
        if header.dtype_code != layout.dtype_code or header.shape != layout.shape(header.num_tokens):
            raise ChunkFormatError("video chunk does not match the layout")
        if len(blob) < HEADER_BYTES + header.payload_len:
            raise ChunkFormatError("video payload shorter than its header says")
        stream = Stream.read(header, np.frombuffer(blob, np.uint8, count=header.payload_len, offset=HEADER_BYTES),
                             layout)
        backend = stream.backend
        device = self.hardware_decoder(backend)
        target = Target(out, layout.torch_dtype)
        g = stream.geometry
        frames = B.decode_frames(backend, stream.bits, g.width, g.rows, stream.extradata, stream.packets(),
                                 g.num_frames, self.threads, device) if g.num_frames else iter(())
        for i, planes in enumerate(frames):  # frame-wise restore: each frame is in `out` before the next decodes
            s, a, b = g.frame(i)
            rows = unpack(g, planes, b - a)
            if stream.is_lossless:
                high = to_heads(g, P.unalign(rows, stream.shift[s]))
                l, k = divmod(s, 2)
                target.put_bits(s, a, b, P.join_bytes(high, stream.low[l, k, :, a:b], layout.itemsize))
            elif not stream.raw[s]:
                target.put_values(s, a, b, P.dequantize(to_heads(g, rows), stream.center[s], stream.e[s], stream.bits))
        if not stream.is_lossless:
            H, D = g.num_heads, g.head_dim
            for s in range(g.num_segments):
                target.put_bits(s, 0, 1, stream.head[s].reshape(H, 1, D))
            for s, seg in zip(np.flatnonzero(stream.raw), stream.raw_segments):
                target.put_bits(int(s), 0, g.num_tokens, seg)

    def hardware_decoder(self, backend: B.Backend | None = None) -> str | None:
        """The hardware device ("cuda", "vaapi") this codec decodes `backend`'s streams with, None for the CPU;
        chosen on first use (backends.select_hwaccel with this codec's `hwaccel` setting) and kept."""
        backend = backend or self.backend
        if backend.id not in self._hw:
            B.require(backend)
            self._hw[backend.id] = B.select_hwaccel(backend, self.hwaccel)
        return self._hw[backend.id]

    # ---- contract helpers ------------------------------------------------------------------------------------
    def error_bound(self, kv: torch.Tensor, blob: bytes | bytearray | memoryview, layout: KVLayout) -> torch.Tensor:
        """Per-element bound on |decode(encode(kv)) - kv| stated by the stream: half the channel's step (0 for
        token 0 and raw segments), plus the rounding of kv to the layout dtype and float32 arithmetic."""
        from kvfabric.codec.format import parse
        header = parse(blob)
        L, _, H, T, D = header.shape
        stream = Stream.read(header, np.frombuffer(memoryview(blob), np.uint8, offset=HEADER_BYTES), layout)
        x = kv.float().abs()
        ulp = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23}[layout.dtype]
        if stream.is_lossless:
            return x * ulp + 1e-30
        half = torch.from_numpy(P.steps(stream.e).astype(np.float64) / 2).reshape(L, 2, H, D)[:, :, :, None, :]
        half = half.expand(L, 2, H, T, D).clone()
        half[torch.from_numpy(stream.raw).reshape(L, 2)] = 0.0
        half[:, :, :, 0, :] = 0.0
        qmax = (1 << (stream.bits - 1)) - 1
        return half * (1 + 1e-5) + x * ulp + (x + half * 2 * qmax) * 2.0 ** -21 + 1e-30


class Stream:
    """A parsed, checked payload: geometry, side information and packet positions (views into the payload)."""

    def __init__(self) -> None:
        self.shift = self.low = self.kinds = self.head = self.center = self.e = self.raw_segments = None
        self.raw = np.zeros(0, bool)

    @classmethod
    def read(cls, header: ChunkHeader, pay: np.ndarray, layout: KVLayout) -> Stream:
        st = cls()
        st.pay, st.pos = pay, 0
        L, _, H, T, D = header.shape
        S, C, isz = 2 * L, H * D, layout.itemsize
        magic, version, mode, bid, bits, _, _, _, segs, chans, tile, nframes, nextra, _, pid = PRELUDE.unpack(
            st.take(PRELUDE.size).tobytes())
        if magic != MAGIC or version != STREAM_VERSION:
            raise ChunkFormatError("not a video stream (magic/version)")
        if mode != (MODE_LOSSLESS if header.level == 0 else MODE_NEAR) or not 0 <= header.level <= MAX_LEVEL:
            raise ChunkFormatError("video stream mode does not match the chunk's level")
        if bid not in B.BY_ID or bits not in dict(B.BY_ID[bid].formats) or (mode == MODE_LOSSLESS and bits != 8):
            raise ChunkFormatError(f"video stream names an unknown backend {bid} or depth {bits}")
        first = 0 if mode == MODE_LOSSLESS else 1
        if segs != S or chans != C or not 1 <= tile <= max(1, T - first) or nextra > MAX_EXTRADATA:
            raise ChunkFormatError("video prelude does not match the chunk")
        st.backend, st.bits, st.is_lossless, st.profile_id = B.BY_ID[bid], bits, mode == MODE_LOSSLESS, pid
        st.geometry = g = Geometry(S, H, D, T, first, tile, st.backend.planes, st.backend.even)
        if nframes != g.num_frames:
            raise ChunkFormatError(f"video stream says {nframes} frames, its geometry {g.num_frames}")
        words = np.dtype("<u2" if isz == 2 else "<u4")
        if st.is_lossless:
            st.shift = st.array("u1", (S, C))
            st.low = st.array("u1", (L, 2, H, T, D, isz - 1))
        else:
            st.kinds = st.array("u1", (S,))
            if (st.kinds > KIND_RAW).any():
                raise ChunkFormatError("video segment kind invalid")
            st.raw = st.kinds == KIND_RAW
            st.head = st.array(words, (S, C))
            st.center = st.array("<f2", (S, C))
            st.e = st.array("i1", (S, C))
            st.raw_segments = st.array(words, (int(st.raw.sum()), H, T, D))
            head = bits_to_f32(st.head, layout.torch_dtype)
            if not np.isfinite(st.center[~st.raw]).all() or not np.isfinite(head[~st.raw]).all():
                raise ChunkFormatError("video centers or token 0 not finite")
        st.lengths = st.array("<u4", (nframes,)).astype(np.int64)
        st.extradata = st.take(nextra, align=False).tobytes()
        if st.pos + int(st.lengths.sum()) != len(pay):
            raise ChunkFormatError("video packets do not end where the payload does")
        return st

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

    def packets(self):  # noqa: ANN201
        pos = self.pos
        for n in self.lengths:
            yield memoryview(self.pay[pos:pos + n])
            pos += int(n)
