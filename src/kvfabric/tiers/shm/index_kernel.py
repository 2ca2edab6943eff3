"""The compiled half of index.py on coherent memory, one call per step of the publish protocol (package docstring),
without the GIL: a put's `reserve` (W1, W2, a free extent and a slot) and `publish` (W4-W7); a read's `find` (R1)
and `recheck` (R3, with the LRU touch).

Why compiled: in Python the index work of a put (struct calls per field, a probe loop, the stats list) or a read
cost as much as a fifth of the memcpy of a 5.9 MB chunk, and it runs right after a copy that evicted the
interpreter's working set from the caches (docs/design/measurements.md). Here it is a few loads and stores.

The steps are those of index.py's methods, in the same order; a `fence()` stands where the Python path flushes,
fences or invalidates, so that neither the compiler nor the CPU moves a publishing store ahead of the stores it
publishes, or a reader's loads out of its seqlock. Only for coherent memory: a pool that needs cache maintenance
takes the Python path, which calls it. Entry checksums (xxh3) stay in Python: the caller computes the one
`publish` stores and checks the one `find` returns.

Views: `w64`, `w32`, `w8` are the mapping's bytes [0, data_offset) as uint64 / uint32 / uint8 (index.py's
`Index.words`); an entry at byte `b` = index_offset + 128 * slot has seq at w64[b // 8], state at w32[b // 4 + 2],
key_len at w32[b // 4 + 3], offset, length, atime, esum at w64[b // 8 + 2 .. 5], the key at w8[b + 48:].
A `key` is the caller's `bytes` as it is (numba reads bytes; a numpy view of it would cost more than the probe).
Imported on the first put, never when kvfabric is imported (see codec/stream_kernel.py for why).
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba import types as nbt
from numba.extending import intrinsic

from kvfabric.tiers.shm.fit import first_fit

EMPTY, READY, TOMBSTONE = 0, 1, 2  # layout.py's states (numba reads module globals as constants)
ENTRY_BYTES, KEY_AT, STATS_WORD = 128, 48, 512 // 8
MAX_KEY_BYTES = 64
SEQ_SPINS = 50  # index.py's: reads of a busy entry before it is skipped

OK, NEEDS_ROOM, DIRTY, NO_SLOT = 0, 1, 2, 3  # reserve's status


@intrinsic
def _fence(typingctx):  # noqa: ANN001, ANN202
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        builder.fence("seq_cst")  # no load or store moves across it: the compiler's order and the CPU's
        return context.get_dummy_value()
    return nbt.void(), codegen


@njit(nogil=True, inline="always")
def fence():  # noqa: ANN202
    _fence()


@njit(nogil=True, inline="always")
def _key_is(w32, w8, b, key):  # noqa: ANN001, ANN202
    """index.py's key_at(slot) == key: the stored key, cut at MAX_KEY_BYTES, equals `key`."""
    if min(w32[b // 4 + 3], MAX_KEY_BYTES) != len(key):
        return False
    for i in range(len(key)):
        if w8[b + KEY_AT + i] != key[i]:
            return False
    return True


@njit(nogil=True, cache=True)
def reserve(w64, w32, w8, key, start, size, need, num_slots, index_offset, ext_offset, ext_len_offset, data_bytes,  # noqa: ANN001, ANN201, PLR0913
            capacity, max_used, starts, stops):
    """W1 (the header's dirty flag set), W2 (every READY entry for `key` retired, as index.remove_key), then a
    free extent of `need` bytes (fit.first_fit) and a slot for the key (index.insert_slot). Returns (status,
    slot, offset, seq): OK with the slot, extent offset and the seq its entry will be published with; NEEDS_ROOM
    when entries must be evicted first (W1, W2 done: the caller goes on in Python with the dirty flag set);
    DIRTY when a dead writer left the flag set (nothing done: Python repairs); NO_SLOT when no slot is free."""
    if w64[STATS_WORD] != 0:
        return DIRTY, -1, -1, 0
    w64[STATS_WORD] = 1
    fence()
    # int64 throughout: numba turns mixed uint64 / int64 arithmetic into float64
    live_bytes, live_count = np.int64(w64[STATS_WORD + 1]), np.int64(w64[STATS_WORD + 2])
    used = np.int64(w64[STATS_WORD + 3])
    mask = num_slots - 1
    for i in range(num_slots):  # W2
        slot = (start + i) & mask
        b = index_offset + slot * ENTRY_BYTES
        state = w32[b // 4 + 2]
        if state == EMPTY:
            break
        if state != READY or not _key_is(w32, w8, b, key):
            continue
        after = index_offset + ((slot + 1) & mask) * ENTRY_BYTES
        new = EMPTY if w32[after // 4 + 2] == EMPTY else TOMBSTONE
        seq = np.int64(w64[b // 8]) | 1
        w64[b // 8] = seq  # busy
        fence()
        w32[b // 4 + 2] = new
        fence()
        w64[b // 8] = seq + 1
        fence()
        live_bytes -= np.int64(w64[b // 8 + 3])
        live_count -= 1
        if new == EMPTY:
            used -= 1
        w64[ext_len_offset // 8 + slot] = 0
    w64[STATS_WORD + 1], w64[STATS_WORD + 2], w64[STATS_WORD + 3] = live_bytes, live_count, used
    fence()
    if used + 1 > max_used or live_bytes + size > capacity:
        return NEEDS_ROOM, -1, -1, 0
    n = num_slots
    at = first_fit(w64[ext_offset // 8:ext_offset // 8 + n], w64[ext_len_offset // 8:ext_len_offset // 8 + n],
                   live_count, need, data_bytes, starts, stops)
    if at < 0:
        return NEEDS_ROOM, -1, -1, 0
    for i in range(num_slots):
        slot = (start + i) & mask
        b = index_offset + slot * ENTRY_BYTES
        if w32[b // 4 + 2] != READY:
            return OK, slot, at, (np.int64(w64[b // 8]) | 1) + 1
    return NO_SLOT, -1, -1, 0


@njit(nogil=True, cache=True)
def publish(w64, w32, w8, slot, key, offset, length, extent, atime, esum, index_offset, ext_offset,  # noqa: ANN001, ANN201, PLR0913
            ext_len_offset):
    """W4-W7 for a slot `reserve` returned, once the payload is in the arena: the entry made busy, its fields and
    checksum `esum` (computed over the seq reserve returned) written, the even seq that publishes it, the extent
    table and the totals, then the dirty flag cleared."""
    b = index_offset + slot * ENTRY_BYTES
    seq = np.int64(w64[b // 8]) | 1
    was_empty = w32[b // 4 + 2] == EMPTY
    w64[b // 8] = seq  # W4: busy
    fence()
    for i in range(len(key)):  # W5
        w8[b + KEY_AT + i] = key[i]
    w32[b // 4 + 2] = READY
    w32[b // 4 + 3] = len(key)
    w64[b // 8 + 2], w64[b // 8 + 3], w64[b // 8 + 4], w64[b // 8 + 5] = offset, length, atime, esum
    fence()
    w64[b // 8] = seq + 1  # W6: the publish flag
    fence()
    w64[ext_offset // 8 + slot] = offset
    w64[ext_len_offset // 8 + slot] = extent
    w64[STATS_WORD + 1] = np.int64(w64[STATS_WORD + 1]) + length
    w64[STATS_WORD + 2] = np.int64(w64[STATS_WORD + 2]) + 1
    if was_empty:
        w64[STATS_WORD + 3] = np.int64(w64[STATS_WORD + 3]) + 1
    fence()
    w64[STATS_WORD] = 0  # W7


@njit(nogil=True, cache=True)
def find(w64, w32, w8, key, start, num_slots, index_offset, data_bytes):  # noqa: ANN001, ANN201
    """R1: the READY entry for `key` as (slot, seq, offset, length, esum), read between two equal even seqs, or
    slot -1. An entry that stays odd (busy, or left by a dead writer) is skipped, not trusted; the caller checks
    esum (layout.entry_sum over seq, READY, len(key), offset, length, key)."""
    mask = num_slots - 1
    for i in range(num_slots):
        slot = (start + i) & mask
        b = index_offset + slot * ENTRY_BYTES
        for _ in range(SEQ_SPINS):
            seq = np.int64(w64[b // 8])
            fence()
            state, is_key = w32[b // 4 + 2], _key_is(w32, w8, b, key)
            offset, length, esum = np.int64(w64[b // 8 + 2]), np.int64(w64[b // 8 + 3]), w64[b // 8 + 5]
            fence()
            if seq & 1 == 0 and np.int64(w64[b // 8]) == seq:
                break
        else:
            continue  # busy: not provably ours, keep probing
        if state == EMPTY:
            break
        if state == READY and is_key:
            if offset < 0 or length < 0 or offset + length > data_bytes:
                return -2, seq, offset, length, esum  # damaged: the caller counts it
            return slot, seq, offset, length, esum
    return -1, 0, 0, 0, np.uint64(0)


@njit(nogil=True, cache=True)
def recheck(w64, slot, seq, atime, index_offset):  # noqa: ANN001, ANN201
    """R3: whether the entry still has the seq `find` saw (not retired or reused while the caller copied); if so,
    the LRU touch (atime; a lost race with a writer only reorders)."""
    b = index_offset + slot * ENTRY_BYTES
    fence()
    if np.int64(w64[b // 8]) != seq:
        return False
    w64[b // 8 + 4] = atime
    return True
