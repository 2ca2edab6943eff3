"""The policy-driven tiers (cpu, disk) under every eviction and admission policy: capacity in bytes is never
exceeded, pinned chunks stay, a deleted or evicted chunk is never served, the bookkeeping matches the data
(bytes on disk = the index's bytes), refused chunks are not stored, and the policy names agree with config."""
from __future__ import annotations

import os
import random
import typing

import pytest

from kvfabric.config import AdmissionName, EvictionName
from kvfabric.tiers.cpu import CpuTier
from kvfabric.tiers.disk import SUFFIX, DiskTier
from kvfabric.tiers.policies import ADMISSION_NAMES, EVICTION_NAMES, AccessMeta
from tests.tier_contract import BLOB_BYTES, key, make_blob

EVICTIONS = typing.get_args(EvictionName)
ADMISSIONS = typing.get_args(AdmissionName)


def test_config_names_are_the_policies():
    assert set(EVICTIONS) == set(EVICTION_NAMES) and set(ADMISSIONS) == set(ADMISSION_NAMES)


def make(kind: str, tmp_path, capacity: int, eviction: str, admission: str = "always"):
    if kind == "cpu":
        return CpuTier(capacity, eviction=eviction, admission=admission)
    return DiskTier(tmp_path / "chunks", capacity, eviction=eviction, admission=admission)


def data_bytes(tier) -> tuple[set[bytes], int]:
    """What the tier really holds: keys and bytes of its blobs (cpu) or chunk files (disk)."""
    if isinstance(tier, CpuTier):
        return set(tier._blobs), sum(len(blob) for blob in tier._blobs.values())
    files = [p for p in tier.root.rglob("*" + SUFFIX)]
    return {bytes.fromhex(p.name[:-len(SUFFIX)]) for p in files}, sum(p.stat().st_size for p in files)


@pytest.mark.parametrize("admission", ADMISSIONS)
@pytest.mark.parametrize("eviction", EVICTIONS)
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_random_workload_keeps_every_promise(kind, eviction, admission, tmp_path):
    rng = random.Random(7)
    blobs = {i: make_blob(key(i), num_tokens=rng.choice([4, 8, 16]), seed=i) for i in range(40)}
    capacity = 6 * BLOB_BYTES
    tier = make(kind, tmp_path, capacity, eviction, admission)
    deleted: set[bytes] = set()
    pinned: list[bytes] = []
    try:
        for step in range(600):
            i = min(int(rng.paretovariate(0.8)), 39)
            k, op = key(i), rng.random()
            meta = AccessMeta(i % 4, 4, 16, 0.001 * (1 + i % 4))
            if op < 0.5:
                if tier.put(k, blobs[i], meta=meta):
                    deleted.discard(k)
            elif op < 0.85:
                got = tier.get(k, meta=meta)
                assert got is None or bytes(got) == blobs[i], "served other bytes"
                assert got is None or k not in deleted, "served a deleted chunk"
            elif op < 0.92 and k not in pinned:  # an explicit delete removes even a pinned chunk
                tier.delete(k)
                deleted.add(k)
            elif op < 0.96 and not pinned and tier.contains_many([k])[0]:
                tier.pin([k])
                pinned.append(k)
            elif pinned:
                tier.unpin(pinned)
                pinned.clear()
            usage = tier.usage()
            assert usage.num_bytes <= capacity, f"over capacity at step {step}"
            keys, num_bytes = data_bytes(tier)
            assert keys == set(tier.keys()) and num_bytes == usage.num_bytes, f"index and data differ at step {step}"
            assert all(tier.contains_many(pinned)), "a pinned chunk was evicted"
        stats = tier.index_stats()
        assert stats.num_evicted > 0 and stats.num_hits > 0
        assert admission == "always" or stats.num_refused > 0
    finally:
        tier.close()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("admission", ["second", "tinylfu"])
def test_admission_refuses_a_first_store_and_keeps_nothing(kind, admission, tmp_path):
    tier = make(kind, tmp_path, 10 * BLOB_BYTES, "lru", admission)
    blob = make_blob(key(1))
    assert tier.put(key(1), blob) is False  # a one-hit wonder is not stored...
    assert tier.get(key(1)) is None and data_bytes(tier) == (set(), 0)
    assert tier.put(key(1), blob) is True  # ...a chunk stored twice is
    assert bytes(tier.get(key(1))) == blob
    assert tier.index_stats().num_refused == 1
    tier.close()


def test_disk_rebuild_keeps_chunks_that_admission_would_refuse(tmp_path):
    first = DiskTier(tmp_path, 10 * BLOB_BYTES)
    first.put(key(1), make_blob(key(1)))
    again = DiskTier(tmp_path, 10 * BLOB_BYTES, admission="second")  # chunks on disk exist: no admission asked
    assert again.contains_many([key(1)]) == [True] and bytes(again.get(key(1))) == make_blob(key(1))


def test_disk_chunk_evicted_while_being_written_leaves_no_file(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 2 * BLOB_BYTES)
    real_replace = os.replace

    def replace_after_other_puts(src, dst):  # another writer's puts land between our booking and our rename
        if str(dst).endswith(key(9).hex() + SUFFIX):
            monkeypatch.setattr("kvfabric.tiers.disk.os.replace", real_replace)
            for i in (1, 2):
                assert tier.put(key(i), make_blob(key(i)))  # the second evicts key 9 (LRU), still being written
        real_replace(src, dst)

    monkeypatch.setattr("kvfabric.tiers.disk.os.replace", replace_after_other_puts)
    assert tier.put(key(9), make_blob(key(9))) is False  # evicted before it landed: reported as not stored
    assert tier.get(key(9)) is None and tier.contains_many([key(9)]) == [False]
    assert data_bytes(tier) == ({key(1), key(2)}, tier.usage().num_bytes)
    assert tier.put(key(9), make_blob(key(9)))  # and a later put of it is a normal one
    assert bytes(tier.get(key(9))) == make_blob(key(9))


def test_unknown_policy_names_are_errors():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        CpuTier(BLOB_BYTES, eviction="mru")
    with pytest.raises(ValueError, match="unknown admission policy"):
        CpuTier(BLOB_BYTES, admission="never")
