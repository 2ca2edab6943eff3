"""tiers/shm/fit.py: the compiled first fit agrees with a plain reference on any extent table."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.tiers.shm.fit import first_fit

ALIGN = 64


def reference(extents: list[tuple[int, int]], need: int, data_bytes: int) -> int:
    at = 0
    for start, size in sorted(extents):
        if start - at >= need:
            return at
        at = max(at, start + size)
    return at if data_bytes - at >= need else -1


@st.composite
def tables(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]], int]:
    num_slots = draw(st.sampled_from([8, 64, 1024]))
    data_bytes = draw(st.integers(1, 4096)) * ALIGN
    cuts = sorted(set(draw(st.lists(st.integers(0, data_bytes // ALIGN), max_size=2 * min(num_slots, 40)))))
    pairs = [(a * ALIGN, (b - a) * ALIGN) for a, b in zip(cuts[::2], cuts[1::2]) if b > a]  # disjoint extents
    slots = draw(st.permutations(range(num_slots)))[:len(pairs)]
    offsets, sizes = np.zeros(num_slots, dtype="<u8"), np.zeros(num_slots, dtype="<u8")
    for slot, (start, size) in zip(slots, pairs):
        offsets[slot], sizes[slot] = start, size
    return offsets, sizes, pairs, data_bytes


@settings(max_examples=300, deadline=None)
@given(tables(), st.integers(1, 300))
def test_first_fit_is_the_lowest_gap_that_holds_the_size(table, units: int) -> None:
    offsets, sizes, extents, data_bytes = table
    need = units * ALIGN
    scratch = np.empty(len(sizes), dtype=np.int64), np.empty(len(sizes), dtype=np.int64)
    assert first_fit(offsets, sizes, len(extents), need, data_bytes, *scratch) == reference(extents, need, data_bytes)


def test_a_full_arena_has_no_fit_and_an_empty_one_fits_at_zero() -> None:
    offsets, sizes = np.zeros(16, dtype="<u8"), np.zeros(16, dtype="<u8")
    scratch = np.empty(16, dtype=np.int64), np.empty(16, dtype=np.int64)
    assert first_fit(offsets, sizes, 0, 4096, 4096, *scratch) == 0
    sizes[3] = 4096
    assert first_fit(offsets, sizes, 1, 64, 4096, *scratch) == -1
    sizes[3], offsets[9], sizes[9] = 1024, 2048, 1024  # gaps [1024, 2048) and [3072, 4096)
    assert first_fit(offsets, sizes, 2, 1024, 4096, *scratch) == 1024
    assert first_fit(offsets, sizes, 2, 1088, 4096, *scratch) == -1
