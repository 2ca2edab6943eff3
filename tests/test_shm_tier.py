"""ShmTier: a pool in /dev/shm shared by real processes; torn writes, SIGKILL, eviction, persistence, resets."""
from __future__ import annotations

import fcntl
import hashlib
import logging
import multiprocessing as mp
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, parse
from kvfabric.config import ShmTierConfig
from kvfabric.host.pages import Scratch
from kvfabric.tiers.shm import ShmPoolError, ShmTier, index_kernel
from kvfabric.tiers.shm.coherence import CacheOps
from kvfabric.tiers.shm.index import Index
from kvfabric.tiers.shm.layout import ENTRY_BYTES, KEY_AT, READY, SEQ, STATS, STATS_AT, extent_bytes
from kvfabric.tiers.stack import TierStack
from tests.redis_fixtures import make_blob
from tests.tier_contract import TierContract

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
FORK = mp.get_context("fork")  # a forked child is a real process, without re-importing torch (seconds)


def key_of(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


@pytest.fixture
def pool_name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    ShmTier.destroy(name)


def run_child(target, *args, timeout: float = 20.0) -> None:
    proc = FORK.Process(target=target, args=args, daemon=True)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        pytest.fail(f"child {target.__name__} hung")
    assert proc.exitcode == 0, f"child {target.__name__} failed with {proc.exitcode}"


def returns_within(fn: Callable[[], object], deadline_s: float = 10.0) -> object:
    """fn()'s result; fails the test if fn has not returned by a generous deadline (it must not block)."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), f"still blocked after {deadline_s} s"
    return result[0]


def entry_base(index: Index, slot: int) -> int:
    return index.geo.index_offset + slot * ENTRY_BYTES


# ---- children (run in forked processes; assertions fail the exit code) --------------------------------------
def _child_read_then_write(name: str, capacity: int) -> None:
    tier = ShmTier(name, capacity)
    got = tier.get(key_of(1))
    ok = got is not None and bytes(got) == bytes(make_blob(key_of(1), 100_000, seed=1))
    ok = ok and tier.put(key_of(2), make_blob(key_of(2), 50_000, seed=2))
    tier.close()
    os._exit(0 if ok else 1)


def _child_store_and_exit(name: str, capacity: int, count: int) -> None:
    tier = ShmTier(name, capacity)
    ok = all(tier.put(key_of(i), make_blob(key_of(i), 10_000, seed=i)) for i in range(count))
    os._exit(0 if ok else 1)  # no close(): the pool must not depend on a clean exit


def _child_hang_mid_data_write(name: str, capacity: int, key: bytes, size: int, ready) -> None:
    tier = ShmTier(name, capacity)

    def half_then_hang(index, offset, blob):
        start = index.geo.data_offset + offset
        half = len(blob) // 2
        index.mm[start:start + half] = blob[:half]  # a partial copy, as if the process died in memcpy
        ready.set()
        time.sleep(60)

    tier.arena.write = half_then_hang
    tier.put(key, make_blob(key, size, seed=99))
    os._exit(3)  # not reached


class PythonPath(CacheOps):
    """The plain no-op primitives, but not CacheOps itself: the pool takes index.py's Python writer path instead of
    index_kernel's compiled one."""


def _child_hang_mid_publish(name: str, capacity: int, key: bytes, ready, path: str) -> None:
    tier = ShmTier(name, capacity, ops=PythonPath() if path == "python" else None)

    index = tier.arena.current

    def torn_publish(slot, key, offset, length, atime):
        base = entry_base(index, slot)
        seq = SEQ.unpack_from(index.mm, base)[0] | 1
        SEQ.pack_into(index.mm, base, seq)  # seq odd: the entry is being written
        index.mm[base + KEY_AT:base + KEY_AT + len(key)] = key
        ready.set()
        time.sleep(60)

    if path == "python":
        index.publish = torn_publish
    else:  # the compiled publish, stopped at the same point (its own steps run without the GIL, in one call)
        index_kernel.publish = lambda w64, w32, w8, slot, key, offset, length, *rest: torn_publish(
            slot, key, offset, length, 0)
    tier.put(key, make_blob(key, 1000, seed=5))
    os._exit(3)


def _child_writer_loop(name: str, capacity: int, num_keys: int, size: int, seed0: int) -> None:
    tier = ShmTier(name, capacity)
    i = seed0
    while True:  # killed by the parent
        key = key_of(i % num_keys)
        tier.put(key, make_blob(key, size + (i % 7) * 4096, seed=i))
        i += 1


def _child_hold_lock(lock_path: str, ready) -> None:
    fd = os.open(lock_path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()
    time.sleep(60)


def assert_stats_consistent(tier: ShmTier) -> None:
    """The writers' running totals in the header match a recount of the index, and no two extents overlap."""
    index = tier.arena.current
    dirty, *stats = STATS.unpack_from(index.mm, STATS_AT)
    assert dirty == 0 and tuple(stats) == index.recount()
    entries = index.entries()
    ready = entries["state"] == READY
    extents = sorted(zip(entries["offset"][ready].tolist(), entries["length"][ready].tolist()))
    offsets, sizes = index.extents()  # the writers' compact copy agrees with the entries
    assert (sizes > 0).tolist() == ready.tolist()
    assert offsets[ready].tolist() == entries["offset"][ready].tolist()
    assert sizes[ready].tolist() == [extent_bytes(n) for n in entries["length"][ready].tolist()]
    del index, entries, ready, offsets, sizes
    for (start, length), (next_start, _) in zip(extents, extents[1:]):
        assert start + max(length, 1) <= next_start, "overlapping extents"


# ---- tests ---------------------------------------------------------------------------------------------
def test_round_trip_across_processes(pool_name: str) -> None:
    tier = ShmTier(pool_name, 4 << 20)
    assert tier.arena.path == Path("/dev/shm") / f"kvfabric-{pool_name}"
    blob = make_blob(key_of(1), 100_000, seed=1)
    assert tier.put(key_of(1), blob)
    run_child(_child_read_then_write, pool_name, 4 << 20)
    got = tier.get(key_of(2))
    assert got is not None and bytes(got) == bytes(make_blob(key_of(2), 50_000, seed=2))
    assert isinstance(got, bytes)  # a private copy, not a view into the arena
    assert sorted(tier.keys()) == sorted([key_of(1), key_of(2)])
    assert tier.contains_many([key_of(1), key_of(2), key_of(3)]) == [True, True, False]
    assert tier.usage().num_chunks == 2 and tier.usage().num_bytes == len(blob) + 50_000 + HEADER_BYTES
    tier.close()


def test_basic_protocol(pool_name: str) -> None:
    tier = ShmTier(pool_name, 1 << 20)
    assert tier.get(b"missing") is None and tier.contains_many([]) == []
    assert tier.put(b"k", b"bytes") and tier.put(b"k2", bytearray(b"bytearray"))
    assert tier.put(b"k3", memoryview(b"..memoryview")[2:])
    assert (tier.get(b"k"), tier.get(b"k2"), tier.get(b"k3")) == (b"bytes", b"bytearray", b"memoryview")
    assert tier.put(b"k", b"replaced") and tier.get(b"k") == b"replaced"
    assert tier.put(b"empty", b"") and tier.get(b"empty") == b""
    assert tier.delete(b"k") and not tier.delete(b"k") and tier.get(b"k") is None
    assert not tier.put(b"x" * 65, b"key too long") and not tier.put(b"big", b"x" * ((1 << 20) + 1))
    tier.clear()
    assert tier.keys() == [] and tier.usage().num_bytes == 0
    tier.close()
    assert tier.get(b"k2") is None and not tier.put(b"k", b"v")  # closed: misses, no errors


def test_lru_eviction_under_budget(pool_name: str) -> None:
    tier = ShmTier(pool_name, 10_000)
    for i in range(10):
        assert tier.put(key_of(i), bytes([i]) * 1000)
    assert tier.usage().num_bytes == 10_000
    assert tier.get(key_of(0)) == bytes([0]) * 1000  # 0 becomes the most recent
    assert tier.put(key_of(10), b"\x0a" * 1000)
    present = tier.contains_many([key_of(i) for i in range(11)])
    assert present == [True, False] + [True] * 9  # key 1 was the least recently used
    tier.pin([key_of(2)])
    assert tier.put(key_of(11), b"\x0b" * 2000)  # evicts 3 and 4, skipping the pinned 2
    assert tier.contains_many([key_of(i) for i in (2, 3, 4, 5)]) == [True, False, False, True]
    assert tier.usage().num_bytes <= 10_000
    tier.pin([key_of(i) for i in range(12)])
    assert not tier.put(key_of(12), b"x" * 5000)  # only pinned entries could make room
    assert tier.counters["put.no_room"] == 1
    tier.unpin([key_of(i) for i in range(12)])
    tier.unpin([key_of(2)])
    assert tier.put(key_of(12), b"x" * 5000)
    tier.close()


def test_many_small_entries_purge_tombstones(pool_name: str) -> None:
    tier = ShmTier(pool_name, 1 << 20, num_slots=64)  # the table, not the bytes, is the limit here
    for i in range(2000):
        assert tier.put(key_of(i), i.to_bytes(4, "little") * 8)
        if i % 3 == 2:
            tier.delete(key_of(i - 1))
    keys = tier.keys()
    assert 0 < len(keys) <= tier.arena.current.geo.max_used
    assert key_of(1999) in keys
    for key in keys:
        i = next(j for j in range(2000) if key_of(j) == key)
        assert tier.get(key) == i.to_bytes(4, "little") * 8
    assert tier.counters["purges"] > 0
    assert_stats_consistent(tier)
    tier.close()


def test_empty_blobs_do_not_share_space(pool_name: str) -> None:
    tier = ShmTier(pool_name, 8000, num_slots=16)
    for order in ([0, 1, 2], [2, 1, 0]):  # found by hypothesis: an empty extent sorted next to a real one
        tier.clear()
        for k in order:
            assert tier.put(bytes([k]), bytes([k]) * k)
        assert [tier.get(bytes([k])) for k in range(3)] == [b"", b"\x01", b"\x02\x02"]
        assert_stats_consistent(tier)
    tier.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "put", "get", "delete"]), st.integers(0, 15),
                              st.integers(0, 3000)), max_size=60))
