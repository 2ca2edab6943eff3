"""Binary layout of a shared-memory pool file: constants, struct formats, entry checksums, geometry.

Layout of the pool file `<root>/kvfabric-<name>` (root /dev/shm), mmapped by every process (little-endian):

    [0, 4096)              header: magic, version, geometry, byte budget, xxh3 of these fields; at 512 the
                           writers' running totals (dirty flag, live bytes, live entries, used slots); at 544
                           the superseded flag (set in a file just before another is renamed over it)
    [4096, +128 * slots)   index: `num_slots` entries of 128 bytes, an open-addressing hash table (linear probing)
    [.., data_offset)      extent table for writers: offset u64[num_slots], then extent bytes u64[num_slots]
                           (0 unless READY); a compact copy of the READY entries' extents, so allocation scans
                           256 KiB instead of the whole index
    [data_offset, +data)   arena: chunk blobs, 64-byte aligned extents

An index entry: seq u64 | state u32 | key_len u32 | offset u64 | length u64 | atime u64 | esum u64 | key[64].
`state` is EMPTY, READY or TOMBSTONE; `esum` = xxh3 of (seq, state, key_len, offset, length, key).

Contract:
- Only bytes and arithmetic: no file, mapping, lock or process state here. Every process sharing a pool must
  agree on this layout; the header's magic and VERSION say which layout a file has.
- `Geometry(num_slots, capacity)` places every region; `Geometry.parse` returns the geometry a header
  describes, or a string saying why the header is unusable (it never raises on bad bytes).
- `entry_sum` is the checksum stored in (and checked against) an entry's `esum`.
"""
from __future__ import annotations

import mmap
import struct

import numpy as np
import xxhash

MAGIC = b"KVFSHMP\x00"
VERSION = 1
HEADER_BYTES = 4096
ENTRY_BYTES = 128
MAX_KEY_BYTES = 64
ALIGN = 64
PAGE = 4096
MAX_LOAD = 0.75  # used (READY + TOMBSTONE) slots before tombstones are purged or entries evicted

EMPTY, READY, TOMBSTONE = 0, 1, 2

HEADER = struct.Struct("<8sIIQIIQQQ")  # magic, version, header_bytes, num_slots, entry_bytes, align,
#                                        data_offset, data_bytes, capacity; then xxh3 of these
SUM = struct.Struct("<Q")
ENTRY = struct.Struct("<QIIQQQQ")  # seq, state, key_len, offset, length, atime, esum
FIELDS = struct.Struct("<QIIQQ")  # the checksummed fields: seq, state, key_len, offset, length
SEQ = struct.Struct("<Q")
STATS = struct.Struct("<QQQQ")  # writer state in the header: dirty, live_bytes, live_count, used_slots
STATS_AT = 512
SUPERSEDED_AT = 544  # u64, nonzero: this file has been (or is about to be) replaced at its path
STATE = struct.Struct("<I")
U64 = struct.Struct("<Q")
KEY_AT = ENTRY.size  # 48
ATIME_AT = 32
ENTRY_DTYPE = np.dtype({"names": ["seq", "state", "key_len", "offset", "length", "atime", "esum"],
                        "formats": ["<u8", "<u4", "<u4", "<u8", "<u8", "<u8", "<u8"],
                        "offsets": [0, 8, 12, 16, 24, 32, 40], "itemsize": ENTRY_BYTES})


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def extent_bytes(length: int) -> int:
    """Arena bytes an entry owns: at least one aligned unit, so that no two extents start at the same offset."""
    return align(max(length, 1))


def default_num_slots(capacity_bytes: int) -> int:
    """One slot per 64 KiB of budget, a power of two in [1024, 2**20]."""
    want = max(1024, min(1 << 20, capacity_bytes // (64 << 10)))
    return 1 << (want - 1).bit_length()


def entry_sum(seq: int, state: int, key_len: int, offset: int, length: int, key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(FIELDS.pack(seq, state, key_len, offset, length) + key)


class Geometry:
    def __init__(self, num_slots: int, capacity: int) -> None:
        self.num_slots = num_slots
        self.mask = num_slots - 1
        self.capacity = capacity
        self.index_offset = HEADER_BYTES
        self.ext_offset = HEADER_BYTES + num_slots * ENTRY_BYTES
        self.ext_len_offset = self.ext_offset + num_slots * 8
        self.data_offset = align(self.ext_len_offset + num_slots * 8, PAGE)
        self.data_bytes = align(capacity + capacity // 4 + num_slots * ALIGN, PAGE)
        self.file_bytes = self.data_offset + self.data_bytes
        self.max_used = max(1, int(num_slots * MAX_LOAD))

    def header(self) -> bytes:
        head = HEADER.pack(MAGIC, VERSION, HEADER_BYTES, self.num_slots, ENTRY_BYTES, ALIGN, self.data_offset,
                            self.data_bytes, self.capacity)
        return head + SUM.pack(xxhash.xxh3_64_intdigest(head))

    @classmethod
    def parse(cls, buf: bytes | mmap.mmap, file_bytes: int) -> Geometry | str:
        """The pool's geometry, or why its header is unusable."""
        if file_bytes < HEADER_BYTES:
            return f"file is {file_bytes} bytes, shorter than the header"
        head = bytes(buf[:HEADER.size])
        (stored_sum,) = SUM.unpack_from(buf, HEADER.size)
        magic, version, header_bytes, num_slots, entry_bytes, align, data_offset, data_bytes, capacity = \
            HEADER.unpack(head)
        if magic != MAGIC:
            return f"bad magic {magic!r}"
        if version != VERSION:
            return f"unsupported version {version}"
        if xxhash.xxh3_64_intdigest(head) != stored_sum:
            return "header checksum mismatch"
        if (header_bytes != HEADER_BYTES or entry_bytes != ENTRY_BYTES or align != ALIGN or num_slots <= 0
                or num_slots & (num_slots - 1) or capacity <= 0):
            return "implausible geometry"
        geo = cls(num_slots, capacity)
        if (geo.data_offset, geo.data_bytes) != (data_offset, data_bytes):
            return "inconsistent geometry"
        if file_bytes != geo.file_bytes:
            return f"file is {file_bytes} bytes, header says {geo.file_bytes}"
        return geo
