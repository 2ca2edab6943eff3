"""The video codec (KVFetcher's idea): a KV chunk laid out as video frames (frames.py), quantized or split into
byte planes (planes.py), coded by a real video codec through PyAV (backends.py); the payload is stream.py's.

Levels: 0 is lossless (bit-identical in the layout dtype); 1-9 are near-lossless, with the CacheGen profile's
steps of the same level (8-bit pixels by default; 10 with the x264 backend): every value decodes within half its
channel's step (`error_bound`), token 0 and raw segments exactly. The video codec itself is run
lossless (Ut Video, or H.264 at qp 0): the only loss is the quantization, stated per channel in the stream.

Decode is frame-wise: each frame is written into the caller's `out` as soon as the video decoder returns it, so
the extra memory is a few frames (one frame: 3 * ceil(C / 3) rows x `tile` tokens; see `decode_scratch_bytes`)
whatever the context length. Decoding trusts nothing: stream.py checks every field against the chunk header, the
frames must come out in the count and size the stream says, and anything FFmpeg refuses raises ChunkFormatError.
"""
from __future__ import annotations

import numpy as np
import torch

from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, write_blob
from kvfabric.codec.video import backends as B
from kvfabric.codec.video import planes as P
from kvfabric.codec.video.frames import Geometry, Target, balanced_tile, layout_bits, pack, to_heads, unpack
from kvfabric.codec.video.stream import (
    CODEC_ID,
    FLAG_PROFILE,
    MAGIC,
    MAX_LEVEL,
    MODE_LOSSLESS,
    MODE_NEAR,
    PRELUDE,
    STREAM_VERSION,
    Stream,
    counted,
    write_payload,
)
from kvfabric.kv.layout import KVLayout

