"""The chunk format: the one serialization seam for everything stored on disk, in shared memory or sent on a wire.

Layout of a chunk blob (all integers little-endian):

    offset size  field
    0      4     magic b"KVFC"
    4      1     format version (3; 2 had no head table and is read as one without; 1 is a clean miss)
    5      1     codec id (0 raw, see codec.base)
    6      1     dtype code of the decoded KV (layout.DTYPES)
    7      1     codec level (0 for raw)
    8      8     layout fingerprint
    16     20    decoded shape: 5 x uint32 [num_layers, 2, num_kv_heads, num_tokens, head_dim] (1 not 2: MLA latents)
    36     32    chunk key (so an entry stored or served under the wrong key is caught)
    68     16    block layout of a raw payload (kvfabric.kv.blocks.pack: all zero = token-major [L, 2, H, T, D])
    84     4     head table length in bytes (0: none; a raw payload: num_layers * num_kv_heads * 8)
    88     8     xxh3-64 of the head table
    96     8     reserved (zero)
    104    8     payload length in bytes: the KV bytes, then the head table
    112    8     xxh3-64 of the KV bytes (the payload less its head table)
    120    8     xxh3-64 of bytes [0, 120): the header protects itself
    128    ...   payload (codec-specific; 64-byte aligned where the blob is)

Version 1 blobs (before the block layouts) fail `parse` like any foreign blob: a clean miss, recomputed and stored
again in this format. Version 2 blobs (before the head table) parse, with no table: every reader reads them whole.

The head table (kvfabric.codec.heads: one xxh3-64 per layer and KV head of a raw payload) lets a reader of some
layers' heads (a parallel engine's rank reading another shape's chunk) check only the bytes it reads. It lies after
the KV bytes, so the KV stays where every reader expects it; a whole reader checks the KV sum, a ranged reader the
table's sum and then the digests of what it read.

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

from kvfabric.codec.heads import digest_table, head_axis, payload_words, table_bytes
from kvfabric.kv.blocks import BlockLayout, BlockLayoutError, pack, unpack
from kvfabric.kv.layout import DTYPES

MAGIC = b"KVFC"
VERSION = 3
READABLE = (2, 3)  # version 2: the same header with no head table (its bytes 84-104 all zero)
_HEAD = struct.Struct("<4sBBBB8s5I32s16sIQ8xQQ")  # everything up to the header checksum
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
    payload_len: int  # the KV bytes and the head table after them
    blocks: BlockLayout | None = None  # a raw payload in a paged engine's block layout (None: token-major)
    table_len: int = 0  # bytes of the head table at the payload's end (0: none)
    # the stored xxh3-64 of the payload (filled by parse; ignored when packing, and by ==: headers of the same
    # format and key compare equal whatever their payloads)
    payload_sum: int = field(default=0, compare=False)
    table_sum: int = field(default=0, compare=False)  # the stored xxh3-64 of the head table (filled by parse)

    @property
    def num_tokens(self) -> int:
        return self.shape[3]

    @property
    def kv_len(self) -> int:
        """Bytes of the payload before its head table: the (encoded) KV."""
        return self.payload_len - self.table_len

    @property
    def itemsize(self) -> int:
        """Bytes of one decoded value (0: a dtype code this version does not know; a decoder refuses it)."""
        return _ITEMSIZES.get(self.dtype_code, 0)


_ITEMSIZES = {code: numpy_dtype.itemsize for _, numpy_dtype, code in DTYPES.values()}


def _pack(header: ChunkHeader, table_sum: int, payload_sum: int) -> bytes:
    return _HEAD.pack(MAGIC, VERSION, header.codec_id, header.dtype_code, header.level, header.fingerprint,
                      *header.shape, header.key, pack(header.blocks), header.table_len, table_sum,
                      header.payload_len, payload_sum)


def pack_header(header: ChunkHeader, payload_checksum: int, table_checksum: int = 0) -> bytes:
    """The sealed header: `payload_checksum` of the KV bytes, `table_checksum` of the head table (if any)."""
    head = _pack(header, table_checksum, payload_checksum)
    return head + _SUM.pack(xxhash.xxh3_64_intdigest(head))


def pack_unsealed(header: ChunkHeader) -> bytes:
    """The header of an unsealed blob: every checksum zero, the head table not filled (see the module docstring)."""
    return _pack(header, 0, 0) + _SUM.pack(0)


def fill_table(header: ChunkHeader, blob: bytearray | memoryview, whole: xxhash.xxh3_64 | None = None) -> int:
    """Write the head table of a raw blob whose KV is in place (after the KV bytes); its xxh3-64. `whole`: fed the
    KV bytes in the same pass (see heads.digest_table)."""
    if not header.table_len:
        return 0
    view = memoryview(blob)
    words = payload_words(view[HEADER_BYTES:HEADER_BYTES + header.kv_len], header.shape, header.itemsize,
                          header.blocks)
    table = digest_table(words, head_axis(header.blocks), whole).tobytes()
    view[HEADER_BYTES + header.kv_len:HEADER_BYTES + header.payload_len] = table
    return xxhash.xxh3_64_intdigest(table)


def _sums(header: ChunkHeader, blob: bytearray | memoryview) -> tuple[int, int]:
    """(the KV bytes' xxh3-64, the head table's) of a blob whose KV is in place, its table written on the way."""
    if not header.table_len:
        return xxhash.xxh3_64_intdigest(memoryview(blob)[HEADER_BYTES:HEADER_BYTES + header.kv_len]), 0
    whole = xxhash.xxh3_64()
    table_sum = fill_table(header, blob, whole)
    return whole.intdigest(), table_sum


_TABLE_SUM_AT = 88  # offset of the head table's checksum (see the layout above)
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
    try:
        header = parse(head, verify_payload=False, is_trusted=True, blob_size=len(view))
    except ChunkFormatError:
        return  # not a blob: whoever reads it rejects it
    kv_sum, table_sum_int = _sums(header, view)
    table_sum, payload_sum = _SUM.pack(table_sum_int), _SUM.pack(kv_sum)
    head = head[:_TABLE_SUM_AT] + table_sum + head[_TABLE_SUM_AT + 8:_PAYLOAD_SUM_AT] + payload_sum
    view[_TABLE_SUM_AT:_TABLE_SUM_AT + 8] = table_sum
    view[_PAYLOAD_SUM_AT:HEADER_BYTES] = payload_sum + _SUM.pack(xxhash.xxh3_64_intdigest(head))


def write_blob(header: ChunkHeader, blob: bytearray | memoryview) -> None:
    """Fill the header of `blob` (HEADER_BYTES + payload_len, payload already in place) in place."""
    payload = memoryview(blob)[HEADER_BYTES:]
    if len(payload) != header.payload_len:
        raise ValueError(f"payload is {len(payload)} bytes, header says {header.payload_len}")
    blob[:HEADER_BYTES] = pack_header(header, *_sums(header, blob))


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
    if view[4] not in READABLE:  # version 1 (92-byte header) included: a clean miss, stored again in this format
        raise ChunkFormatError(f"unsupported format version {view[4]}")
    head = view[:_HEAD.size]
    if not is_trusted and xxhash.xxh3_64_intdigest(head) != _SUM.unpack_from(view, _HEAD.size)[0]:
        raise ChunkFormatError("header checksum mismatch")
    _, _, codec_id, dtype_code, level, fingerprint, *rest = _HEAD.unpack(head)
    shape, (chunk_key, packed_blocks, table_len, table_sum, payload_len, payload_sum) = tuple(rest[:5]), rest[5:11]
    try:
        blocks = unpack(packed_blocks)
    except BlockLayoutError as exc:
        raise ChunkFormatError(str(exc)) from None
    if any(d <= 0 or d > MAX_DIM for d in shape) or shape[1] not in (1, 2):
        raise ChunkFormatError(f"implausible shape {shape}")
    if table_len not in (0, table_bytes(shape)) or table_len > payload_len:
        raise ChunkFormatError(f"head table of {table_len} bytes for shape {shape}")
    if blocks is not None and blocks.family != "vllm" and shape[1] != 2:
        raise ChunkFormatError(f"a {blocks.describe()} block holds K and V, not the latent of shape {shape}")
    if key is not None and chunk_key != key:
        raise ChunkFormatError("chunk key mismatch: entry stored under another key")
    size = len(view) if blob_size is None else blob_size
    if payload_len != size - HEADER_BYTES:
        raise ChunkFormatError(f"payload length {size - HEADER_BYTES} != header's {payload_len}")
    header = ChunkHeader(codec_id, dtype_code, level, fingerprint, shape, chunk_key, payload_len,
                         blocks, table_len, payload_sum, table_sum)
    if verify_payload and not is_trusted:
        check_payload(view, header)
    return header


def check_payload(blob: bytes | bytearray | memoryview, header: ChunkHeader) -> None:
    """The checksums that `parse(verify_payload=False)` skipped (the KV bytes', the head table's):
    ChunkFormatError when one does not match."""
    view = memoryview(blob)
    if xxhash.xxh3_64_intdigest(view[HEADER_BYTES:HEADER_BYTES + header.kv_len]) != header.payload_sum:
        raise ChunkFormatError("payload checksum mismatch")
    check_table(view[HEADER_BYTES + header.kv_len:HEADER_BYTES + header.payload_len], header)


def check_table(table: bytes | bytearray | memoryview, header: ChunkHeader) -> None:
    """The head table read on its own (a ranged reader's): ChunkFormatError unless it is the header's."""
    if len(table) != header.table_len or (header.table_len and xxhash.xxh3_64_intdigest(table) != header.table_sum):
        raise ChunkFormatError("head table checksum mismatch")
