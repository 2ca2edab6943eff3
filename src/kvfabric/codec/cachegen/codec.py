"""CacheGen codec: KV chunks quantized with token locality and layer sensitivity, then entropy-coded per channel.

Levels: 0 is lossless (the high byte of every value entropy-coded, the rest stored); 1-9 are lossy, each
about half a bit a value cheaper than the one before (the step grows by sqrt(2)). Without a level the codec
codes at its layout's default, `profile.default_level` (the one place that decides it: the level stored with
the model's profile, chosen to keep top-1 >= 99 % on held-out prose, code and MuSiQue; else DEFAULT_LEVEL).

Lossy coding of one segment (a layer's K or V: channels c = (head, dim), tokens t of the chunk):
- the chunk's first token (the attention sink of a sequence's first chunk) is kept exactly, in the layout dtype;
- token locality (CacheGen idea 1): tokens form groups of `group_size` (default 10); in a *delta* channel the
  first token of a group, the anchor, is quantized around the channel mean with a step `2^anchor_bits` finer,
  and the others as deltas to the anchor's reconstruction; a *flat* channel codes every token around the
  mean. The encoder picks per channel whichever codes smaller (or the profile's choice);
- layer sensitivity (idea 2): each channel has its own step. With a model profile (profile.py) the steps come
  from the measured Fisher information of each (layer, K/V, channel); without one, step = std * level scale,
  halved in the first third of the layers (one more bit for shallow layers);
- entropy coding (idea 3): every (layer, K/V, channel) group has its own probability model (a discretized
  Gaussian of the family in family.py, chosen by one byte), coded with the 4-lane rANS of rans.py.
Every value decodes within half a step of the original (the contract's error bound, `error_bound`).

Stream (the chunk payload; all integers little-endian, every block 4-byte aligned):

    prelude  36 bytes: magic b"KVCG", version 1, mode (0 lossless, 1 lossy), coder (0 rANS-4, 1 the reference coder: a
             `SegmentCoder` plugged in from outside the runtime, see below), flags (1 head token stored, 2 uses a
             profile), group size, anchor bits, value bytes, reserved, u16 segments (= 2 * layers), u16 reserved, u32
             channels (= heads * head_dim), u64 family id (checksum of the probability tables), u64 profile id (0 =
             none)
    kinds    u8[segments]: 0 raw (layout dtype), 1 lossy with embedded models, 2 lossy with the profile's
             models, 3 lossless byte planes
    lengths  u32[segments]: coded bytes of each segment
    lossy:   head [segments, channels] in the layout dtype; mean f16 [segments, channels];
             for the kind-1 segments, in order: step exponent i8, anchor model u8 (255 = flat channel),
             model u8, each [n, channels]
    data     each segment's bytes in order (lossy: u16 rANS words; lossless: u16 frequencies[256], the low
             bytes, then the words)

Decoding (the prelude here, the lossy segments in decode.py) trusts nothing: magic, version, sizes, counts,
model indices and ids are checked before any kernel runs, lengths must add up to the payload exactly, and each
rANS segment must end exactly where it should with its states back at their initial value. Any failure raises
ChunkFormatError.

The runtime codes with rANS only. `CacheGenCodec(coder=...)` also takes a `SegmentCoder`, a second entropy coder for
the lossy segments (stream coder 1): the reference coder, kvfabric.research.cachegen_reference (numpy quantization,
constriction's range coder), which the tests and `kvfabric bench codec`'s "naive" baseline plug in. Only a codec
given such a coder decodes a coder-1 stream; any other refuses it (ChunkFormatError: a miss).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvfabric.codec.cachegen import profile as P
from kvfabric.codec.cachegen import quant as Q
from kvfabric.codec.cachegen.decode import decode_lossy, stated_error_bound
from kvfabric.codec.cachegen.family import family
from kvfabric.codec.cachegen.lossless import decode_lossless, encode_lossless
from kvfabric.codec.cachegen.wire import (
    CODEC_ID,
    CODER_CONSTRICTION,
    CODER_RANS,
    FLAG_HEAD,
    FLAG_PROFILE,
    HEURISTIC_BETA1,
    MAGIC,
    MAX_LEVEL,
    MODE_LOSSLESS,
    MODE_LOSSY,
    PRELUDE,
    QLIMIT,
    SEG_BYTES,
    SEG_EMBEDDED,
    SEG_PROFILE,
    SEG_RAW,
    STREAM_VERSION,
    Reader,
    SegmentCoder,
    bits_to_f32,
    pad4,
    round_to_layout,
)
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, write_blob
from kvfabric.kv.layout import KVLayout


def default_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


class CacheGenCodec:
    name = "cachegen"
    codec_id = CODEC_ID

    def __init__(self, level: int | None = None, *, group_size: int = 10, anchor_bits: int = 1,
                 use_profile: bool = True, coder: str | SegmentCoder = "rans", threads: int | None = None) -> None:
        if level is not None and (not isinstance(level, int) or not 0 <= level <= MAX_LEVEL):
            raise ValueError(f"cachegen level must be an int in 0..{MAX_LEVEL} or None, got {level!r}")
        if not 1 <= group_size <= 255:
            raise ValueError(f"group_size must be in 1..255, got {group_size}")
        if not 0 <= anchor_bits <= 7:
            raise ValueError(f"anchor_bits must be in 0..7, got {anchor_bits}")
        is_segment_coder = hasattr(coder, "encode_segment") and hasattr(coder, "decode_segment")
        if coder != "rans" and not is_segment_coder:
            raise ValueError(f"coder must be 'rans' or a SegmentCoder (kvfabric.research.cachegen_reference), "
                             f"got {coder!r}")
        self.level = level  # None: the layout's default (profile.default_level), resolved per encode
        self.group_size = group_size
        self.anchor_bits = anchor_bits
        self.use_profile = use_profile
        self.coder = "rans" if coder == "rans" else "reference"
        self._reference: SegmentCoder | None = None if coder == "rans" else coder  # type: ignore[assignment]
        self.threads = threads or default_threads()
        self.is_lossless = level == 0
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None  # threads - 1 workers, made on first use

    def _split(self, fn, segs: np.ndarray) -> list:  # noqa: ANN001
        """fn(part) on `threads` interleaved shares of the segment list: one in this thread, the others in the
        codec's pool (the kernels drop the GIL, so the shares run in parallel)."""
        if self.threads <= 1 or len(segs) < 2:
            return [fn(segs)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="kvfabric-cachegen")
        parts = [np.ascontiguousarray(segs[i::self.threads]) for i in range(self.threads) if len(segs[i::self.threads])]
        futures = [self._pool.submit(fn, part) for part in parts[1:]]
        first = fn(parts[0])
        return [first] + [f.result() for f in futures]

    def __repr__(self) -> str:
        return f"CacheGenCodec(level={self.level}, group_size={self.group_size}, coder={self.coder!r})"

    # ---- encode ----------------------------------------------------------------------------------------------
    def encode(self, kv: torch.Tensor, key: bytes, layout: KVLayout) -> bytearray:
        layout.check(kv)
        shape = tuple(int(s) for s in kv.shape)
        level = P.default_level(layout) if self.level is None else self.level
        if level == 0:
            parts = encode_lossless(kv, layout, self._scratch("bytes", (2 * kv[0, 0].numel() + 64,), np.uint16))
            mode, flags, pid = MODE_LOSSLESS, 0, 0
        else:
            parts, flags, pid = self._encode_lossy(kv, layout, level)
            mode = MODE_LOSSY
        L, _, H, T, D = shape
        prelude = PRELUDE.pack(MAGIC, STREAM_VERSION, mode, CODER_CONSTRICTION if self._reference is not None
                               else CODER_RANS, flags, self.group_size, self.anchor_bits, layout.itemsize, 0,
                               2 * L, 0, H * D, family().id, pid)
        blocks = [np.frombuffer(prelude, np.uint8)] + parts
        payload_len = sum(pad4(b.nbytes) for b in blocks)
        blob = bytearray(HEADER_BYTES + payload_len)
        pay = np.frombuffer(blob, np.uint8, offset=HEADER_BYTES)
        pos = 0
        for b in blocks:
            pay[pos:pos + b.nbytes] = b.reshape(-1).view(np.uint8)
            pos += pad4(b.nbytes)
        header = ChunkHeader(self.codec_id, layout.dtype_code, level, layout.fingerprint, shape, key,  # type: ignore[arg-type]
                             payload_len)
        write_blob(header, blob)
        return blob

    def _scratch(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        cache = getattr(self._local, "bufs", None)
        if cache is None:
            cache = self._local.bufs = {}
        buf = cache.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = cache[name] = np.empty(shape, dtype)
        return buf

    def _encode_lossy(self, kv: torch.Tensor, layout: KVLayout, level: int) -> tuple[list[np.ndarray], int, int]:
        L, _, H, T, D = (int(s) for s in kv.shape)
        S, C, G, ab = 2 * L, H * D, self.group_size, self.anchor_bits
        with torch.no_grad():
            src = kv.detach()
            head_bits = round_to_layout(src[:, :, :, 0, :], layout).reshape(S, C)
        head = bits_to_f32(head_bits, layout)
        n = T - 1
        st = np.empty((S, C, 4))
        x = self._float32_stats(src, st)  # [L, 2, H, T, D] float32, C-contiguous
        kinds = np.full(S, SEG_EMBEDDED, np.uint8)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            finite = np.isfinite(st).all(axis=(1, 2)) & np.isfinite(head).all(axis=1) if n else \
                np.isfinite(head).all(axis=1)
            mean = st[:, :, 0] / max(n, 1)
            mu = np.clip(np.nan_to_num(mean), -65504.0, 65504.0).astype(np.float16).astype(np.float32)
            maxdev = np.maximum(st[:, :, 3] - mu, mu - st[:, :, 2]) if n else np.zeros((S, C))
            maxdev = np.nan_to_num(maxdev, nan=0.0, posinf=0.0, neginf=0.0)
            std = np.sqrt(np.maximum(st[:, :, 1] / max(n, 1) - mean * mean, 0.0)) if n else np.zeros((S, C))
            std = np.nan_to_num(std)
            e_floor = np.ceil(8.0 * np.log2(np.maximum(maxdev, 1e-30) * 2.0 ** max(1, ab) / QLIMIT))
        e_floor = np.maximum(e_floor, -128).astype(np.int64)
        kinds[~finite | (e_floor > 127).any(axis=1)] = SEG_RAW
        prof = P.for_layout(layout) if self.use_profile else None
        if prof is not None and (prof.group_size != G or prof.anchor_bits != ab):
            prof = None
        dflag = np.zeros((S, C), np.uint8)
        ia = np.zeros((S, C), np.uint8)
        idx = np.zeros((S, C), np.uint8)
        if prof is not None:
            e_p, ia_p, id_p, df_p = prof.params(level)
            fits = (e_p >= e_floor).all(axis=1) & (e_p <= 127).all(axis=1)
            use = fits & (kinds != SEG_RAW)
            kinds[use] = SEG_PROFILE
            e = np.maximum(e_p, e_floor)
            dflag[:] = df_p
            ia[use], idx[use] = ia_p[use], id_p[use]
        else:
            lf = np.ones(S)
            lf[: 2 * max(1, L // 3)] = 0.5  # shallow layers: one more bit
            beta = HEURISTIC_BETA1 * 2.0 ** ((level - 1) / 2.0)
            with np.errstate(divide="ignore"):
                e = np.ceil(8.0 * np.log2(np.maximum(std * beta * lf[:, None], 1e-30)))
            e = np.maximum(e, e_floor).astype(np.int64)
        e = np.clip(e, -128, 127).astype(np.int64)
        steps = Q.steps_from_exponents(e)
        asteps_d = Q.steps_from_exponents(e - 8 * ab)
        lossy = np.flatnonzero(kinds != SEG_RAW).astype(np.int64)
        choose = kinds == SEG_EMBEDDED
        to_choose = np.flatnonzero(choose).astype(np.int64)
        if prof is None and G > 1 and len(to_choose):  # pick flat or delta per channel by trial coding
            cost = np.zeros((S, C, 2))

            stride = max(1, T // 128)  # a sample of the groups is enough to rank the two modes

            def trial(part: np.ndarray) -> None:
                Q.mode_costs(x, part, head, mu, steps, asteps_d, G, True, np.empty((C, 5)), cost, stride)
            self._split(trial, to_choose)
            margin = 0.05 * T / stride  # delta must win by 0.05 bit a token: ties stay flat (cheaper to decode)
            dflag[to_choose] = (cost[to_choose, :, 1] + margin < cost[to_choose, :, 0]).astype(np.uint8)
        asteps = np.where(dflag != 0, asteps_d, steps).astype(np.float32)
        words_cap = 2 * T * C + 64
        words = self._scratch("words", (S, words_cap), np.uint16)
        starts = np.zeros(S, np.int64)
        fam = family()
        if self.coder == "rans":
            head, mu, steps, asteps = (np.ascontiguousarray(a) for a in (head, mu, steps, asteps))

            def work(part: np.ndarray) -> None:
                qbuf = self._scratch("q", (T, C), np.int32)
                Q.encode_segments(x, part, head, mu, steps, asteps, dflag, ia, idx, choose, G, True, fam.fc, fam.rcps,
                                  qbuf, np.empty((C, 2)), words, starts)
            self._split(work, lossy)
            coded = [words[s, starts[s]:] for s in range(S)]
        else:
            ref = self._reference
            assert ref is not None
            coded = [np.zeros(0, np.uint16)] * S
            for s in lossy:
                coded[s] = ref.encode_segment(x[s // 2, s % 2], head[s], mu[s], steps[s], asteps[s], dflag[s], ia[s],
                                            idx[s], bool(choose[s]), G).view(np.uint16)
        raw_bytes = H * T * D * layout.itemsize
        raw_parts: dict[int, np.ndarray] = {}
        for s in lossy:
            if coded[s].nbytes >= raw_bytes:
                kinds[s] = SEG_RAW
        for s in np.flatnonzero(kinds == SEG_RAW):
            raw_parts[s] = round_to_layout(kv[s // 2, s % 2], layout).reshape(-1)
        lengths = np.array([raw_parts[s].nbytes if kinds[s] == SEG_RAW else coded[s].nbytes for s in range(S)],
                           dtype="<u4")
        emb = np.flatnonzero(kinds == SEG_EMBEDDED)
        ia_out = np.where(dflag != 0, ia, 255).astype(np.uint8)
        parts = [kinds, lengths, head_bits, mu.astype("<f2")]
        if len(emb):
            parts += [e[emb].astype(np.int8), ia_out[emb], idx[emb]]
        for s in range(S):
            parts.append(raw_parts[s] if kinds[s] == SEG_RAW else coded[s])
        flags = FLAG_HEAD | (FLAG_PROFILE if prof is not None and (kinds == SEG_PROFILE).any() else 0)
        return parts, flags, prof.id if flags & FLAG_PROFILE else 0

    def _float32_stats(self, src: torch.Tensor, st: np.ndarray) -> np.ndarray:
        """kv as float32 numpy, and st [S, C, 4] = per-channel (sum, sum of squares, min, max) over tokens >= 1.
        Why per layer in the pool: the fp16 -> fp32 widening and the statistics release the GIL (numba kernels),
        so they split across cores like the coding."""
        L = int(src.shape[0])
        if src.dtype == torch.float32:
            x, bits = np.ascontiguousarray(src.numpy()), None  # the coding kernels want it contiguous
        elif src.dtype == torch.float16:  # widened by an F16C kernel: numpy's cast is far slower
            x, bits = self._scratch("x", tuple(src.shape), np.float32), src.numpy().view(np.uint16)
        else:  # bfloat16 has no numpy dtype: one torch cast
            x, bits = np.ascontiguousarray(src.float().numpy()), None

        def prep(layers: np.ndarray) -> None:
            for l in layers:  # chunk_stats reads K and V of every layer it is given: one layer at a time
                if bits is not None:
                    Q.widen_f16(bits[l], x[l])
                Q.chunk_stats(x[l:l + 1], 1, st[2 * l:2 * l + 2])
        self._split(prep, np.arange(L, dtype=np.int64))
        return x

    def decode(self, header: ChunkHeader, blob: memoryview, layout: KVLayout, out: torch.Tensor) -> None:
        if tuple(out.shape) != header.shape:
            raise ChunkFormatError(f"chunk shape {header.shape} does not fit the output {tuple(out.shape)}")
        if header.dtype_code != layout.dtype_code or header.shape != layout.shape(header.num_tokens):
            raise ChunkFormatError("cachegen chunk does not match the layout")
        if not 0 <= header.level <= MAX_LEVEL:
            raise ChunkFormatError(f"cachegen level {header.level} out of range")
        pay = np.frombuffer(blob, np.uint8, count=header.payload_len, offset=HEADER_BYTES) \
            if len(blob) >= HEADER_BYTES + header.payload_len else None
        if pay is None:
            raise ChunkFormatError("cachegen payload shorter than its header says")
        rd = Reader(pay)
        magic, version, mode, coder, flags, G, ab, isz, _, S, _, C, fam_id, pid = PRELUDE.unpack(
            rd.take(PRELUDE.size).tobytes())
        L, _, H, T, D = header.shape
        if magic != MAGIC or version != STREAM_VERSION:
            raise ChunkFormatError("not a cachegen stream (magic/version)")
        if S != 2 * L or C != H * D or isz != layout.itemsize or G < 1 or ab > 7 or coder > CODER_CONSTRICTION:
            raise ChunkFormatError("cachegen prelude does not match the chunk")
        if mode != (MODE_LOSSLESS if header.level == 0 else MODE_LOSSY) or flags & ~(FLAG_HEAD | FLAG_PROFILE):
            raise ChunkFormatError("cachegen mode/flags inconsistent")
        if fam_id != family().id:
            raise ChunkFormatError("cachegen stream made with other probability tables")
        kinds = rd.array("u1", (S,))
        lengths = rd.array("<u4", (S,)).astype(np.int64)
        allowed = (SEG_RAW, SEG_BYTES) if mode == MODE_LOSSLESS else (SEG_RAW, SEG_EMBEDDED, SEG_PROFILE)
        if not np.isin(kinds, allowed).all():
            raise ChunkFormatError("cachegen segment kind invalid")
        raw_bytes = H * T * D * isz
        if (lengths[kinds == SEG_RAW] != raw_bytes).any():
            raise ChunkFormatError("cachegen raw segment has the wrong length")
        o5, scratch = self._output(out)
        if mode == MODE_LOSSLESS:
            decode_lossless(rd, kinds, lengths, layout, o5, header.shape, self._split)
        else:
            decode_lossy(rd, kinds, lengths, layout, o5, header, flags, pid, coder, G, ab, self._split, self._reference)
        if rd.pos != pad4(len(pay)) or len(pay) % 4:
            raise ChunkFormatError("cachegen stream has trailing bytes")
        if scratch:
            out.copy_(torch.from_numpy(o5))

    def _output(self, out: torch.Tensor) -> tuple[np.ndarray, bool]:
        """Where the decoders write: a numpy view of `out` (float32, or fp16 as uint16 bits), or a float32
        scratch buffer to copy from (the bool says which)."""
        if out.device.type == "cpu" and not out.requires_grad:
            if out.dtype == torch.float32:
                return out.detach().numpy(), False
            if out.dtype == torch.float16:
                return out.detach().numpy().view(np.uint16), False
        return self._scratch("out", tuple(out.shape), np.float32), True

    # ---- contract helpers ------------------------------------------------------------------------------------
    def error_bound(self, kv: torch.Tensor, blob: bytes | bytearray | memoryview, layout: KVLayout) -> torch.Tensor:
        """Per-element bound on |decode(encode(kv)) - kv| stated by this stream (decode.stated_error_bound)."""
        return stated_error_bound(kv, blob, layout)
