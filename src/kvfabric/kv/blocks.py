"""Block layouts: how a paged engine's KV block holds its tokens, and the one place that converts between a chunk
payload in such a layout and the exchange shape [num_layers, 2, num_kv_heads, num_tokens, head_dim].

Contract:
- A raw chunk's payload is either token-major (the exchange shape, C order; `BlockLayout` None) or in the block
  layout of the paged engine that wrote it: per layer, the chunk's ceil(T / B) blocks exactly as the engine's
  cache holds them (`payload_shape`), so that a load into an engine of the same layout copies whole runs of
  blocks per layer, with no transpose and no staging. The chunk header names the layout (`pack` / `unpack`:
  16 bytes, all zero for token-major); chunk keys never depend on it, so every engine finds every chunk.
- Family "vllm-cpu": vLLM's CPU attention cache, one layer a tensor (num_blocks, H, B, 2*D) whose every
  (block, head) holds a K region of B*D values then a V region of B*D values; a region is token-major
  ("td": [B, D], `*_dt` False) or dim-major ("dt": [D, B], True). So one block is [H, 2, B*D].
- Family "vllm": vLLM 0.32's GPU attention backends (FLASH_ATTN, FLASHINFER, TRITON_ATTN: connectors/paged_views),
  one block of one layer as its `KVCacheLayout` keeps it in memory: [H, B, 2*D] (LBHNC = FlashInfer HND, LHBNC,
  BLHNC, BHLNC) or, `token_major`, [B, H, 2*D] (LBNHC = NHD, vLLM's default, and BLNHC); each token's 2*D values
  are its K then its V. An MLA latent (a layout's `is_latent`) is the same family with one state: [1, B, D] or
  [B, 1, D] per block (H = 1), each token's D values its latent.
- A partial last block (T not a multiple of B) is stored whole; its slots from T on are zero.
- `to_tokens(payload, blocks, out)` and `from_tokens(kv, blocks, out)` convert either way, exactly (a copy of
  bits, any dtype, numpy views: bfloat16 travels as 16-bit words).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

FAMILIES = {"vllm-cpu": 1, "vllm": 2}
_PACK = struct.Struct("<BBBBI8x")  # family, key_dt | token_major, value_dt, reserved, block size: 16 bytes
PACKED_BYTES = _PACK.size
TOKEN_MAJOR = bytes(PACKED_BYTES)


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
WORD_DTYPES: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)}


def as_words(x: torch.Tensor) -> np.ndarray:
    """x's bytes as a numpy view of integer words of its itemsize (numpy has no bfloat16; every copy here is
    of bits)."""
    return x.view(_WORDS[x.element_size()]).numpy()


class BlockLayoutError(ValueError):
    """A block layout descriptor that names nothing this version knows."""


@dataclass(frozen=True, slots=True)
class BlockLayout:
    block_size: int
    key_dt: bool = False  # vllm-cpu: K region dim-major [D, B] (vLLM 0.32's CPU "vec" ISA), not token-major [B, D]
    value_dt: bool = False
    family: str = "vllm-cpu"
    token_major: bool = False  # vllm: a block is [B, H, 2*D] (NHD), not [H, B, 2*D] (HND)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise BlockLayoutError(f"unknown block layout family {self.family!r}")
        if self.family == "vllm" and (self.key_dt or self.value_dt):
            raise BlockLayoutError("a vllm (GPU) block keeps K and V token by token: no dim-major regions")
        if self.family == "vllm-cpu" and self.token_major:
            raise BlockLayoutError("a vllm-cpu block is [H, 2, B*D]: token_major names vllm (GPU) blocks")
        if not isinstance(self.block_size, int) or not 0 < self.block_size < 1 << 16:
            raise BlockLayoutError(f"block_size must be in [1, 65536), got {self.block_size!r}")

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_shape(self, num_kv_heads: int, head_dim: int, num_states: int = 2) -> tuple[int, int, int]:
        """One block of one layer: vllm-cpu [H, 2, B*D] (K region, then V region, per head); vllm [H, B, S*D] or,
        token_major, [B, H, S*D] (S = 2: K then V; S = 1: an MLA latent, H = 1)."""
        if self.family == "vllm":
            outer = (self.block_size, num_kv_heads) if self.token_major else (num_kv_heads, self.block_size)
            return *outer, num_states * head_dim
        if num_states != 2:
            raise BlockLayoutError("a vllm-cpu block holds K and V regions: no latent (MLA) blocks")
        return num_kv_heads, 2, self.block_size * head_dim

    def payload_shape(self, num_layers: int, num_kv_heads: int, num_tokens: int, head_dim: int,
                      num_states: int = 2) -> tuple[int, int, int, int, int]:
        """The payload of a chunk of num_tokens: [L, num_blocks, *block_shape]."""
        return (num_layers, self.num_blocks(num_tokens), *self.block_shape(num_kv_heads, head_dim, num_states))

    def describe(self) -> str:
        if self.family == "vllm":
            return f"vllm/B{self.block_size}/{'NHD' if self.token_major else 'HND'}"
        orders = "".join("dt" if dt else "td" for dt in (self.key_dt, self.value_dt))
        return f"{self.family}/B{self.block_size}/{orders[:2]}+{orders[2:]}"


def pack(blocks: BlockLayout | None) -> bytes:
    if blocks is None:
        return TOKEN_MAJOR
    first = int(blocks.token_major) if blocks.family == "vllm" else int(blocks.key_dt)
    return _PACK.pack(FAMILIES[blocks.family], first, int(blocks.value_dt), 0, blocks.block_size)


def unpack(raw: bytes) -> BlockLayout | None:
    """The layout a header's 16 bytes name (None: token-major); BlockLayoutError for anything else."""
    if raw == TOKEN_MAJOR:
        return None
    family, first, value_dt, reserved, block_size = _PACK.unpack(raw)
    names = {code: name for name, code in FAMILIES.items()}
    if family not in names or first > 1 or value_dt > 1 or reserved or raw[8:] != bytes(8):
        raise BlockLayoutError(f"unknown block layout descriptor {raw.hex()}")
    if names[family] == "vllm":
        return BlockLayout(block_size, False, bool(value_dt), "vllm", token_major=bool(first))
    return BlockLayout(block_size, bool(first), bool(value_dt), names[family])


