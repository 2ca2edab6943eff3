"""BlobPool and the cpu tier's recycled buffers: a buffer is reused only once nothing references it (a reader's
view, a tensor over it, a queued write to a slower tier), within the tier's capacity, payload-aligned; and the
unsealed blobs of process memory are sealed before they leave it (disk, peers)."""
from __future__ import annotations

import threading

import numpy as np
import torch

from kvfabric.codec.format import HEADER_BYTES, parse
from kvfabric.codec.raw import RawCodec
from kvfabric.tiers.cpu import CpuTier
from kvfabric.tiers.disk import DiskTier
from kvfabric.tiers.policies import NO_META
from kvfabric.tiers.pool import ALIGN, BlobPool
from kvfabric.tiers.stack import TierStack
from tests.tier_contract import BLOB_BYTES, LAYOUT, key, make_blob


def address(blob: memoryview) -> int:
    return np.frombuffer(blob, np.uint8).ctypes.data


def test_payload_is_aligned_and_buffers_are_recycled_once_unreferenced():
    pool = BlobPool(lambda: 10 * BLOB_BYTES, align_offset=HEADER_BYTES)
    blob = pool.take(BLOB_BYTES)
    assert len(blob) == BLOB_BYTES and (address(blob) + HEADER_BYTES) % ALIGN == 0
    first = address(blob)
    reader = torch.frombuffer(blob, dtype=torch.uint8)  # e.g. a zero-copy view handed to a caller
    pool.give(blob)
    del blob
    other = pool.take(BLOB_BYTES)
    assert address(other) != first and pool.num_reused == 0  # still referenced by `reader`: not reused
    del reader
    again = pool.take(BLOB_BYTES)
    assert address(again) == first and pool.num_reused == 1
    assert pool.take(BLOB_BYTES // 2) is not None and pool.num_fresh == 3  # no buffer of that size: fresh


def test_free_buffers_stay_within_the_budget():
    budget = [2 * (BLOB_BYTES + ALIGN)]
    pool = BlobPool(lambda: budget[0])
    blobs = [pool.take(BLOB_BYTES) for _ in range(4)]
    for blob in blobs:
        pool.give(blob)
    del blobs, blob
    assert pool.num_free_bytes <= budget[0]
    budget[0] = 0
    for size in (10, 20, 30):
        pool.give(pool.take(size))
    assert pool.num_free_bytes == 50  # over budget, the two most recent are kept
    pool.give(memoryview(bytearray(10)))  # not the pool's kind of buffer: ignored
    pool.give(b"x")
    assert pool.num_free_bytes == 50


def test_a_buffer_the_pool_did_not_make_is_never_adopted():
    pool, other = BlobPool(lambda: 1 << 30), BlobPool(lambda: 1 << 30)
    foreign = [memoryview(np.empty(64, np.uint8)), other.take(64)]  # a scratch's array, another pool's buffer
    for blob in foreign:
        pool.give(blob)
    assert pool.num_free_bytes == 0
    own = pool.take(64)
    pool.give(own)
    assert pool.num_free_bytes == 64


def test_a_reader_holding_a_dropped_chunk_keeps_its_bytes():
    tier = CpuTier(4 * BLOB_BYTES)
    blob = tier.new_blob(BLOB_BYTES)
    blob[:] = make_blob(key(1), seed=1)
    tier.put(key(1), blob)
    held = tier.get(key(1))
    snapshot = bytes(held)
    del blob
    tier.delete(key(1))
    for i in range(2, 12):  # fill and churn the tier: every new blob asks the pool for a buffer
        fresh = tier.new_blob(BLOB_BYTES)
        fresh[:] = make_blob(key(i), seed=i)
        tier.put(key(i), fresh)
    assert bytes(held) == snapshot and tier.get(key(1)) is None
    assert tier.pool.num_reused > 0  # chunks nobody held were recycled meanwhile


def test_a_queued_write_keeps_its_buffer_and_lands_sealed(tmp_path):
    release = threading.Event()

    class SlowDisk(DiskTier):
        def put(self, k, blob, meta=NO_META):
            release.wait(30)
            return super().put(k, blob, meta)

    cpu, disk = CpuTier(2 * BLOB_BYTES), SlowDisk(tmp_path, 100 * BLOB_BYTES)
    stack = TierStack([cpu, disk], write_queue_size=64)
    codec = RawCodec()
    kvs = {i: torch.randn(LAYOUT.shape(16), generator=torch.Generator().manual_seed(i)) for i in range(8)}
    for i, kv in kvs.items():  # each store evicts an older chunk from cpu while its disk write waits
        blob = codec.encode(kv.half(), key(i), LAYOUT, out=stack.new_blob(BLOB_BYTES), with_checksums=False)
        stack.put(key(i), blob)
    release.set()
    stack.flush()
    for i, kv in kvs.items():
        data = disk.path(key(i)).read_bytes()
        header = parse(data, key(i))  # both checksums verified: sealed, and its buffer was not reused early
        out = torch.empty(header.shape, dtype=torch.float16)
        codec.decode(header, memoryview(data), LAYOUT, out)
        assert torch.equal(out, kv.half())
    stack.close()


def test_unsealed_blob_is_served_in_process_and_sealed_for_peers():
    from kvfabric.cluster.p2p_server import PeerServer

    cpu = CpuTier(4 * BLOB_BYTES)
    blob = RawCodec().encode(torch.randn(LAYOUT.shape(16)).half(), key(1), LAYOUT, out=cpu.new_blob(BLOB_BYTES),
                             with_checksums=False)
    cpu.put(key(1), blob)
    stack = TierStack([cpu])
    assert stack.get(key(1)).tier == "cpu"  # trusted: no checksum read
    assert bytes(blob[HEADER_BYTES - 16:HEADER_BYTES]) == bytes(16)  # still unsealed
    sent = PeerServer._read([cpu], key(1))  # what a peer would receive
    parse(sent, key(1))
    stack.close()


def test_premap_maps_buffers_of_the_largest_size_ahead_within_the_budget():
    budget = [10 * (BLOB_BYTES + ALIGN)]
    pool = BlobPool(lambda: budget[0], premap_bytes=4 * BLOB_BYTES)
    first = pool.take(BLOB_BYTES)  # a fresh buffer: no size expected yet, nothing is mapped ahead
    assert pool.wait_premapped(5) and pool.num_premapped == 0
    pool.expect(BLOB_BYTES)
    assert pool.wait_premapped(30)
    assert pool.num_premapped == 4 and pool.num_free_bytes == 4 * BLOB_BYTES
    blobs = [pool.take(BLOB_BYTES) for _ in range(4)]
    assert pool.num_fresh == 1 and pool.num_reused == 4  # all four came mapped ahead
    assert all((address(b) + 0) % ALIGN == 0 for b in blobs)
    small = pool.take(BLOB_BYTES // 2)  # not the expected size: not mapped ahead
    pool.expect(BLOB_BYTES // 2)  # smaller than the size expected before: ignored
    assert pool.wait_premapped(30) and not pool._free.get(BLOB_BYTES // 2)
    num_premapped = pool.num_premapped
    budget[0] = BLOB_BYTES  # the tier filled up: nothing more is mapped ahead while the free ones exceed it
    again = pool.take(BLOB_BYTES)
    assert pool.wait_premapped(30) and pool.num_premapped == num_premapped and pool.num_reused == 5
    del first, blobs, small, again
    pool.close()
    assert not pool._premapper.is_alive() and pool.num_free_bytes == 0


def test_cpu_tier_close_stops_its_premap_thread():
    tier = CpuTier(8 * BLOB_BYTES, premap_bytes=2 * BLOB_BYTES)
    tier.premap(BLOB_BYTES)
    blob = tier.new_blob(BLOB_BYTES)
    blob[:] = make_blob(key(1), seed=1)
    assert tier.put(key(1), blob)
    assert tier.pool.wait_premapped(30) and tier.pool.num_premapped == 2
    tier.close()
    assert not tier.pool._premapper.is_alive()


def test_a_paused_pool_maps_nothing_until_resumed():
    pool = BlobPool(lambda: 10 * BLOB_BYTES, premap_bytes=2 * BLOB_BYTES)
    pool.pause(True)
    pool.expect(BLOB_BYTES)
    assert not pool.wait_premapped(0.3) and pool.num_premapped == 0
    pool.pause(False)
    assert pool.wait_premapped(30) and pool.num_premapped == 2
    pool.close()


def test_the_disk_tier_reuses_a_written_buffer_and_its_file_keeps_the_bytes(tmp_path):
    tier = DiskTier(tmp_path, 16 * BLOB_BYTES)
    blob = tier.new_blob(BLOB_BYTES)
    blob[:] = make_blob(key(1), seed=1)
    first = address(blob)
    held = tier.new_blob(BLOB_BYTES)  # a buffer still held is never handed out twice
    assert address(held) != first
    assert tier.put(key(1), blob)
    del blob
    again = tier.new_blob(BLOB_BYTES)  # written and let go of: its memory comes back, no fresh pages
    assert address(again) == first
    again[:] = make_blob(key(2), seed=2)
    assert bytes(tier.get(key(1))) == make_blob(key(1), seed=1)
    tier.close()
