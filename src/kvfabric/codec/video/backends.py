"""The FFmpeg side of the video codec, through PyAV: which video codec codes the frames (a *backend*), with which
pixel format and options, and the only two loops that touch PyAV (`encode_frames`, `decode_frames`).

Backends (the stream names one by id; every one codes its frames losslessly, so the video step adds no error):
- `utvideo` (id 0, the default): Ut Video, an intra-only Huffman codec, yuv444p. A frame's rows are spread over
  its three planes (bands of channels, e.g. one KV head each), and each plane gets its own code table. The
  lossless mode uses no spatial prediction (the high byte of a float has no useful neighbour), the near-lossless
  mode predicts each pixel from its left neighbour, which is the same channel one token earlier.
- `x264` (id 1): H.264 with qp 0 (lossless, High 4:4:4 Predictive, CABAC), gray or gray10le: a little smaller
  than utvideo in the near-lossless mode but several times slower to decode on a CPU (see
  docs/design/measurements.md); NVDEC and VAAPI can decode it.

PyAV is imported on first use, never at `import kvfabric`: without it (or with an FFmpeg build that lacks a
backend's encoder or decoder) `require` raises VideoUnavailable, naming the package to install.
Hardware decode: `select_hwaccel` picks an NVDEC (cuda) or VAAPI device when PyAV's FFmpeg has one for the
backend's decoder and the device opens; otherwise decode runs on the CPU (the default on a machine without one).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from kvfabric.codec.format import ChunkFormatError

PACKAGE_HINT = "pip install 'av>=16' (PyAV, FFmpeg's Python bindings)"
HW_DEVICES = ("cuda", "vaapi")  # NVDEC through CUDA, then VAAPI


class VideoUnavailable(ImportError):
    """PyAV is not installed, or its FFmpeg build lacks the encoder or decoder a backend needs."""


@dataclass(frozen=True, slots=True)
class Backend:
    id: int
    name: str
    encoder: str  # FFmpeg encoder name
    decoder: str  # FFmpeg decoder name
    planes: int  # planes of a frame that carry rows (3: yuv444p bands; 1: gray)
    formats: tuple[tuple[int, str], ...]  # (bits per value, pixel format)
    even: bool  # frame width and height must be even
    sized: bool  # the decoder must be told the frame size (Ut Video's packets do not carry it; H.264's do, and
    #              a size set by the caller would crop a wrong-sized stream silently instead of exposing it)
    codec_tag: str | None  # what the decoder must be told (Ut Video keeps its format in the tag)
    lossless_options: tuple[tuple[str, str], ...]
    lossy_options: tuple[tuple[str, str], ...]

    def pix_fmt(self, bits: int) -> str:
        for b, fmt in self.formats:
            if b == bits:
                return fmt
        raise ValueError(f"video backend {self.name} codes {[b for b, _ in self.formats]}-bit frames, not {bits}")

    def options(self, lossless: bool) -> dict[str, str]:
        return dict(self.lossless_options if lossless else self.lossy_options)


_X264 = (("qp", "0"), ("preset", "superfast"), ("x264-params", "bframes=0:log=-1"))
UTVIDEO = Backend(0, "utvideo", "utvideo", "utvideo", 3, ((8, "yuv444p"),), False, True, "ULY4",
                  (("pred", "none"),), (("pred", "left"),))
X264 = Backend(1, "x264", "libx264", "h264", 1, ((8, "gray"), (10, "gray10le")), True, False, None, _X264, _X264)
BACKENDS = {b.name: b for b in (UTVIDEO, X264)}
BY_ID = {b.id: b for b in BACKENDS.values()}
# pixel formats a decoder may hand back, with the right shift that gives the coded values: FFmpeg's H.264 decoder
# returns 4:0:0 as 4:2:0 (luma intact), and a hardware decoder's download may be NV12 / P010 (10 bits held high)
_OUT_FORMATS = {(0, 8): {"yuv444p": 0}, (1, 8): {"yuv420p": 0, "gray": 0, "nv12": 0},
                (1, 10): {"yuv420p10le": 0, "gray10le": 0, "p010le": 6}}


def _av():  # noqa: ANN202
    try:
        return importlib.import_module("av")
    except ImportError as exc:
        raise VideoUnavailable(f"the video codec needs PyAV, which is not installed: {PACKAGE_HINT}") from exc


def require(backend: Backend) -> None:
    """Raise VideoUnavailable unless PyAV and the backend's encoder and decoder are there."""
    av = _av()
    for name, mode in ((backend.encoder, "w"), (backend.decoder, "r")):
        try:
            av.Codec(name, mode)
        except Exception as exc:  # noqa: BLE001 - PyAV raises its own types for an unknown codec
            kind = "encoder" if mode == "w" else "decoder"
            raise VideoUnavailable(f"PyAV's FFmpeg build has no {name!r} {kind} (video backend {backend.name}); "
                                   f"install a build that has it: {PACKAGE_HINT}") from exc


