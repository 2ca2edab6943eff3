"""int8 codec: symmetric 8-bit quantization, 2x smaller than fp16, no entropy coding (fast on both sides).

Level 0 (default): one scale per (layer, K/V, head, channel), over the chunk's tokens: K has outlier channels,
so a per-channel scale keeps them from flattening the rest. Level 1: one scale per (layer, K/V, head, token),
over the head dimension (the LMCache-style per-token layout). scale = max|x| / 127, q = round(x / scale).

Payload: scales float32 (level 0: [L, S, H, D]; level 1: [L, S, H, T]) then q int8 [L, S, H, T, D] (S = 2: K, V;
S = 1: an MLA latent, quantized per latent channel the same way).
Error bound: |x - x_hat| <= scale / 2 (+ rounding to the output dtype). Non-finite inputs are coded as the
nearest finite fp16 value (NaN as 0): a lossy codec never stores a NaN.
Decode checks the exact payload size and that every scale is finite and >= 0 before touching `out`.
"""
from __future__ import annotations

import warnings

import torch

from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, write_blob
from kvfabric.kv.layout import KVLayout

FP16_MAX = 65504.0


def _payload_len(shape: tuple[int, ...], level: int) -> int:
    L, S, H, T, D = shape
    scales = L * S * H * (D if level == 0 else T)
    return 4 * scales + L * S * H * T * D


class Int8Codec:
    name = "int8"
    codec_id = 1
    is_lossless = False

    def __init__(self, level: int = 0) -> None:
        if level not in (0, 1):
            raise ValueError(f"int8 level must be 0 (per channel) or 1 (per token), got {level!r}")
        self.level = level

    def encode(self, kv: torch.Tensor, key: bytes, layout: KVLayout) -> bytearray:
        layout.check(kv)
        shape = tuple(int(s) for s in kv.shape)
        L, _, H, T, D = shape
        dim = 3 if self.level == 0 else 4
        with torch.no_grad():
            x = kv.detach()
            x = x if x.dtype == torch.float32 else x.float()
            lo, hi = torch.aminmax(x, dim=dim, keepdim=True)
            amax = torch.maximum(-lo, hi)
            if not bool(torch.isfinite(amax).all()):
                x = torch.nan_to_num(x, nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX)
                amax = x.abs().amax(dim=dim, keepdim=True)
            scale = amax / 127.0  # [L,2,H,1,D] or [L,2,H,T,1]
            q = x * torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
            q.round_().clamp_(-127, 127)
        payload_len = _payload_len(shape, self.level)
        blob = bytearray(HEADER_BYTES + payload_len)
        n_scales = scale.numel()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.frombuffer(blob, dtype=torch.float32, count=n_scales, offset=HEADER_BYTES).copy_(scale.reshape(-1))
            torch.frombuffer(blob, dtype=torch.int8, offset=HEADER_BYTES + 4 * n_scales).view(shape).copy_(q)
        header = ChunkHeader(self.codec_id, layout.dtype_code, self.level, layout.fingerprint, shape, key,  # type: ignore[arg-type]
                             payload_len)
        write_blob(header, blob)
        return blob

    def decode(self, header: ChunkHeader, blob: memoryview, layout: KVLayout, out: torch.Tensor) -> None:
        if header.level not in (0, 1) or header.dtype_code != layout.dtype_code:
            raise ChunkFormatError("int8 chunk does not match the layout")
        if tuple(out.shape) != header.shape or header.shape != layout.shape(header.num_tokens):
            raise ChunkFormatError(f"chunk shape {header.shape} does not fit the output {tuple(out.shape)}")
        if header.payload_len != _payload_len(header.shape, header.level) or \
                len(blob) < HEADER_BYTES + header.payload_len:
            raise ChunkFormatError("int8 payload has the wrong size")
        L, S, H, T, D = header.shape
        sshape = (L, S, H, 1, D) if header.level == 0 else (L, S, H, T, 1)
        n_scales = L * S * H * (D if header.level == 0 else T)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            scale = torch.frombuffer(blob, dtype=torch.float32, count=n_scales, offset=HEADER_BYTES).view(sshape)
            q = torch.frombuffer(blob, dtype=torch.int8, count=L * S * H * T * D,
                                 offset=HEADER_BYTES + 4 * n_scales).view(header.shape)
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise ChunkFormatError("int8 scales are not finite and non-negative")
        out.copy_(q)
        out.mul_(scale)

    def error_bound(self, kv: torch.Tensor, blob: bytes | bytearray | memoryview, layout: KVLayout) -> torch.Tensor:
        """Per-element bound on |decode - kv|: half the element's scale (+ a relative fp32 rounding term)."""
        x = kv.float()
        dim = 3 if self.level == 0 else 4
        return x.abs().amax(dim=dim, keepdim=True) / 254.0 * 1.0001 + x.abs() * 1e-6 + 1e-30