def region_tokens(region: np.ndarray, block_size: int, is_dt: bool) -> np.ndarray:
    """A view of regions [..., B*D] as token-major [..., B, D] (transposed when the region is dim-major)."""
    lead = region.shape[:-1]
    head_dim = region.shape[-1] // block_size
    if is_dt:
        return region.reshape(*lead, head_dim, block_size).swapaxes(-1, -2)
    return region.reshape(*lead, block_size, head_dim)


def _pairs(payload: np.ndarray, kv: np.ndarray, blocks: BlockLayout):
    """For K and V: (the payload's region as [L, n, H, B, D], kv's [L, H, T, D]) views."""
    for which, is_dt in enumerate((blocks.key_dt, blocks.value_dt)):
        yield region_tokens(payload[:, :, :, which, :], blocks.block_size, is_dt), kv[:, which]


def to_tokens(payload: np.ndarray, blocks: BlockLayout, out: np.ndarray) -> None:
    """payload [L, n, *block_shape] (n = ceil(T / B)) -> out [L, S, H, T, D], same itemsize (S = 1: a latent,
    vllm family only)."""
    _convert(payload, out, blocks, into_tokens=True)


def from_tokens(kv: np.ndarray, blocks: BlockLayout, out: np.ndarray) -> None:
    """kv [L, S, H, T, D] -> out [L, n, *block_shape] (the partial last block's free slots zeroed)."""
    _convert(out, kv, blocks, into_tokens=False)


def _gpu_pairs(payload: np.ndarray, kv: np.ndarray, blocks: BlockLayout):
    """The vllm family's (K, V or latent values as [L, n, H, B, D], kv's [L, H, T, D]) views."""
    by_block = payload.swapaxes(2, 3) if blocks.token_major else payload  # [L, n, H, B, S*D]
    head_dim = kv.shape[-1]
    for which in range(kv.shape[1]):  # K then V, or the one latent
        yield by_block[..., which * head_dim:(which + 1) * head_dim], kv[:, which]


def _convert(payload: np.ndarray, kv: np.ndarray, blocks: BlockLayout, into_tokens: bool) -> None:
    num_tokens, size = kv.shape[3], blocks.block_size
    whole, tail = divmod(num_tokens, size)
    pairs = _gpu_pairs(payload, kv, blocks) if blocks.family == "vllm" else _pairs(payload, kv, blocks)
    for region, tokens in pairs:  # region [L, n, H, B, D], tokens [L, H, T, D]
        num_layers, _, num_heads, _, head_dim = region.shape
        views = []  # (region part, tokens part) of the same shape
        if whole:
            views.append((region[:, :whole].transpose(0, 2, 1, 3, 4),
                          tokens[:, :, :whole * size, :].reshape(num_layers, num_heads, whole, size, head_dim)))
        if tail:
            views.append((region[:, whole, :, :tail, :], tokens[:, :, whole * size:, :]))
        for blocked, flat in views:
            if into_tokens:
                np.copyto(flat, blocked)
            else:
                np.copyto(blocked, flat)
        if tail and not into_tokens:
            region[:, whole, :, tail:, :] = 0