def select_hwaccel(backend: Backend, want: str, compiled: Iterable[str] | None = None,
                   probe: Callable[[str], object] | None = None) -> str | None:
    """The hardware device type to decode `backend` with, or None for the CPU.

    want: "cpu" (never), "auto" (the first of HW_DEVICES that PyAV's FFmpeg supports for this decoder and that
    opens on this machine), or a device type to insist on. `compiled` (the device types PyAV's FFmpeg was built
    with) and `probe` (opens a device; raises if there is none) default to PyAV's; tests pass their own."""
    if want == "cpu":
        return None
    if compiled is None or probe is None:
        av = _av()
        hw = importlib.import_module("av.codec.hwaccel")
        codec = av.Codec(backend.decoder, "r")
        supported = {hw.HWDeviceType(c.device_type).name for c in codec.hardware_configs}
        compiled = [t for t in hw.hwdevices_available() if t in supported] if compiled is None else compiled
        probe = probe or (lambda t: hw.HWAccel(t, allow_software_fallback=True).create(codec))
    candidates = [t for t in (HW_DEVICES if want == "auto" else (want,)) if t in set(compiled)]
    for device in candidates:
        try:
            probe(device)
        except Exception:  # noqa: BLE001 - no such device here: try the next one, then the CPU
            continue
        return device
    return None


def encode_frames(backend: Backend, lossless: bool, bits: int, width: int, height: int,
                  frames: Iterable[list[np.ndarray]]) -> tuple[bytes, list[bytes]]:
    """Code frames (each: `backend.planes` arrays [height, width], uint8 or uint16 for > 8 bits) in order;
    returns the codec's extradata and one packet a frame."""
    av = _av()
    ctx = av.CodecContext.create(backend.encoder, "w")
    fmt = backend.pix_fmt(bits)
    ctx.width, ctx.height, ctx.pix_fmt = width, height, fmt
    ctx.time_base = Fraction(1, 25)
    ctx.thread_count = 1  # the same bytes on every machine
    ctx.options = backend.options(lossless)
    dtype = np.uint8 if bits == 8 else np.dtype("<u2")
    packets: list[bytes] = []
    num_frames = 0
    for i, planes in enumerate(frames):
        frame = av.VideoFrame(width, height, fmt)
        for p, rows in enumerate(planes):
            plane_view(frame.planes[p], dtype, height, width)[:] = rows
        frame.pts = i
        packets += [bytes(pk) for pk in ctx.encode(frame)]
        num_frames += 1
    packets += [bytes(pk) for pk in ctx.encode(None)]
    if len(packets) != num_frames:
        raise RuntimeError(f"{backend.encoder} made {len(packets)} packets for {num_frames} frames")
    return bytes(ctx.extradata or b""), packets


def plane_view(plane, dtype: np.dtype | type, height: int, width: int) -> np.ndarray:  # noqa: ANN001
    """[height, width] numpy view of a PyAV plane (rows are `line_size` bytes apart)."""
    itemsize = np.dtype(dtype).itemsize
    return np.frombuffer(plane, dtype).reshape(-1, plane.line_size // itemsize)[:height, :width]


def decode_frames(backend: Backend, bits: int, width: int, height: int, extradata: bytes,
                  packets: Iterable[memoryview], num_frames: int, threads: int = 1,
                  hwaccel: str | None = None) -> Iterator[list[np.ndarray]]:
    """Decoded frames in order, each as `backend.planes` arrays [height, width] that are valid until the next
    frame is asked for (the caller restores a frame before taking the next one: a few frames in memory at most).
    Anything the decoder refuses, a frame of another size or format, or a frame count other than `num_frames`
    raises ChunkFormatError."""
    av = _av()
    accel = None
    if hwaccel is not None:
        accel = importlib.import_module("av.codec.hwaccel").HWAccel(hwaccel, allow_software_fallback=True)
    try:
        ctx = av.CodecContext.create(backend.decoder, "r", hwaccel=accel)
        if backend.sized:
            ctx.width, ctx.height = width, height
        if extradata:
            ctx.extradata = extradata
        if backend.codec_tag:
            ctx.codec_tag = backend.codec_tag
        ctx.thread_count = threads
        dtype = np.uint8 if bits == 8 else np.dtype("<u2")
        count = 0

        def planes_of(frame) -> list[np.ndarray]:  # noqa: ANN001
            shift = _OUT_FORMATS[(backend.id, bits)].get(frame.format.name)
            if frame.width != width or frame.height != height or shift is None:
                raise ChunkFormatError(f"video frame {frame.width}x{frame.height} {frame.format.name} is not the "
                                       f"stream's {width}x{height} {backend.pix_fmt(bits)}")
            views = [plane_view(frame.planes[p], dtype, height, width) for p in range(backend.planes)]
            return [v >> shift for v in views] if shift else views

        for packet in packets:
            for frame in ctx.decode(av.Packet(packet)):
                count += 1
                if count > num_frames:
                    raise ChunkFormatError("video stream has more frames than it says")
                yield planes_of(frame)
        for frame in ctx.decode(None):
            count += 1
            if count > num_frames:
                raise ChunkFormatError("video stream has more frames than it says")
            yield planes_of(frame)
    except av.FFmpegError as exc:
        raise ChunkFormatError(f"video decoder refused the stream: {exc}") from exc
    if count != num_frames:
        raise ChunkFormatError(f"video stream decoded to {count} frames, expected {num_frames}")


