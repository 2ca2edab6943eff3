"""Admission policies (always, second access, TinyLFU) and PolicyIndex's own rules (admission refusals, pins
and the byte budget, size updates, counters)."""
from __future__ import annotations

import pytest

from kvfabric.tiers.policies import (
    LRU,
    AccessMeta,
    AlwaysAdmit,
    PolicyIndex,
    SecondAccess,
    TinyLFU,
    key_hash64,
    make_admission,
)

META = AccessMeta()


def test_always_admits():
    assert all(AlwaysAdmit().admit(key, META) for key in range(5))


def test_second_access_admits_on_the_second_miss_within_its_window():
    policy = SecondAccess(window=2)
    assert [policy.admit(key, META) for key in ("a", "a", "a")] == [False, True, False]
    assert [policy.admit(key, META) for key in ("b", "c", "d", "b")] == [False, False, False, False]  # b left


def test_tinylfu_counts_repeats_after_the_doorkeeper():
    sketch = TinyLFU(width=1024, threshold=3, seed=7)
    assert sketch.estimate(42) == 0
    assert [sketch.admit(42, META) for _ in range(3)] == [False, False, True]  # 1 (doorkeeper), 2, 3
    assert sketch.estimate(43) == 0


def test_tinylfu_ages_by_halving():
    sketch = TinyLFU(width=1024, sample_size=100, threshold=2)
    hot = 10**9
    for _ in range(9):
        sketch.record(hot)
    assert sketch.estimate(hot) == 9  # 8 counted + the doorkeeper's 1
    for key in range(91):  # reaches 100 records: counters halve, the doorkeeper clears
        sketch.record(key)
    assert sketch.estimate(hot) == 4
    assert sketch.num_steps == 1024 * 4


def test_tinylfu_is_deterministic():
    a, b = TinyLFU(width=64, seed=1), TinyLFU(width=64, seed=1)
    keys = [i % 37 for i in range(500)] + [bytes([i]) * 32 for i in range(50)]
    assert [a.admit(k, META) for k in keys] == [b.admit(k, META) for k in keys]


def test_key_hash_is_stable_and_typed():
    assert key_hash64(1) == key_hash64(1) != key_hash64(2)
    assert key_hash64(b"\x01" * 32) == key_hash64(bytearray(b"\x01" * 32))
    assert key_hash64(5, seed=0) != key_hash64(5, seed=1)
    with pytest.raises(TypeError):
        key_hash64(1.5)


def test_make_admission_names():
    assert make_admission("always", 10).name == "always"
    assert make_admission("second", 10).window == 20
    assert make_admission("tinylfu", 10).width == 20
    with pytest.raises(ValueError, match="unknown admission policy"):
        make_admission("never", 10)


# ---- PolicyIndex --------------------------------------------------------------------------------------------
def test_index_refusal_by_admission_is_counted_and_stores_nothing():
    index = PolicyIndex(10, LRU(10), SecondAccess(window=8))
    assert not index.add("a", 1)
    assert "a" not in index and index.stats().num_refused == 1
    assert index.add("a", 1) and "a" in index


def test_index_never_exceeds_the_budget_beside_pinned_keys():
    evicted = []
    index = PolicyIndex(10, LRU(10), on_evict=evicted.append)
    for key in "abcde":
        index.add(key, 2)
    index.pin("abcd")
    assert not index.add("x", 4)  # only e (2 bytes) could go: 8 pinned + 4 > 10, so nothing goes
    assert evicted == [] and "e" in index
    assert index.add("y", 2) and evicted == ["e"]
    assert index.num_bytes == 10
    index.unpin("abcd")
    assert index.add("x", 4) and evicted == ["e", "a", "b"]


def test_index_resize_of_a_resident_key():
    evicted = []
    index = PolicyIndex(6, LRU(6), on_evict=evicted.append)
    for key in "abc":
        index.add(key, 2)
    assert index.add("a", 4) and evicted == ["b"]  # a is a hit (most recent) and grows: b goes
    assert index.num_bytes == 6 and index.stats().num_hits == 1
    assert not index.add("c", 7) and "c" not in index and index.num_bytes == 4


def test_index_counters_add_up():
    index = PolicyIndex(5, LRU(5))
    for key in range(20):
        index.add(key % 8, 1)
        index.touch((key * 3) % 8)
    stats = index.stats()
    assert stats.num_admitted - stats.num_evicted == stats.num_keys == len(index.keys())
    assert stats.num_bytes == 5 and stats.capacity_bytes == 5


def test_index_clear_and_bad_capacity():
    index = PolicyIndex(4, LRU(4))
    index.add("a", 2)
    index.pin(["a"])
    index.clear()
    assert len(index) == 0 and index.num_bytes == 0
    assert index.add("b", 4)  # the pinned bytes of cleared keys no longer count
    with pytest.raises(ValueError):
        PolicyIndex(0, LRU(0))