DEFAULT_LEVEL = 6


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
        g = Geometry(2 * L, H, D, T, balanced_tile(T, self.tile), self.backend.planes, self.backend.even)
        words = layout_bits(kv, layout.torch_dtype)  # [L, 2, H, T, D]
        if self.is_lossless:
            high, low = P.split_bytes(words, layout.itemsize)
            high = self._segments(high, g)
            shift = P.align_shift(high)
            blocks, grid, flags, pid = [shift, low], P.align(high, shift), 0, 0
        else:
            blocks, grid, flags, pid = self._near(kv, words, layout, g)
        extradata, packets = B.encode_frames(self.backend, self.is_lossless, self.bits, g.width, g.rows,
                                             (pack(g, grid, i) for i in range(g.num_frames)))
        prelude = PRELUDE.pack(MAGIC, STREAM_VERSION, MODE_LOSSLESS if self.is_lossless else MODE_NEAR,
                               self.backend.id, self.bits, flags, 0, 0, g.num_segments, g.channels, g.tile,
                               g.num_frames, len(extradata), 0, pid)
        blob = write_payload(HEADER_BYTES, prelude, blocks, extradata, packets)
        header = ChunkHeader(self.codec_id, layout.dtype_code, self.level, layout.fingerprint, shape, key,  # type: ignore[arg-type]
                             len(blob) - HEADER_BYTES)
        write_blob(header, blob)
        return blob

    @staticmethod
    def _segments(a: np.ndarray, g: Geometry) -> np.ndarray:
        """[L, 2, H, T, D] -> [S, C, T]: a row per channel, a column per token."""
        return a.reshape(g.num_segments, g.num_heads, g.num_tokens, g.head_dim).transpose(0, 1, 3, 2).reshape(
            g.num_segments, g.channels, g.num_tokens)

    def _near(self, kv: torch.Tensor, words: np.ndarray, layout: KVLayout, g: Geometry
              ) -> tuple[list[np.ndarray], np.ndarray, int, int]:
        from kvfabric.codec.cachegen import profile as CP
        with torch.no_grad():
            x = self._segments(kv.detach().float().numpy(), g)
        prof = CP.for_layout(layout) if self.use_profile else None
        e_level = prof.params(self.level)[0] if prof is not None else None
        raw, center, e, grid = P.quantize(x, e_level, self.level, self.bits)
        if e_level is not None:  # only the raised steps travel; the decoder has the profile
            bumped = np.flatnonzero((e.astype(np.int64) != P.level_exponents(e_level)) & ~raw[:, None])
            steps = counted(bumped.astype("<u4")) + [e.reshape(-1)[bumped]]
        else:
            steps = [e]
        head = np.ascontiguousarray(words[:, :, :, 0, :]).reshape(g.num_segments, g.channels)  # token 0, exact
        blocks = [raw.astype(np.uint8), center.astype("<f2"), *steps, head,
                  words.reshape(g.num_segments, g.num_heads, g.num_tokens, g.head_dim)[raw]]
        return blocks, grid, FLAG_PROFILE if prof is not None else 0, prof.id if prof is not None else 0

    # ---- decode ----------------------------------------------------------------------------------------------
    def decode(self, header: ChunkHeader, blob: memoryview, layout: KVLayout, out: torch.Tensor) -> None:
        if tuple(out.shape) != header.shape:
            raise ChunkFormatError(f"chunk shape {header.shape} does not fit the output {tuple(out.shape)}")
        if header.dtype_code != layout.dtype_code or header.shape != layout.shape(header.num_tokens):
            raise ChunkFormatError("video chunk does not match the layout")
        if len(blob) < HEADER_BYTES + header.payload_len:
            raise ChunkFormatError("video payload shorter than its header says")
        st = Stream.read(header, np.frombuffer(blob, np.uint8, count=header.payload_len, offset=HEADER_BYTES), layout)
        g, target = st.geometry, Target(out, layout.torch_dtype)
        frames = B.decode_frames(st.backend, st.bits, g.width, g.rows, st.extradata, st.packets(), g.num_frames,
                                 self.threads, self.hardware_decoder(st.backend))
        step = P.steps(st.e) if not st.is_lossless else None  # [S, C] float32
        for i, planes in enumerate(frames):  # frame-wise restore: each frame is in `out` before the next decodes
            s, a, b = g.frame(i)
            rows = unpack(g, planes, b - a)
            if st.is_lossless:
                l, k = divmod(s, 2)
                high = to_heads(g, P.unalign(rows, st.shift[s]))
                target.put_bits(s, a, b, P.join_bytes(high, st.low[l, k, :, a:b], layout.itemsize))
            elif not st.raw[s]:
                target.put_values(s, a, b, P.dequantize(to_heads(g, rows), st.center[s], step[s], st.bits))
                if a == 0:  # token 0: exact
                    target.put_bits(s, 0, 1, st.head[s].reshape(g.num_heads, 1, g.head_dim))
        if not st.is_lossless:
            for s, seg in zip(np.flatnonzero(st.raw), st.raw_segments):
                target.put_bits(int(s), 0, g.num_tokens, seg)

    def hardware_decoder(self, backend: B.Backend | None = None) -> str | None:
        """The hardware device ("cuda", "vaapi") this codec decodes `backend`'s streams with, None for the CPU;
        chosen on first use (backends.select_hwaccel with this codec's `hwaccel` setting) and kept."""
        backend = backend or self.backend
        if backend.id not in self._hw:
            B.require(backend)
            self._hw[backend.id] = B.select_hwaccel(backend, self.hwaccel)
        return self._hw[backend.id]

    def decode_scratch_bytes(self, shape: tuple[int, ...]) -> int:
        """The stated bound on decode's extra memory for a chunk of `shape`: eight frames' worth of float32
        pixels (the decoder's frame, our copy of it, the float32 values and the dtype conversion, with room)."""
        L, _, H, T, D = shape
        g = Geometry(2 * L, H, D, T, balanced_tile(T, self.tile), self.backend.planes, self.backend.even)
        return 8 * g.planes * g.rows * g.width * 4

    # ---- contract helpers ------------------------------------------------------------------------------------
    def error_bound(self, kv: torch.Tensor, blob: bytes | bytearray | memoryview, layout: KVLayout) -> torch.Tensor:
        """Per-element bound on |decode(encode(kv)) - kv| stated by the stream: half the channel's step (0 for
        token 0 and raw segments), plus rounding to the layout / output dtype and float32 arithmetic."""
        from kvfabric.codec.format import parse
        header = parse(blob)
        L, _, H, T, D = header.shape
        st = Stream.read(header, np.frombuffer(memoryview(blob), np.uint8, offset=HEADER_BYTES), layout)
        x = kv.float().abs()
        ulp = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23}[layout.dtype]
        if st.is_lossless:
            return x * ulp + 1e-30
        half = torch.from_numpy(P.steps(st.e).astype(np.float64) / 2).reshape(L, 2, H, 1, D).expand(L, 2, H, T, D)
        half = half.clone()
        half[torch.from_numpy(st.raw).reshape(L, 2)] = 0.0
        half[:, :, :, 0, :] = 0.0
        qmax = (1 << (st.bits - 1)) - 1  # |x_hat| <= |x| + half: an fp16 / bf16 output rounds it by ulp / 2
        return half * (1 + 1e-5) + (x + half) * ulp + (x + half * 2 * qmax) * 2.0 ** -21 + 1e-30