def test_matches_a_model(pool_name: str, ops) -> None:
    tier = ShmTier(pool_name, 8000, num_slots=16)
    tier.clear()
    stored: dict[bytes, bytes] = {}
    for op, k, size in ops:
        key = k.to_bytes(2, "little")
        if op == "put":
            value = os.urandom(size)
            assert tier.put(key, value)
            stored[key] = value
            assert tier.get(key) == value  # the latest put always fits
        elif op == "get":
            got = tier.get(key)
            assert got is None or got == stored.get(key)
        else:
            tier.delete(key)
            stored.pop(key, None)
        assert tier.usage().num_bytes <= 8000
        assert set(tier.keys()) <= set(stored)
        assert_stats_consistent(tier)
    for key in tier.keys():
        assert tier.get(key) == stored[key]
    tier.close()


def test_sigkill_mid_data_write_leaves_no_torn_chunk(pool_name: str) -> None:
    capacity = 16 << 20
    tier = ShmTier(pool_name, capacity)
    old = make_blob(key_of(1), 4_000_000, seed=1)
    assert tier.put(key_of(1), old)
    assert tier.put(key_of(2), make_blob(key_of(2), 1_000_000, seed=2))
    for key, size in ((key_of(3), 4_000_000), (key_of(1), 4_000_000)):  # a new key, then overwriting key 1
        ready = FORK.Event()
        proc = FORK.Process(target=_child_hang_mid_data_write, args=(pool_name, capacity, key, size, ready),
                            daemon=True)
        proc.start()
        reached = ready.wait(20)
        proc.kill()
        proc.join()
        assert reached, "child did not reach the write"
        got = tier.get(key)
        assert got is None or bytes(got) == bytes(old)  # never the half-written new blob
        assert tier.get(key_of(2)) is not None
    lock = os.open(tier.arena.lock_path, os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel released the dead writer's lock
    os.close(lock)
    blob = make_blob(key_of(3), 4_000_000, seed=3)
    assert tier.put(key_of(3), blob) and tier.get(key_of(3)) == bytes(blob)
    # the last dead writer left the header dirty (the first one's was cleaned when the second child opened the pool)
    assert tier.counters["recovered"] == 1
    assert_stats_consistent(tier)
    tier.close()


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_sigkill_mid_publish_is_repaired(pool_name: str, path: str) -> None:
    tier = ShmTier(pool_name, 1 << 20)
    assert tier.put(key_of(1), b"one")
    ready = FORK.Event()
    proc = FORK.Process(target=_child_hang_mid_publish, args=(pool_name, 1 << 20, key_of(2), ready, path),
                        daemon=True)
    proc.start()
    reached = ready.wait(20)
    proc.kill()
    proc.join()
    assert reached
    assert returns_within(lambda: tier.get(key_of(2))) is None  # the entry is stuck mid-update: a miss
    assert returns_within(lambda: tier.contains_many([key_of(1), key_of(2)])) == [True, False]
    assert tier.put(key_of(3), b"three")  # the next writer retires the stuck entry
    assert tier.counters["repaired_entries"] == 1 and tier.counters["recovered"] == 1
    assert_stats_consistent(tier)
    assert tier.put(key_of(2), b"two") and tier.get(key_of(2)) == b"two"
    tier.close()


def test_concurrent_writers_killed_at_random_never_tear(pool_name: str) -> None:
    capacity = 8 << 20
    tier = ShmTier(pool_name, capacity)
    stack = TierStack([tier])
    deadline = time.monotonic() + 2.0
    reads = kills = 0
    seed = 0
    while time.monotonic() < deadline:
        procs = [FORK.Process(target=_child_writer_loop, args=(pool_name, capacity, 6, 300_000, seed + j * 10**6))
                 for j in range(2)]
        seed += 1000
        try:
            for proc in procs:
                proc.daemon = True
                proc.start()
            stop_at = time.monotonic() + 0.15 + (kills % 3) * 0.05
            while time.monotonic() < stop_at:
                for i in range(6):
                    got = tier.get(key_of(i))
                    if got is not None:
                        parse(got, key_of(i))  # raises on any torn or mixed blob
                        reads += 1
        finally:
            for proc in procs:
                if proc.pid is not None:
                    proc.kill()  # SIGKILL, likely mid-write
                    proc.join()
        kills += 1
    assert reads > 0 and kills > 2
    for i in range(6):  # after all that, the pool still works and the stack sees only valid chunks
        blob = make_blob(key_of(i), 200_000, seed=i)
        assert tier.put(key_of(i), blob)
        got = stack.get(key_of(i))
        assert got is not None and bytes(got.blob) == bytes(blob)
    assert stack.counters["corrupt.shm"] == 0
    assert_stats_consistent(tier)
    stack.close()


def test_a_stuck_lock_holder_drops_writes_but_never_blocks_readers(pool_name: str) -> None:
    tier = ShmTier(pool_name, 1 << 20, lock_timeout_s=0.3)
    assert tier.put(key_of(1), b"one")
    ready = FORK.Event()
    proc = FORK.Process(target=_child_hold_lock, args=(str(tier.arena.lock_path), ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(20)
        assert not returns_within(lambda: tier.put(key_of(2), b"two"))  # gives up after lock_timeout_s
        assert not returns_within(lambda: tier.delete(key_of(1)))
        assert tier.counters["put.lock_timeout"] == 1 and tier.counters["delete.lock_timeout"] == 1
        assert tier.get(key_of(1)) == b"one" and tier.contains_many([key_of(1)]) == [True]  # lock-free reads
    finally:
        proc.kill()
        proc.join()
    assert tier.put(key_of(2), b"two") and tier.get(key_of(2)) == b"two"
    tier.close()


def test_threads_share_one_tier(pool_name: str) -> None:
    tier = ShmTier(pool_name, 4 << 20)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(200):
                key = key_of(t * 1000 + i % 20)
                blob = make_blob(key, 20_000, seed=i % 20)
                assert tier.put(key, blob)
                got = tier.get(key)
                if got is not None:
                    parse(got, key)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    tier.close()


def test_pool_survives_restarts(pool_name: str) -> None:
    run_child(_child_store_and_exit, pool_name, 1 << 20, 20)  # a process that stored and exited without close
    tier = ShmTier(pool_name, 1 << 20)
    assert sorted(tier.keys()) == sorted(key_of(i) for i in range(20))
    for i in range(20):
        assert tier.get(key_of(i)) == bytes(make_blob(key_of(i), 10_000, seed=i))
    tier.close()
    again = ShmTier.from_config(ShmTierConfig(name=pool_name, capacity=1 << 20))
    assert len(again.keys()) == 20
    again.close()


@pytest.mark.parametrize("damage", ["magic", "header_checksum", "truncated", "budget"])
def test_bad_header_resets_the_pool(pool_name: str, damage: str, caplog) -> None:
    tier = ShmTier(pool_name, 1 << 20)
    assert tier.put(key_of(1), b"v")
    path = tier.arena.path
    if damage == "magic":
        with open(path, "r+b") as f:
            f.write(b"NOTAPOOL")
    elif damage == "header_checksum":
        with open(path, "r+b") as f:
            f.seek(60)
            f.write(b"\x01")  # inside the capacity field: the header checksum no longer matches
    elif damage == "truncated":
        os.truncate(path, 8192)
    capacity = 2 << 20 if damage == "budget" else 1 << 20
    with caplog.at_level(logging.WARNING, logger="kvfabric.tiers.shm"):
        fresh = ShmTier(pool_name, capacity)
    assert any("replacing it with a fresh pool" in r.message for r in caplog.records)
    assert fresh.counters["pool_reset"] == 1
    assert fresh.keys() == [] and fresh.capacity_bytes == capacity
    assert fresh.put(key_of(2), b"w") and fresh.get(key_of(2)) == b"w"
    if damage != "truncated":  # the old instance's mapping stays valid; it follows the new pool
        assert tier.get(key_of(2)) == b"w" and tier.get(key_of(1)) is None
        assert tier.counters["remapped"] == 1
    fresh.close()
    tier.close()


def test_damaged_entries_are_dropped_on_open(pool_name: str) -> None:
    tier = ShmTier(pool_name, 1 << 20)
    for i in range(5):
        assert tier.put(key_of(i), bytes([i]) * 100)
    index = tier.arena.current
    index.mm[entry_base(index, index.find(key_of(3)).slot) + 24] ^= 0xFF  # the length: its checksum fails
    assert tier.get(key_of(3)) is None  # readers check entry checksums too
    tier.close()
    reopened = ShmTier(pool_name, 1 << 20)
    assert reopened.counters["bad_entries"] == 1
    assert sorted(reopened.keys()) == sorted(key_of(i) for i in (0, 1, 2, 4))
    assert reopened.put(key_of(3), b"again") and reopened.get(key_of(3)) == b"again"
    reopened.close()


def test_corrupted_arena_bytes_are_caught_by_the_stack(pool_name: str) -> None:
    tier = ShmTier(pool_name, 1 << 20)
    blob = make_blob(key_of(1), 10_000, seed=1)
    assert tier.put(key_of(1), blob)
    index = tier.arena.current
    index.mm[index.geo.data_offset + index.find(key_of(1)).offset + 5000] ^= 0x55
    with pytest.raises(ChunkFormatError):
        parse(tier.get(key_of(1)), key_of(1))
    stack = TierStack([tier])
    assert stack.get(key_of(1)) is None and stack.counters["corrupt.shm"] == 1
    assert not tier.contains_many([key_of(1)])[0]  # deleted by the stack
    stack.close()


def test_pool_file_removed_under_a_running_process(pool_name: str) -> None:
    tier = ShmTier(pool_name, 1 << 20, recheck_s=0.0)  # the path is stat'ed on every operation
    assert tier.put(key_of(1), b"v")
    os.unlink(tier.arena.path)
    assert tier.get(key_of(1)) is None  # a new, empty pool is created
    assert tier.put(key_of(2), b"w") and tier.get(key_of(2)) == b"w"
    assert os.path.exists(tier.arena.path)
    tier.close()


# ---- the shared tier contract (tests/tier_contract.py) -----------------------------------------------------
class TestShmContract(TierContract):
    declared = dict(is_trusted=False, is_read_only=False, is_persistent=True, is_shared=True, honors_capacity=True,
                    honors_pins=True, is_zero_copy=True)

    @pytest.fixture(autouse=True)
    def _pools(self) -> Iterator[None]:
        self.names: list[str] = []
        yield
        for name in self.names:
            ShmTier.destroy(name)

    def make_tier(self, capacity_bytes):
        name = f"contract-{uuid.uuid4().hex[:12]}"
        self.names.append(name)
        return ShmTier(name, capacity_bytes)

    def reopen(self, tier):
        return ShmTier(tier.arena.name, tier.capacity_bytes)


def test_engines_share_chunks_through_the_pool(pool_name: str) -> None:
    import torch

    from kvfabric import CacheEngine, Config, KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
    shm_cfg = ShmTierConfig(name=pool_name, capacity=8 << 20)
    tokens = list(range(100))
    kv = torch.randn(layout.shape(100), generator=torch.Generator().manual_seed(0)).to(torch.float16)
    with CacheEngine(Config(chunk_size=16, tiers=("cpu", "shm"), shm=shm_cfg), layout, "m") as writer:
        assert writer.store(tokens, kv) == 6
        writer.flush()
    with CacheEngine(Config(chunk_size=16, tiers=("shm",), shm=shm_cfg), layout, "m") as reader:
        assert reader.lookup(tokens) == 96
        out = torch.zeros(layout.shape(100), dtype=torch.float16)
        got = reader.retrieve(tokens, out=out)  # the get_into fast path (shm is the first tier)
        assert torch.equal(got, kv[:, :, :, :96])
        assert torch.equal(reader.retrieve(tokens[:64]), kv[:, :, :, :64])  # the fresh-copy path


def test_typed_memoryview_is_stored_as_its_bytes(pool_name: str) -> None:
    import array
    tier = ShmTier(pool_name, 1 << 20)
    values = array.array("d", [1.5, 2.5, 3.5])
    assert tier.put(b"k", memoryview(values))
    assert tier.get(b"k") == values.tobytes() and tier.usage().num_bytes == 24
    tier.close()


def test_no_space_in_dev_shm_is_a_clear_error(pool_name: str, monkeypatch) -> None:
    import errno

    def enospc(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    with pytest.raises(ShmPoolError, match="not enough space"):
        ShmTier(pool_name, 1 << 20)
    monkeypatch.undo()
    tier = ShmTier(pool_name, 1 << 20)  # the half-made file is formatted properly next time
    assert tier.put(b"k", b"v") and tier.get(b"k") == b"v"
    tier.close()


def test_capabilities_get_into_and_prefetch(pool_name: str) -> None:
    tier = ShmTier(pool_name, 1 << 20)
    assert (tier.is_trusted, tier.is_read_only, tier.is_persistent, tier.is_shared, tier.honors_capacity,
            tier.honors_pins) == (False, False, True, True, True, True)
    blob = make_blob(key_of(1), 10_000, seed=1)
    assert tier.put(key_of(1), blob)
    tier.prefetch([key_of(1), key_of(2)])  # only a hint: nothing changes
    scratch = Scratch()
    got = tier.get_into(key_of(1), scratch)
    assert isinstance(got, memoryview) and bytes(got) == bytes(blob) == tier.get(key_of(1))
    assert tier.get_into(key_of(2), scratch) is None and tier.keys() == [key_of(1)]
    tier.close()
    assert tier.get_into(key_of(1), scratch) is None  # closed: a miss


def test_large_gets_reuse_dropped_buffers_and_never_one_still_held(pool_name: str) -> None:
    """A `get` of a large entry copies into a recycled buffer (no fresh pages per read), but never into one
    that a caller still holds: a held blob keeps its bytes whatever is read after it."""
    import numpy as np

    tier = ShmTier(pool_name, 64 << 20)
    blobs = {i: make_blob(key_of(i), 3 << 20, seed=i) for i in (1, 2)}
    for i, blob in blobs.items():
        assert tier.put(key_of(i), blob)

    def address(blob) -> int:
        return np.frombuffer(blob, dtype=np.uint8).ctypes.data

    held = tier.get(key_of(1))
    again = tier.get(key_of(2))  # the first is still held: another buffer
    assert address(again) != address(held)
    assert bytes(held) == bytes(blobs[1]) and bytes(again) == bytes(blobs[2])
    first = address(held)
    del held
    reused = tier.get(key_of(2))  # the first was dropped: its buffer comes back
    assert address(reused) == first and bytes(reused) == bytes(blobs[2])
    assert bytes(again) == bytes(blobs[2])
    tier.close()


# ---- reads in place (get(in_place=True): the P/D decode instance's path) -----------------------------------
def test_stack_reads_in_place_and_flags_a_reused_slot(pool_name: str) -> None:
    tier = ShmTier(pool_name, 1 << 20)
    blob = make_blob(key_of(1), 10_000, seed=1)
    assert tier.put(key_of(1), blob)
    stack = TierStack([tier])
    hit = stack.get(key_of(1), promote=False, in_place=True)
    assert hit is not None and hit.view is not None and bytes(hit.blob) == bytes(blob)
    index = tier.arena.current  # the hit's bytes are the pool's own, not a copy
    start = index.geo.data_offset + index.find(key_of(1)).offset
    assert bytes(index.mm[start:start + 16]) == bytes(hit.blob[:16]) and hit.view.is_current()
    assert tier.put(key_of(1), make_blob(key_of(1), 10_000, seed=2))  # a writer replaces it under the reader
    assert not hit.view.is_current() and tier.counters["view_reused"] == 1
    assert stack.get(key_of(1)).view is None  # a plain read copies, as before
    stack.close()


def test_a_corrupt_entry_read_in_place_is_dropped(pool_name: str) -> None:
    tier = ShmTier(pool_name, 1 << 20)
    assert tier.put(key_of(1), make_blob(key_of(1), 10_000, seed=1))
    index = tier.arena.current
    index.mm[index.geo.data_offset + index.find(key_of(1)).offset + 5000] ^= 0x55
    stack = TierStack([tier])
    assert stack.get(key_of(1), promote=False, in_place=True) is None
    assert stack.counters["corrupt.shm"] == 1 and not tier.contains_many([key_of(1)])[0]
    stack.close()


def test_engine_open_chunk_reads_in_place_and_a_reused_slot_fails_at_exit(pool_name: str) -> None:
    """open_chunk of a chunk in shared memory views it where it lies; a writer reusing the slot while the caller
    copies makes the source's exit raise ChunkFailed("torn") (counted, the entry not discarded). read_chunk copies
    it out first: nothing to check afterwards."""
    import numpy as np
    import torch

    from kvfabric import CacheEngine, Config, KVLayout
    from kvfabric.cache.protocol import ChunkFailed, ChunkMiss, TokenSource

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
    shm_cfg = ShmTierConfig(name=pool_name, capacity=8 << 20)
    tokens = list(range(32))
    kv = torch.randn(layout.shape(32), generator=torch.Generator().manual_seed(0))
    with CacheEngine(Config(chunk_size=16, tiers=("shm",), shm=shm_cfg), layout, "m") as engine:
        assert engine.store(tokens, kv) == 2
        engine.flush()
        key = engine.keys(tokens)[1]
        index = engine.stack.tiers[0].arena.current
        pool = np.frombuffer(index.mm, dtype=np.uint8).ctypes.data
        hit = engine.open_chunk(key)
        assert isinstance(hit, TokenSource) and hit.tier == "shm"
        with hit:  # intact: the exit raises nothing
            assert torch.equal(hit.kv, kv[:, :, :, 16:])
            assert pool <= hit.kv.data_ptr() < pool + len(index.mm)  # the pool's own bytes, not a copy
        hit = engine.open_chunk(key)
        assert isinstance(hit, TokenSource)
        with pytest.raises(ChunkFailed) as failed:
            with hit:
                copied = hit.kv.clone()
                assert engine.delete(tokens)  # the slot goes back to the writers: what was copied may be torn now
        assert failed.value.miss == ChunkMiss("torn") and torch.equal(copied, kv[:, :, :, 16:])
        assert engine.stats().counters["torn_reads"] == 1
        assert engine.open_chunk(key) == ChunkMiss("missing")
        assert engine.store(tokens, kv) == 2
        engine.flush()
        hit = engine.read_chunk(key)  # verified and copied out: a writer reusing the slot cannot tear it
        assert isinstance(hit, TokenSource)
        with hit:
            assert not pool <= hit.kv.data_ptr() < pool + len(index.mm)
            assert engine.delete(tokens)
            assert torch.equal(hit.kv, kv[:, :, :, 16:])
        assert engine.stats().counters["torn_reads"] == 1
