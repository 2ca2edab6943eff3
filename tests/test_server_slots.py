"""The server's slot table: leases, writes, commits, LRU reuse, per-holder caps, and that an uncommitted write is
never published."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.server.slots import Holder, SlotCapError, SlotTable


def test_decoded_slot_is_cached_and_leased_by_key() -> None:
    table = SlotTable(4, 2)
    a = Holder("a")
    slot = table.allocate(a)
    assert slot is not None and not table.contains(b"k")
    assert table.publish(slot, b"k")
    assert table.lease(b"k", a) == slot
    table.release(slot, a)
    table.release(slot, a)
    assert table.usage()["idle"] == 1 and table.usage()["referenced"] == 0
    assert table.lease(b"k", Holder("b")) == slot  # another client hits the cached chunk


def test_uncommitted_write_is_freed_never_published() -> None:
    table = SlotTable(2, 2)
    writer = Holder("w")
    slot = table.lease_for_write(writer)
    assert slot is not None
    assert table.release_all(writer) == 1  # the writer died mid-write
    assert not table.contains(b"k") and table.usage()["free"] == 2
    assert not table.commit(slot, b"k", writer)  # a late commit of a reclaimed slot is refused


def test_commit_publishes_and_holds_until_persisted() -> None:
    table = SlotTable(2, 2)
    writer = Holder("w")
    slot = table.lease_for_write(writer)
    assert table.commit(slot, b"k", writer)
    assert table.contains(b"k") and writer.num_leased == 0
    assert table.usage()["referenced"] == 1  # the server's hold for the encode
    table.unhold(slot)
    assert table.usage()["idle"] == 1
    other = table.lease_for_write(writer)
    assert not table.commit(other, b"k", writer)  # already held: the duplicate slot is freed
    assert table.usage()["free"] == 1


def test_lru_eviction_skips_referenced_slots() -> None:
    table = SlotTable(2, 4)
    h = Holder("h")
    for key in (b"a", b"b"):
        slot = table.allocate(None)
        table.publish(slot, key)
        table.unhold(slot)
    held = table.lease(b"a", h)  # a is now referenced, b is idle
    slot = table.allocate(None)
    assert slot is not None and slot != held and not table.contains(b"b") and table.contains(b"a")
    assert table.allocate(None) is None  # everything referenced: no slot, no waiting


def test_cap_per_holder_and_foreign_release_ignored() -> None:
    table = SlotTable(8, 2)
    a, b = Holder("a"), Holder("b")
    table.allocate(a)
    slot = table.allocate(a)
    with pytest.raises(SlotCapError):
        table.allocate(a)
    table.release(slot, b)  # b does not lease it: ignored
    assert a.num_leased == 2 and table.usage()["referenced"] == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "write", "commit", "lease", "release", "drop", "unhold"]),
                          st.integers(0, 2), st.integers(0, 3)), max_size=60))
def test_random_operations_keep_the_books(ops) -> None:
    """Whatever the sequence, a slot is never both free and referenced, and dropping every holder and hold
    leaves no slot referenced."""
    table = SlotTable(4, 3)
    holders = [Holder(str(i)) for i in range(3)]
    held: list[int] = []
    for op, who, arg in ops:
        h = holders[who]
        try:
            if op == "alloc" and (slot := table.allocate(None)) is not None:
                table.publish(slot, bytes([arg]))
                held.append(slot)
            elif op == "write":
                table.lease_for_write(h)
            elif op == "commit" and h.writing:
                slot = next(iter(h.writing))
                if table.commit(slot, bytes([arg]), h):
                    held.append(slot)
            elif op == "lease":
                table.lease(bytes([arg]), h)
            elif op == "release" and h.leases:
                table.release(next(iter(h.leases)), h)
            elif op == "drop":
                table.release_all(h)
            elif op == "unhold" and held:
                table.unhold(held.pop())
        except SlotCapError:
            pass
        usage = table.usage()
        assert usage["free"] + usage["idle"] + usage["referenced"] == 4
    for h in holders:
        table.release_all(h)
    for slot in held:
        table.unhold(slot)
    assert table.usage()["referenced"] == 0
