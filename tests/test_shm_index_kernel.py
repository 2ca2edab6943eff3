"""tiers/shm/index_kernel.py: the compiled put and read steps leave the pool exactly as index.py's Python path does,
on any sequence of puts, deletes and reads (evictions, tombstones and purges included); a replaced pool is followed
at once through its superseded flag, one removed by hand within `recheck_s`."""
from __future__ import annotations

import os
import time
import uuid

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.tiers.shm import ShmTier
from kvfabric.tiers.shm.layout import KEY_AT, STATS, STATS_AT
from tests.test_shm_tier import PythonPath, assert_stats_consistent, key_of, pool_name  # noqa: F401 - a fixture

FIELDS = ["seq", "state", "key_len", "offset", "length", "esum"]  # every entry field but atime (a clock)


def snapshot(tier: ShmTier) -> tuple:
    """The index as bytes that must agree between the two paths: entries (keys included), extents and totals."""
    index = tier.arena.current
    entries = index.entries()
    fields = tuple(entries[name].tolist() for name in FIELDS)
    keys = tuple(bytes(index.mm[index._base(slot) + KEY_AT:index._base(slot) + KEY_AT + 64])
                 for slot in range(index.geo.num_slots))
    offsets, sizes = index.extents()
    out = fields, keys, offsets.tolist(), sizes.tolist(), STATS.unpack_from(index.mm, STATS_AT)
    del entries, offsets, sizes, index
    return out


ops = st.lists(st.tuples(st.sampled_from(["put", "put", "put", "delete", "get"]), st.integers(0, 11),
                         st.integers(1, 12_000)), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, num_slots=st.sampled_from([8, 16, 64]))
def test_compiled_and_python_paths_leave_the_same_index(ops: list, num_slots: int) -> None:
    names = [f"kernel-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    compiled = ShmTier(names[0], 48_000, num_slots=num_slots)  # a small budget: puts evict
    python = ShmTier(names[1], 48_000, num_slots=num_slots, ops=PythonPath())
    try:
        for op, i, size in ops:
            key = key_of(i)
            if op == "put":
                blob = bytes([i]) * size
                assert compiled.put(key, blob) == python.put(key, blob)
            elif op == "delete":
                assert compiled.delete(key) == python.delete(key)
            else:
                got = compiled.get(key), python.get(key)
                assert got[0] == got[1]
            assert snapshot(compiled) == snapshot(python)
        used = any(op != "delete" for op, _, _ in ops)  # puts and reads go through the kernel, deletes do not
        assert (compiled.arena.current._kernel is not None) == used and python.arena.current._kernel is None
        assert_stats_consistent(compiled)
    finally:
        for tier, name in zip((compiled, python), names):
            tier.close()
            ShmTier.destroy(name)


def test_the_compiled_path_frees_a_replaced_extent_for_the_next_put(pool_name: str) -> None:
    tier = ShmTier(pool_name, 1 << 20)
    blob = np.arange(300_000, dtype=np.uint32).astype(np.uint8).tobytes()
    for _ in range(50):  # 50 x 300 KB through a 1 MB budget: only if each put frees the extent it replaces
        assert tier.put(key_of(1), blob)
    assert tier.get(key_of(1)) == blob and tier.counters["evicted"] == 0
    assert_stats_consistent(tier)
    tier.close()


def test_a_replaced_pool_is_followed_at_once_through_its_superseded_flag(pool_name: str) -> None:
    old = ShmTier(pool_name, 1 << 20, recheck_s=3600.0)  # no stat for an hour: only the flag can say it
    assert old.put(key_of(1), b"old")
    new = ShmTier(pool_name, 2 << 20)  # another budget: this process replaces the pool file
    assert new.counters["pool_reset"] == 1 and new.put(key_of(2), b"new")
    assert old.get(key_of(2)) == b"new" and old.get(key_of(1)) is None
    assert old.counters["remapped"] == 1
    new.close()
    old.close()


def test_a_pool_removed_by_hand_is_followed_within_recheck_s(pool_name: str) -> None:
    tier = ShmTier(pool_name, 1 << 20, recheck_s=2.0)  # long enough that the next line comes first on a busy host
    assert tier.put(key_of(1), b"v")
    os.unlink(tier.arena.path)
    assert tier.get(key_of(1)) == b"v"  # the path is not stat'ed on every read ...
    deadline = time.monotonic() + 10
    while tier.get(key_of(1)) is not None:  # ... but within recheck_s: a fresh pool, without the key
        assert time.monotonic() < deadline, "the removed pool file was never noticed"
    assert os.path.exists(tier.arena.path) and tier.counters["remapped"] == 1
    assert tier.put(key_of(2), b"w") and tier.get(key_of(2)) == b"w"
    tier.close()
