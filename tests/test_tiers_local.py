"""The tier contract on the cpu and disk tiers, disk-specific behaviour, the tier factory and the stack."""
from __future__ import annotations

import os
import threading
import typing

import pytest

from kvfabric.config import Config, ConfigError, DiskTierConfig, EvictionName
from kvfabric.host.pages import Scratch
from kvfabric.tiers.cpu import CpuTier
from kvfabric.tiers.disk import DiskTier
from kvfabric.tiers.factory import build_tiers, codec_spec
from kvfabric.tiers.policies import NO_META
from kvfabric.tiers.stack import TierStack
from tests.tier_contract import BLOB_BYTES, TierContract, key, make_blob

EVICTIONS = typing.get_args(EvictionName)


class PolicyContract(TierContract):
    """The tier contract once per eviction policy (the policy-driven tiers take any of them)."""

    @pytest.fixture(autouse=True, params=EVICTIONS)
    def _eviction(self, request):
        self.eviction = request.param
        self.evicts_lru = request.param == "lru"


class TestCpuTier(PolicyContract):
    declared = dict(is_trusted=True, is_read_only=False, is_persistent=False, is_shared=False, honors_capacity=True,
                    honors_pins=True, is_zero_copy=False)

    def make_tier(self, capacity_bytes):
        return CpuTier(capacity_bytes, eviction=self.eviction)

    def reopen(self, tier):
        return CpuTier(tier.capacity_bytes, eviction=self.eviction)


class TestDiskTier(PolicyContract):
    declared = dict(is_trusted=False, is_read_only=False, is_persistent=True, is_shared=True, honors_capacity=True,
                    honors_pins=True, is_zero_copy=False)

    @pytest.fixture(autouse=True)
    def _dir(self, tmp_path):
        self.root = tmp_path / "chunks"

    def make_tier(self, capacity_bytes):
        return DiskTier(self.root, capacity_bytes, eviction=self.eviction)

    def reopen(self, tier):
        return DiskTier(self.root, tier.capacity_bytes, eviction=self.eviction)


def test_disk_rebuild_keeps_lru_order(tmp_path):
    tier = DiskTier(tmp_path, BLOB_BYTES * 10)
    for i in range(3):
        tier.put(key(i), make_blob(key(i)))
        os.utime(tier.path(key(i)), (1000 + i, 1000 + i))
    os.utime(tier.path(key(0)), (2000, 2000))  # 0 was read last
    again = DiskTier(tmp_path, BLOB_BYTES * 2)  # smaller budget: the oldest (1) goes at start
    assert again.contains_many([key(0), key(1), key(2)]) == [True, False, True]


def test_disk_sees_chunks_written_by_another_instance(tmp_path):
    reader = DiskTier(tmp_path, BLOB_BYTES * 10)
    writer = DiskTier(tmp_path, BLOB_BYTES * 10)
    writer.put(key(3), make_blob(key(3)))
    assert reader.contains_many([key(3)]) == [True]
    assert bytes(reader.get(key(3))) == make_blob(key(3))


def test_disk_leaves_no_temp_files(tmp_path):
    tier = DiskTier(tmp_path, BLOB_BYTES * 10)
    tier.put(key(1), make_blob(key(1)))
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_disk_chunk_is_a_counted_miss_and_removed(tmp_path, damage):
    disk = DiskTier(tmp_path, BLOB_BYTES * 10)
    stack = TierStack([disk])
    stack.put(key(1), make_blob(key(1)))
    stack.flush()
    path = disk.path(key(1))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[:-10]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert stack.get(key(1)) is None
    assert stack.counters["corrupt.disk"] == 1
    assert not path.exists()
    stack.close()


def test_stack_promotes_and_reads_pending_writes(tmp_path):
    cpu, disk = CpuTier(BLOB_BYTES * 10), DiskTier(tmp_path, BLOB_BYTES * 10)
    stack = TierStack([cpu, disk])
    stack.put(key(1), make_blob(key(1)))
    assert stack.prefix_length([key(1), key(2)]) == 1  # visible before the disk write lands
    stack.flush()
    cpu.clear()
    found = stack.get(key(1))
    assert found is not None and found.tier == "disk"
    assert cpu.contains_many([key(1)]) == [True]  # promoted
    assert stack.get(key(1)).tier == "cpu"
    stack.close()


def test_stack_falls_back_to_next_tier_when_one_copy_is_damaged(tmp_path):
    disk_a, disk_b = DiskTier(tmp_path / "a", BLOB_BYTES * 10), DiskTier(tmp_path / "b", BLOB_BYTES * 10)
    stack = TierStack([disk_a, disk_b])
    stack.put(key(1), make_blob(key(1)))
    stack.flush()
    disk_a.path(key(1)).write_bytes(b"garbage")
    found = stack.get(key(1))
    assert found is not None and found.tier == "disk" and bytes(found.blob) == make_blob(key(1))
    assert stack.counters["corrupt.disk"] == 1
    stack.close()


