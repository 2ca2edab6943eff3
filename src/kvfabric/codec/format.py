"""The chunk format: the one serialization seam for everything stored on disk, in shared memory or sent on a wire.

Layout of a chunk blob (all integers little-endian):

    offset size  field
    0      4     magic b"KVFC"
    4      1     format version (2; version 1 had no block layout and a 92-byte header: a clean miss now)
    5      1     codec id (0 raw, see codec.base)
    6      1     dtype code of the decoded KV (layout.DTYPES)
    7      1     codec level (0 for raw)
    8      8     layout fingerprint
    16     20    decoded shape: 5 x uint32 [num_layers, 2, num_kv_heads, num_tokens, head_dim] (1 not 2: MLA latents)
    36     32    chunk key (so an entry stored or served under the wrong key is caught)
    68     16    block layout of a raw payload (kvfabric.kv.blocks.pack: all zero = token-major [L, 2, H, T, D])
    84     20    reserved (zero)
    104    8     payload length in bytes
    112    8     xxh3-64 of the payload
    120    8     xxh3-64 of bytes [0, 120): the header protects itself
    128    ...   payload (codec-specific; 64-byte aligned where the blob is)

Version 1 blobs (before the block layouts) fail `parse` like any foreign blob: a clean miss, recomputed and stored
again in this format.

What the payload holds: the KV of the chunk's own tokens for every layer, sliding-window layers included (see
`kvfabric.kv.layout` for why and for which rows a load needs); the fingerprint names the layout's layer groups, so a
chunk of another group map is refused like one of another model.

Contract: `parse` accepts a blob only if every field checks out (magic, version, lengths, both checksums, the
expected key); otherwise it raises `ChunkFormatError`, which callers turn into a counted miss. Nothing is
unpickled, and no length read from the blob is used before it is bounds-checked against the blob's real size.

Checksums protect bytes in storage and in transit. A blob made by this process for its own memory may be
*unsealed* (`pack_unsealed`: both checksum fields zero), so that storing a chunk in process memory costs one
copy and no hash; `fill_checksums` seals it in place before it leaves the process (the tier stack before a
write to any untrusted tier, the peer server before sending). `parse(..., is_trusted=True)`, for blobs this
process made or already verified, checks neither checksum and reads no checksum bytes, so it never races with
a concurrent `fill_checksums`. An unsealed blob fails `parse` everywhere else (header checksum).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import xxhash

from kvfabric.kv.blocks import BlockLayout, BlockLayoutError, pack, unpack

MAGIC = b"KVFC"
VERSION = 2
_HEAD = struct.Struct("<4sBBBB8s5I32s16s20xQQ")  # everything up to the header checksum
_SUM = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _SUM.size  # 128
MAX_DIM = 1 << 20  # no real layout comes near this; bounds hostile shapes before any allocation


class ChunkFormatError(ValueError):
    """A blob that is not a valid chunk for the expected key (corrupt, truncated, foreign)."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    codec_id: int
    dtype_code: int
    level: int
    fingerprint: bytes
    shape: tuple[int, int, int, int, int]  # [num_layers, 2 (K, V) or 1 (a latent), num_kv_heads, num_tokens, head_dim]
    key: bytes
    payload_len: int
    blocks: BlockLayout | None = None  # a raw payload in a paged engine's block layout (None: token-major)
    # the stored xxh3-64 of the payload (filled by parse; ignored when packing, and by ==: headers of the same
    # format and key compare equal whatever their payloads)
    payload_sum: int = field(default=0, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.shape[3]


def pack_header(header: ChunkHeader, payload_checksum: int) -> bytes:
    head = _HEAD.pack(MAGIC, VERSION, header.codec_id, header.dtype_code, header.level, header.fingerprint,
                      *header.shape, header.key, pack(header.blocks), header.payload_len, payload_checksum)
    return head + _SUM.pack(xxhash.xxh3_64_intdigest(head))


def pack_unsealed(header: ChunkHeader) -> bytes:
    """The header of an unsealed blob: both checksums zero (see the module docstring)."""
    return _HEAD.pack(MAGIC, VERSION, header.codec_id, header.dtype_code, header.level, header.fingerprint,
                      *header.shape, header.key, pack(header.blocks), header.payload_len, 0) + _SUM.pack(0)


_PAYLOAD_SUM_AT = _HEAD.size - _SUM.size  # offset of the payload checksum: the last field before the header's


def fill_checksums(blob: bytearray | memoryview) -> None:
    """Seal an unsealed blob in place (a sealed one is left as it is). Safe beside other sealers of the same blob
    (all write the same bytes; each decides from one snapshot of the header, and a torn snapshot does not
    verify, so it recomputes) and beside trusted readers (they never read the checksum bytes)."""
    view = memoryview(blob)
    head = bytes(view[:HEADER_BYTES])
    if len(head) < HEADER_BYTES or view.readonly or \
            xxhash.xxh3_64_intdigest(head[:_HEAD.size]) == _SUM.unpack_from(head, _HEAD.size)[0]:
        return  # sealed (or not a blob at all, or immutable: parse rejects what does not check out)
    payload_sum = _SUM.pack(xxhash.xxh3_64_intdigest(view[HEADER_BYTES:]))
    header_sum = _SUM.pack(xxhash.xxh3_64_intdigest(head[:_PAYLOAD_SUM_AT] + payload_sum))
    view[_PAYLOAD_SUM_AT:HEADER_BYTES] = payload_sum + header_sum


def write_blob(header: ChunkHeader, blob: bytearray | memoryview) -> None:
    """Fill the header of `blob` (HEADER_BYTES + payload_len, payload already in place) in place."""
    payload = memoryview(blob)[HEADER_BYTES:]
    if len(payload) != header.payload_len:
        raise ValueError(f"payload is {len(payload)} bytes, header says {header.payload_len}")
    blob[:HEADER_BYTES] = pack_header(header, xxhash.xxh3_64_intdigest(payload))


def parse(blob: bytes | bytearray | memoryview, key: bytes | None = None, verify_payload: bool = True,
          is_trusted: bool = False, blob_size: int | None = None) -> ChunkHeader:
    """Check `blob` and return its header; raise ChunkFormatError on any mismatch.

    verify_payload=False skips the payload checksum (the payload was checked already, or only the header is
    needed). is_trusted=True skips both checksums: in-process memory only, blobs this process made (maybe
    unsealed) or verified when they came in. `blob_size` (with verify_payload=False): `blob` is the header alone
    of a blob of that many bytes (a ranged read), checked against it."""
    view = memoryview(blob)
    if len(view) < HEADER_BYTES:
        raise ChunkFormatError(f"truncated: {len(view)} bytes is shorter than the {HEADER_BYTES}-byte header")
    if bytes(view[:4]) != MAGIC:
        raise ChunkFormatError(f"bad magic {bytes(view[:4])!r}")
    if view[4] != VERSION:  # version 1 (92-byte header) included: a clean miss, stored again in this format
        raise ChunkFormatError(f"unsupported format version {view[4]}")
    head = view[:_HEAD.size]
    if not is_trusted and xxhash.xxh3_64_intdigest(head) != _SUM.unpack_from(view, _HEAD.size)[0]:
        raise ChunkFormatError("header checksum mismatch")
    _, _, codec_id, dtype_code, level, fingerprint, *rest = _HEAD.unpack(head)
    shape, chunk_key, packed_blocks, payload_len, payload_sum = tuple(rest[:5]), *rest[5:9]
    try:
        blocks = unpack(packed_blocks)
    except BlockLayoutError as exc:
        raise ChunkFormatError(str(exc)) from None
    if any(d <= 0 or d > MAX_DIM for d in shape) or shape[1] not in (1, 2):
        raise ChunkFormatError(f"implausible shape {shape}")
    if blocks is not None and blocks.family != "vllm" and shape[1] != 2:
        raise ChunkFormatError(f"a {blocks.describe()} block holds K and V, not the latent of shape {shape}")
    if key is not None and chunk_key != key:
        raise ChunkFormatError("chunk key mismatch: entry stored under another key")
    size = len(view) if blob_size is None else blob_size
    if payload_len != size - HEADER_BYTES:
        raise ChunkFormatError(f"payload length {size - HEADER_BYTES} != header's {payload_len}")
    if verify_payload and not is_trusted and xxhash.xxh3_64_intdigest(view[HEADER_BYTES:]) != payload_sum:
        raise ChunkFormatError("payload checksum mismatch")
    return ChunkHeader(codec_id, dtype_code, level, fingerprint, shape, chunk_key, payload_len,  # type: ignore[arg-type]
                       blocks, payload_sum)


def check_payload(blob: bytes | bytearray | memoryview, header: ChunkHeader) -> None:
    """The payload checksum that `parse(verify_payload=False)` skipped: ChunkFormatError when it does not match."""
    if xxhash.xxh3_64_intdigest(memoryview(blob)[HEADER_BYTES:]) != header.payload_sum:
        raise ChunkFormatError("payload checksum mismatch")
