"""The cachegen stream's constants and byte-level helpers, shared by the lossy (codec.py) and lossless
(lossless.py) paths: the prelude layout, segment kinds, layout-dtype bit patterns, and a bounds-checked reader
(every block starts 4-byte aligned; a read past the end raises ChunkFormatError)."""
from __future__ import annotations

import struct
from typing import Protocol

import numpy as np
import torch

from kvfabric.codec.format import ChunkFormatError
from kvfabric.kv.layout import KVLayout

CODEC_ID = 2
MAGIC = b"KVCG"
STREAM_VERSION = 1
MAX_LEVEL = 9
DEFAULT_LEVEL = 6
MODE_LOSSLESS, MODE_LOSSY = 0, 1
CODER_RANS, CODER_CONSTRICTION = 0, 1  # 1: the reference coder, a SegmentCoder given to the codec
SEG_RAW, SEG_EMBEDDED, SEG_PROFILE, SEG_BYTES = 0, 1, 2, 3
FLAG_HEAD, FLAG_PROFILE = 1, 2
PRELUDE = struct.Struct("<4sBBBBBBBBHHIQQ")
HEURISTIC_BETA1 = 2.0 ** -4  # level-1 step / channel std without a profile
QLIMIT = 16000.0  # |residual| stays below this (the escape codes 16 bits): a floor under every step


class SegmentCoder(Protocol):
    """A second entropy coder for lossy segments (stream coder 1), given to `CacheGenCodec(coder=...)`
    (kvfabric.research.cachegen_reference is one).
    `encode_segment` quantizes and codes one segment x [H, T, D] with the given steps (fitting the model indices
    into ia / idx in place when `choose`) and returns its uint32 words; `decode_segment` returns q [T, C] (int32)
    from the words, raising ValueError on a stream that does not decode."""

    def encode_segment(self, x: np.ndarray, head: np.ndarray, mu: np.ndarray, steps: np.ndarray,
                       asteps: np.ndarray, dflag: np.ndarray, ia: np.ndarray, idx: np.ndarray, choose: bool,
                       G: int) -> np.ndarray: ...

    def decode_segment(self, words: np.ndarray, T: int, C: int, ia: np.ndarray, idx: np.ndarray,
                       G: int) -> np.ndarray: ...


def pad4(n: int) -> int:
    return (n + 3) & ~3



def dtype_bits(layout: KVLayout) -> np.dtype:
    return np.dtype({2: "<u2", 4: "<u4"}[layout.itemsize])


def bits_to_f32(bits: np.ndarray, layout: KVLayout) -> np.ndarray:
    """Layout-dtype bit patterns -> float32 values."""
    if layout.dtype == "float16":
        return bits.view("<f2").astype(np.float32)
    if layout.dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view("<f4").astype(np.float32)


def as_out(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """float32 values as elements of a decoder's output `out`: themselves for float32, their fp16 bits (round to
    nearest even) for a uint16 output holding fp16. The numpy twin of the kernels' jit.store."""
    return values if out.dtype == np.float32 else values.astype(np.float16).view(np.uint16)


def round_to_layout(values: torch.Tensor, layout: KVLayout) -> np.ndarray:
    """Bit patterns of `values` in the layout dtype (numpy, contiguous)."""
    t = values.to(layout.torch_dtype).contiguous()
    return t.view({2: torch.int16, 4: torch.int32}[layout.itemsize]).numpy().view(dtype_bits(layout))


class Reader:
    """Bounds-checked views into the payload; every block starts 4-byte aligned."""

    def __init__(self, pay: np.ndarray) -> None:
        self.pay, self.pos = pay, 0

    def take(self, nbytes: int) -> np.ndarray:
        if nbytes < 0 or self.pos + nbytes > len(self.pay):
            raise ChunkFormatError(f"truncated cachegen stream: need {nbytes} bytes at {self.pos} of {len(self.pay)}")
        block = self.pay[self.pos:self.pos + nbytes]
        self.pos = pad4(self.pos + nbytes)
        return block

    def array(self, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        dt = np.dtype(dtype)
        block = self.take(int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
        arr = block.view(dt).reshape(shape)
        return arr if arr.flags.aligned else arr.copy()

