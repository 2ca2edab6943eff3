"""Placement in the TierStack (tiers/placement.py): write-through vs exclusive with demote-on-evict, promotion on
the k-th slow read (moved, not copied, when exclusive), refusals placed one tier down, which tiers each kind of
write reaches (shm cannot demote, so it is written through), and the cap on concurrent slow-tier loads."""
from __future__ import annotations

import threading
import uuid

import pytest

from kvfabric.config import Config, ConfigError, PlacementConfig
from kvfabric.tiers.cpu import CpuTier
from kvfabric.tiers.disk import DiskTier
from kvfabric.tiers.placement import Levels, PromotionCounter, SlowReads
from kvfabric.tiers.policies import NO_META, AccessMeta
from kvfabric.tiers.stack import TierStack
from tests.tier_contract import BLOB_BYTES, key, make_blob

EXCLUSIVE = PlacementConfig(mode="exclusive")


def stack_of(tmp_path, placement: PlacementConfig, cpu_chunks: int = 2, **cpu_policy) -> TierStack:
    return TierStack([CpuTier(cpu_chunks * BLOB_BYTES, **cpu_policy), DiskTier(tmp_path, 100 * BLOB_BYTES)],
                     placement=placement)


def held(stack: TierStack, i: int) -> list[bool]:
    return [tier.contains_many([key(i)])[0] for tier in stack.tiers]


def test_write_through_writes_every_tier(tmp_path):
    stack = stack_of(tmp_path, PlacementConfig())
    for i in range(3):
        stack.put(key(i), make_blob(key(i)))
    stack.flush()
    assert [held(stack, i) for i in range(3)] == [[False, True], [True, True], [True, True]]
    assert stack.counters["demoted.disk"] == 0
    stack.close()


def test_exclusive_demotes_victims_and_moves_promoted_chunks_up(tmp_path):
    stack = stack_of(tmp_path, EXCLUSIVE)
    for i in range(3):
        stack.put(key(i), make_blob(key(i)))
    stack.flush()
    # Only the first tier was written; its LRU victim (0) went down unchanged, with its bytes counted.
    assert [held(stack, i) for i in range(3)] == [[False, True], [True, False], [True, False]]
    assert stack.counters["demoted.disk"] == 1 and stack.counters["bytes_demoted.disk"] == BLOB_BYTES
    assert bytes(stack.tiers[1].get(key(0))) == make_blob(key(0))
    found = stack.get(key(0))  # served by disk, moved up: disk lets it go, cpu's victim (1) goes down
    stack.flush()
    assert found.tier == "disk" and bytes(found.blob) == make_blob(key(0))
    assert held(stack, 0) == [True, False] and held(stack, 1) == [False, True]
    assert stack.counters["promoted.cpu"] == 1 and stack.counters["bytes_promoted.cpu"] == BLOB_BYTES
    assert stack.get(key(0)).tier == "cpu"
    stack.close()


def test_promotion_on_the_kth_slow_read(tmp_path):
    stack = stack_of(tmp_path, PlacementConfig(mode="exclusive", promote_after=2), cpu_chunks=4)
    stack.tiers[1].put(key(7), make_blob(key(7)))
    assert stack.get(key(7)).tier == "disk" and held(stack, 7) == [False, True]  # first read: stays
    assert stack.get(key(7)).tier == "disk" and held(stack, 7) == [True, False]  # second: moves up
    stack.close()


def test_exclusive_places_a_refused_chunk_one_tier_down(tmp_path):
    stack = stack_of(tmp_path, EXCLUSIVE, cpu_chunks=4, admission="second")
    stack.put(key(1), make_blob(key(1)), meta=AccessMeta(0, 1, 16, 0.01))
    stack.flush()
    assert held(stack, 1) == [False, True]  # cpu's admission turned it away: it still lands on disk
    stack.close()


def test_levels_write_through_tiers_that_cannot_demote(tmp_path):
    from kvfabric.tiers.shm import ShmTier

    name = f"test-{uuid.uuid4().hex[:8]}"
    shm = ShmTier(name, 1 << 20)
    try:
        tiers = [CpuTier(1 << 20), shm, DiskTier(tmp_path, 1 << 20)]
        levels = Levels(tiers, "exclusive")
        assert levels.store == (0,) and levels.demote_to(0) == (1, 2) and levels.demote_to(1) is None
        assert levels.promote_to(2) == (0,) and levels.demote_to(2) is None
        through = Levels(tiers, "write-through")
        assert through.store == (0, 1, 2) and through.promote_to(2) == (0, 1) and through.demote_to(0) is None
        with pytest.raises(ValueError, match="write-through or exclusive"):
            Levels(tiers, "write-back")
    finally:
        shm.close()
        ShmTier.destroy(name)


