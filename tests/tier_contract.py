"""The contract every Tier implementation passes (tiers/base.py). Subclass and provide `make_tier`.

`make_tier(capacity_bytes)` returns a fresh, empty tier; `reopen(tier)` (optional) returns a new instance over
the same storage, for tiers that persist.
"""
from __future__ import annotations

import os
import threading

import pytest

from kvfabric.codec.format import parse
from kvfabric.codec.raw import RawCodec
from kvfabric.layout import KVLayout
from kvfabric.tiers.stack import TierStack

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")


def make_blob(key: bytes, num_tokens: int = 16, seed: int = 0) -> bytes:
    import torch
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYOUT.shape(num_tokens), generator=gen)
    return bytes(RawCodec().encode(kv, key, LAYOUT))


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


BLOB_BYTES = len(make_blob(key(0)))


class TierContract:
    is_persistent = False

    def make_tier(self, capacity_bytes: int):  # pragma: no cover - overridden
        raise NotImplementedError

    def reopen(self, tier):  # pragma: no cover - overridden by persistent tiers
        raise NotImplementedError

    @pytest.fixture
    def tier(self):
        tier = self.make_tier(BLOB_BYTES * 100)
        yield tier
        tier.close()

    def test_round_trip(self, tier):
        blob = make_blob(key(1), seed=1)
        assert tier.put(key(1), blob)
        got = tier.get(key(1))
        assert got is not None and bytes(got) == blob
        assert tier.contains_many([key(1), key(2)]) == [True, False]

    def test_missing_key_is_none(self, tier):
        assert tier.get(key(99)) is None
        assert tier.delete(key(99)) is False

    def test_delete(self, tier):
        tier.put(key(1), make_blob(key(1)))
        assert tier.delete(key(1))
        assert tier.get(key(1)) is None
        assert tier.contains_many([key(1)]) == [False]

    def test_overwrite_keeps_one_entry(self, tier):
        tier.put(key(1), make_blob(key(1), seed=1))
        tier.put(key(1), make_blob(key(1), seed=2))
        assert bytes(tier.get(key(1))) == make_blob(key(1), seed=2)
        assert tier.usage().num_chunks == 1

    def test_capacity_in_bytes_and_lru_order(self):
        tier = self.make_tier(BLOB_BYTES * 3)
        try:
            for i in range(3):
                assert tier.put(key(i), make_blob(key(i), seed=i))
            assert tier.get(key(0)) is not None  # 0 becomes most recent; 1 is now the oldest
            tier.put(key(3), make_blob(key(3), seed=3))
            assert tier.contains_many([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
            assert tier.usage().num_bytes <= BLOB_BYTES * 3
        finally:
            tier.close()

    def test_pinned_keys_survive_eviction(self):
        tier = self.make_tier(BLOB_BYTES * 2)
        try:
            tier.put(key(0), make_blob(key(0)))
            tier.pin([key(0)])
            for i in range(1, 5):
                tier.put(key(i), make_blob(key(i)))
            assert tier.get(key(0)) is not None
            tier.unpin([key(0)])
            for i in range(5, 8):
                tier.put(key(i), make_blob(key(i)))
            assert tier.get(key(0)) is None
        finally:
            tier.close()

    def test_blob_larger_than_capacity_is_refused(self):
        tier = self.make_tier(BLOB_BYTES // 2)
        try:
            assert not tier.put(key(0), make_blob(key(0)))
            assert tier.get(key(0)) is None
        finally:
            tier.close()

    def test_clear(self, tier):
        for i in range(3):
            tier.put(key(i), make_blob(key(i)))
        tier.clear()
        assert tier.contains_many([key(i) for i in range(3)]) == [False] * 3
        assert tier.usage().num_chunks == 0

    def test_concurrent_readers_and_writers(self, tier):
        errors: list[str] = []

        def worker(offset: int) -> None:
            for i in range(offset, offset + 20):
                blob = make_blob(key(i), seed=i)
                tier.put(key(i), blob)
                got = tier.get(key(i))
                if got is not None and bytes(got) != blob:
                    errors.append(f"wrong bytes for {i}")
                other = tier.get(key((i + 7) % 80))
                if other is not None:
                    parse(other, key((i + 7) % 80))  # whatever is read is a whole, valid chunk

        threads = [threading.Thread(target=worker, args=(n * 20,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []

    def test_stack_serves_and_verifies(self, tier):
        stack = TierStack([tier])
        try:
            stack.put(key(5), make_blob(key(5), seed=5))
            stack.flush()
            found = stack.get(key(5))
            assert found is not None and bytes(found.blob) == make_blob(key(5), seed=5)
        finally:
            stack.flush()

    def test_restart_persistence(self, tier):
        if not self.is_persistent:
            pytest.skip("tier does not persist")
        blob = make_blob(key(1), seed=1)
        tier.put(key(1), blob)
        tier.close()
        again = self.reopen(tier)
        try:
            assert again.contains_many([key(1)]) == [True]
            assert bytes(again.get(key(1))) == blob
        finally:
            again.close()


def pid_suffix() -> str:
    return f"{os.getpid()}"
