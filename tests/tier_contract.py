"""The contract every Tier implementation passes (tiers/base.py). Subclass it once per tier and provide:

- `declared`: the tier's declarations as its documentation states them (is_trusted, is_read_only, ...); the
  suite checks the class says the same, then checks each clause the way the declarations say it holds. A clause
  a tier cannot honour (Redis evicts on its own, a peer tier stores nothing) is checked in its declared form,
  never skipped;
- `make_tier(capacity_bytes)`: a fresh, empty tier; `reopen(tier)`: another instance made the same way over the
  same storage (for a persistent or shared tier it sees what the first stored);
- for read-only tiers, `seed(tier, items)`: put (key, blob) pairs where the tier reads them from;
- `evicts_lru`: False for a tier whose eviction policy is not LRU (the cpu and disk tiers take any policy): the
  capacity clause is then checked without the LRU order.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvfabric.codec.format import parse
from kvfabric.codec.raw import RawCodec
from kvfabric.host.pages import Scratch
from kvfabric.kv.layout import KVLayout
from kvfabric.tiers.stack import TierStack

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
DECLARATIONS = ("is_trusted", "is_read_only", "is_persistent", "is_shared", "honors_capacity", "honors_pins",
                "is_zero_copy")
METHODS = ("contains_many", "get", "get_into", "prefetch", "premap", "pause_premap", "new_blob", "file_of", "put",
           "delete", "keys", "usage", "pin", "unpin", "clear", "close")


def make_blob(key: bytes, num_tokens: int = 16, seed: int = 0) -> bytes:
    import torch
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYOUT.shape(num_tokens), generator=gen)
    return bytes(RawCodec().encode(kv, key, LAYOUT))


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


BLOB_BYTES = len(make_blob(key(0)))


class TierContract:
    declared: dict[str, bool]
    evicts_lru = True

    def make_tier(self, capacity_bytes: int):  # pragma: no cover - overridden
        raise NotImplementedError

    def reopen(self, tier):  # pragma: no cover - overridden
        raise NotImplementedError

    def seed(self, tier, items: Sequence[tuple[bytes, bytes]]) -> None:
        for k, blob in items:
            assert tier.put(k, blob)

    @pytest.fixture
    def tier(self):
        tier = self.make_tier(BLOB_BYTES * 100)
        yield tier
        tier.close()

    def test_declarations(self, tier):
        assert {name: getattr(tier, name) for name in DECLARATIONS} == self.declared
        assert all(callable(getattr(tier, name)) for name in METHODS)
        assert tier.usage().name == tier.name and tier.capacity_bytes >= 0

    def test_round_trip(self, tier):
        blob = make_blob(key(1), seed=1)
        self.seed(tier, [(key(1), blob)])
        assert tier.contains_many([key(1), key(2)]) == [True, False]
        tier.prefetch([key(1)])
        got = tier.get(key(1))
        assert got is not None and bytes(got) == blob
        into = tier.get_into(key(1), Scratch())
        assert into is not None and bytes(into) == blob
        path = tier.file_of(key(1))
        assert path is None or Path(path).read_bytes() == blob
        assert (key(1) in tier.keys()) != tier.is_read_only

    def test_read_in_place(self, tier):
        blob = make_blob(key(1), seed=1)
        self.seed(tier, [(key(1), blob)])
        if not tier.is_zero_copy:  # the stack never asks such a tier
            with pytest.raises(NotImplementedError):
                tier.get_view(key(1))
            return
        assert tier.get_view(key(99)) is None
        view = tier.get_view(key(1))
        assert view is not None and bytes(view.blob) == blob and view.is_current()
        tier.delete(key(1))  # the writer reuses the entry: a reader that copied from the view must know
        assert not view.is_current()
        assert tier.get_view(key(1)) is None

    def test_premap_then_new_blob(self, tier):
        # The vLLM worker names its chunk size to the first writable tier of any kind (a P/D pool is shm only).
        tier.premap(4096)
        tier.pause_premap(True)
        tier.premap(4096)
        tier.pause_premap(False)
        blob = tier.new_blob(4096)
        assert len(blob) == 4096
        memoryview(blob)[:1] = b"x"

    def test_missing_key_is_none(self, tier):
        assert tier.get(key(99)) is None
        assert tier.get_into(key(99), Scratch()) is None
        assert tier.contains_many([key(99)]) == [False]
        assert tier.delete(key(99)) is False

    def test_delete(self, tier):
        blob = make_blob(key(1))
        self.seed(tier, [(key(1), blob)])
        if tier.is_read_only:  # forgets nothing it does not own: the source still serves the chunk
            assert tier.delete(key(1)) is False
            assert bytes(tier.get(key(1))) == blob
            return
        assert tier.delete(key(1))
        assert tier.get(key(1)) is None
        assert tier.contains_many([key(1)]) == [False]

    def test_overwrite_keeps_one_entry(self, tier):
        self.seed(tier, [(key(1), make_blob(key(1), seed=1))])
        if tier.is_read_only:  # put stores nothing
            assert tier.put(key(1), make_blob(key(1), seed=2)) is False
            assert bytes(tier.get(key(1))) == make_blob(key(1), seed=1)
            return
        tier.put(key(1), make_blob(key(1), seed=2))
        assert bytes(tier.get(key(1))) == make_blob(key(1), seed=2)
        assert tier.usage().num_chunks == 1

    def test_capacity_in_bytes_and_lru_order(self):
        tier = self.make_tier(BLOB_BYTES * 3)
        try:
            if tier.is_read_only:
                assert tier.put(key(0), make_blob(key(0))) is False
            elif tier.honors_capacity:
                for i in range(3):
                    assert tier.put(key(i), make_blob(key(i), seed=i))
                assert tier.get(key(0)) is not None  # 0 becomes most recent; 1 is now the oldest
                tier.put(key(3), make_blob(key(3), seed=3))
                present = tier.contains_many([key(0), key(1), key(2), key(3)])
                if self.evicts_lru:
                    assert present == [True, False, True, True]
                else:  # another policy picks its own victim (or turns the newcomer away)
                    assert sum(present) == 3
                assert tier.usage().num_bytes <= BLOB_BYTES * 3
            else:  # someone else bounds it (a server's maxmemory): this client evicts nothing
                for i in range(5):
                    assert tier.put(key(i), make_blob(key(i), seed=i))
                assert tier.contains_many([key(i) for i in range(5)]) == [True] * 5
        finally:
            tier.close()

    def test_pinned_keys_survive_eviction(self):
        tier = self.make_tier(BLOB_BYTES * 2)
        try:
            self.seed(tier, [(key(0), make_blob(key(0)))])
            tier.pin([key(0)])
            if tier.honors_pins and tier.honors_capacity:
                for i in range(1, 5):
                    tier.put(key(i), make_blob(key(i)))
                assert tier.get(key(0)) is not None
                tier.unpin([key(0)])
                for i in range(5, 45):  # unpinned, it competes again (with keys read as often as it was)
                    tier.put(key(i), make_blob(key(i)))
                    tier.get(key(i))
                    tier.get(key(i))
                assert tier.get(key(0)) is None
            else:  # pin and unpin are accepted and change nothing
                assert bytes(tier.get(key(0))) == make_blob(key(0))
                tier.unpin([key(0)])
                assert bytes(tier.get(key(0))) == make_blob(key(0))
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
        blobs = [(key(i), make_blob(key(i))) for i in range(3)]
        self.seed(tier, blobs)
        tier.clear()
        if tier.is_read_only:  # forgets what it cached; the source is untouched
            assert bytes(tier.get(key(0))) == blobs[0][1]
            return
        assert tier.contains_many([key(i) for i in range(3)]) == [False] * 3
        assert tier.usage().num_chunks == 0

    def test_concurrent_readers_and_writers(self, tier):
        errors: list[str] = []
        if tier.is_read_only:
            self.seed(tier, [(key(i), make_blob(key(i), seed=i)) for i in range(80)])

        def worker(offset: int) -> None:
            for i in range(offset, offset + 20):
                blob = make_blob(key(i), seed=i)
                if not tier.is_read_only:
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
        blob = make_blob(key(5), seed=5)
        if tier.is_read_only:
            self.seed(tier, [(key(5), blob)])
        stack.put(key(5), blob)  # never reaches a read-only tier
        stack.flush()
        found = stack.get(key(5))
        assert found is not None and bytes(found.blob) == blob and found.tier == tier.name

    def test_stack_get_many_batches_and_verifies(self, tier):
        stack = TierStack([tier])
        blobs = {i: make_blob(key(i), seed=i) for i in (1, 3)}
        items = list((key(i), b) for i, b in blobs.items())
        if tier.is_read_only:
            self.seed(tier, items)
        for k, b in items:
            stack.put(k, b)
        stack.flush()
        found = stack.get_many([key(1), key(2), key(3)], [Scratch() for _ in range(3)])
        assert [f is not None for f in found] == [True, False, True]
        assert bytes(found[0].blob) == blobs[1] and bytes(found[2].blob) == blobs[3] and found[0].tier == tier.name
        assert stack.counters["miss"] == 1
        stack.close()

    def test_restart_persistence(self, tier):
        blob = make_blob(key(1), seed=1)
        stored = tier.put(key(1), blob)
        assert stored != tier.is_read_only
        tier.close()
        again = self.reopen(tier)
        try:
            assert again.contains_many([key(1)]) == [tier.is_persistent]
            if tier.is_persistent:
                assert bytes(again.get(key(1))) == blob
        finally:
            again.close()

    def test_sharing(self, tier):
        other = self.reopen(tier)  # a second instance while the first is open (another process, as far as it knows)
        try:
            tier.put(key(1), make_blob(key(1)))
            assert other.contains_many([key(1)]) == [tier.is_shared]
        finally:
            other.close()