def test_promotion_counter_forgets_the_oldest():
    counter = PromotionCounter(3, max_keys=2)
    assert [counter.is_due(b"a") for _ in range(3)] == [False, False, True]
    counter.is_due(b"b"), counter.is_due(b"c"), counter.is_due(b"d")  # "b" is dropped from the counts
    assert [counter.is_due(b"b") for _ in range(3)] == [False, False, True]


def test_slow_reads_are_capped_per_load(tmp_path):
    entered, release = threading.Event(), threading.Event()

    class SlowDisk(DiskTier):
        def get(self, k, meta=NO_META):
            entered.set()
            release.wait(30)  # a load in progress, holding its slot
            return super().get(k, meta)

    cpu = CpuTier(10 * BLOB_BYTES)
    disk = SlowDisk(tmp_path, 100 * BLOB_BYTES)
    for i in range(3):
        disk.put(key(i), make_blob(key(i)))
    stack = TierStack([cpu, disk], placement=PlacementConfig(max_slow_reads=1, promote_after=99))
    results = {}

    def first_load() -> None:
        with stack.load_permit() as permit:  # one load, two chunks: one slot for both
            results["first"] = [stack.get(key(i), permit=permit) for i in (0, 1)]

    thread = threading.Thread(target=first_load)
    thread.start()
    assert entered.wait(30)
    assert stack.get(key(2)) is None  # a second load finds no slot: a miss (recompute), not a wait
    assert stack.counters["slow_read_refused"] == 1
    release.set()
    thread.join(30)
    assert [hit.tier for hit in results["first"]] == ["disk", "disk"]  # the admitted load was not starved
    assert stack.get(key(2)).tier == "disk"  # its slot is free again
    stack.close()


def test_slow_reads_validate():
    with pytest.raises(ValueError):
        SlowReads(-1)
    assert SlowReads(0).permit().allows()


def test_placement_config_is_checked():
    config = Config.from_dict({"placement": {"mode": "exclusive", "promote_after": 2, "max_slow_reads": 4},
                               "cpu": {"eviction": "s3fifo", "admission": "second"}, "disk": {"eviction": "arc"}})
    assert config.placement == PlacementConfig("exclusive", 2, 4, 0.0)
    assert (config.cpu.eviction, config.cpu.admission, config.disk.eviction) == ("s3fifo", "second", "arc")
    for bad, message in [({"placement": {"mode": "write-back"}}, "placement.mode"),
                         ({"placement": {"promote_after": 0}}, "promote_after"),
                         ({"placement": {"max_slow_reads": -1}}, "max_slow_reads"),
                         ({"cpu": {"eviction": "mru"}}, "cpu.eviction"),
                         ({"disk": {"admission": "never"}}, "disk.admission")]:
        with pytest.raises(ConfigError, match=message):
            Config.from_dict(bad)
    env = Config.load(environ={"KVFABRIC_PLACEMENT__MODE": "exclusive", "KVFABRIC_CPU__EVICTION": "heat"})
    assert env.placement.mode == "exclusive" and env.cpu.eviction == "heat"


def test_engine_tells_the_policies_each_chunks_position_and_cost():
    import torch

    from kvfabric.cache.engine import CacheEngine
    from kvfabric.tiers.policies import LRU
    from tests.tier_contract import LAYOUT

    class Recording(LRU):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, AccessMeta]] = []

        def admit(self, k, size, meta):
            self.seen.append(("admit", meta))
            super().admit(k, size, meta)

        def touch(self, k, meta):
            self.seen.append(("touch", meta))
            super().touch(k, meta)

    policy = Recording()
    cpu = CpuTier(1 << 24, eviction=policy)
    tokens = list(range(48))
    with CacheEngine(Config(chunk_size=16, tiers=("cpu",)), LAYOUT, "m", tiers=[cpu]) as engine:
        engine.store(tokens, torch.randn(LAYOUT.shape(48)))
        engine.retrieve(tokens)
    assert [(op, m.position, m.num_chunks, m.num_tokens) for op, m in policy.seen] == \
        [(op, i, 3, 16) for op in ("admit", "touch") for i in range(3)]
    costs = [m.miss_cost_s for _, m in policy.seen[:3]]
    assert 0 < costs[0] < costs[1] < costs[2]  # a later chunk is recomputed after a longer context


def test_exclusive_writes_process_memory_down_at_close(tmp_path):
    stack = stack_of(tmp_path, EXCLUSIVE, cpu_chunks=4)
    for i in range(3):
        stack.put(key(i), make_blob(key(i)))
    stack.flush()
    assert [held(stack, i) for i in range(3)] == [[True, False]] * 3
    stack.close()
    again = DiskTier(tmp_path, 100 * BLOB_BYTES)  # a restart over the same directory
    assert [bytes(again.get(key(i))) for i in range(3)] == [make_blob(key(i)) for i in range(3)]