def test_stack_get_many_reads_pending_writes_and_falls_back_past_damage(tmp_path):
    """get_many: a queued write is served from the queue; a damaged copy is deleted and counted, the next tier's
    copy served; nothing is promoted (every tier reads into the caller's scratch)."""
    cpu, disk_a, disk_b = CpuTier(BLOB_BYTES * 10), DiskTier(tmp_path / "a", BLOB_BYTES * 10), \
        DiskTier(tmp_path / "b", BLOB_BYTES * 10)
    stack = TierStack([cpu, disk_a, disk_b])
    for i in (1, 2):
        stack.put(key(i), make_blob(key(i), seed=i))
    stack.flush()
    cpu.clear()
    disk_a.path(key(2)).write_bytes(b"garbage")
    release = threading.Event()
    blocked = DiskTier(tmp_path / "c", BLOB_BYTES * 10)
    slow = TierStack([blocked])
    original = blocked.put
    blocked.put = lambda k, b: release.wait(10) and original(k, b)  # the writer holds the first queued write
    slow.put(key(7), make_blob(key(7), seed=7))
    slow.put(key(8), make_blob(key(8), seed=8))
    try:
        got = slow.get_many([key(8), key(9)], [Scratch(), Scratch()])
        assert got[0] is not None and got[0].tier == "pending" and bytes(got[0].blob) == make_blob(key(8), seed=8)
        assert got[1] is None
    finally:
        release.set()
        slow.close()
    found = stack.get_many([key(1), key(2), key(3)], [Scratch() for _ in range(3)])
    assert [f.tier if f else None for f in found] == ["disk", "disk", None]
    assert [f.level for f in found[:2]] == [1, 2]  # key 2's copy in disk a was damaged: disk b's served
    assert bytes(found[1].blob) == make_blob(key(2), seed=2) and stack.counters["corrupt.disk"] == 1
    assert not disk_a.contains_many([key(2)])[0] and cpu.contains_many([key(1), key(2)]) == [False, False]
    stack.close()


def test_full_write_queue_drops_and_counts(tmp_path):
    release = threading.Event()

    class BlockedTier(DiskTier):
        def put(self, k, blob, meta=NO_META):
            release.wait(30)  # the writer thread is stuck until the test lets it go
            return super().put(k, blob, meta)

    stack = TierStack([CpuTier(BLOB_BYTES * 100), BlockedTier(tmp_path, BLOB_BYTES * 100)], write_queue_size=2)
    for i in range(10):  # at most 1 write in progress + 2 queued: the other 7 are dropped
        stack.put(key(i), make_blob(key(i)))
    release.set()
    stack.flush()
    assert stack.counters["dropped_writes"] >= 7
    assert stack.prefix_length([key(i) for i in range(10)]) == 10  # the cpu tier still has everything
    stack.close()


def test_delete_cancels_queued_writes_and_waits_only_for_the_one_in_progress(tmp_path):
    """A delete must not wait for the whole write-behind queue (under load other threads keep it full)."""
    started, release = threading.Event(), threading.Event()

    class BlockedTier(DiskTier):
        def put(self, k, blob, meta=NO_META):
            started.set()
            release.wait(30)  # the writer thread is stuck on the first write until the test lets it go
            return super().put(k, blob, meta)

    disk = BlockedTier(tmp_path, BLOB_BYTES * 100)
    stack = TierStack([CpuTier(BLOB_BYTES * 100), disk], write_queue_size=8)
    for i in range(5):  # key 0 in progress (blocked), 1..4 queued
        stack.put(key(i), make_blob(key(i)))
    assert started.wait(10)
    assert sorted(stack.delete([key(2), key(3), key(9)])) == [key(2), key(3)]  # returns while the writer is stuck
    assert stack.prefix_length([key(2)]) == 0 and stack.get(key(3)) is None
    stack.put(key(3), make_blob(key(3)))  # stored again after the delete: this write must land
    deleting = threading.Thread(target=stack.delete, args=([key(0)],))
    deleting.start()  # key 0 is being written: the delete waits for that write, then removes it
    deleting.join(0.2)
    assert deleting.is_alive()
    release.set()
    deleting.join(10)
    assert not deleting.is_alive()
    stack.flush()
    assert disk.contains_many([key(i) for i in range(5)]) == [False, True, False, True, True]
    assert stack.prefix_length([key(0)]) == 0
    stack.close()


def test_factory_builds_local_tiers_in_order_with_their_codecs(tmp_path):
    config = Config(tiers=("disk", "cpu"), disk=DiskTierConfig(path=str(tmp_path), codec="int8"))
    tiers = build_tiers(config)
    assert [type(t) for t in tiers] == [DiskTier, CpuTier] and tiers[0].root == tmp_path
    assert [t.name for t in build_tiers(config, ["cpu"])] == ["cpu"]
    assert codec_spec(config, "disk") == "int8" and codec_spec(config, "cpu") == "" and codec_spec(config, "peer") == ""
    with pytest.raises(ConfigError, match="not a local tier"):
        build_tiers(config, ["cpu", "peer"])  # the engine composes the peer tier with a cluster node
