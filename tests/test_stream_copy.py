"""stream_copy: `copy_rows` copies every byte of a chunk's rows whatever the destination's alignment and the row
length (the compiled kernel streams whole 64-byte lines and copies the unaligned head and the tail through the
cache), and `rows` refuses views whose rows are not one contiguous run."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.codec.stream_copy import HAVE_STREAMING, copy_chunks, copy_rows, rows


@settings(max_examples=60, deadline=None)
@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 3), st.integers(1, 40),
                       st.integers(1, 24)),
       shift=st.integers(0, 63), start=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_copy_rows_copies_every_byte_at_any_alignment(shape, shift, start, seed):
    L, K, H, T, D = shape
    total = T + start + 3
    src = np.random.default_rng(seed).integers(0, 2**16, size=(L, K, H, total, D), dtype=np.uint16)
    raw = np.zeros(L * K * H * T * D * 2 + 64, dtype=np.uint8)  # the chunk's payload, `shift` bytes off a line
    dst = raw[shift:shift + L * K * H * T * D * 2].view(np.uint16).reshape(L, K, H, T, D)
    copy_rows(rows(dst), rows(src[:, :, :, start:start + T]))
    assert np.array_equal(dst, src[:, :, :, start:start + T])
    assert not raw[:shift].any() and not raw[shift + dst.nbytes:].any()  # nothing written outside


@settings(max_examples=60, deadline=None)
@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 3), st.integers(1, 24)),
       cuts=st.lists(st.integers(1, 40), min_size=1, max_size=6), shifts=st.lists(st.integers(0, 63), min_size=6,
                                                                                  max_size=6),
       seed=st.integers(0, 2**16))
def test_copy_chunks_cuts_every_span_out_at_any_alignment(shape, cuts, shifts, seed):
    pytest.importorskip("numba")
    L, K, H, D = shape
    bounds = np.cumsum([0, *cuts]).tolist()
    spans = list(zip(bounds[:-1], bounds[1:]))
    src = np.random.default_rng(seed).integers(0, 2**16, size=(L, K, H, bounds[-1] + 2, D), dtype=np.uint16)
    raws, dsts = [], []
    for (s, e), shift in zip(spans, shifts):  # each chunk's payload `shift` bytes off a line
        size = L * K * H * (e - s) * D * 2
        raws.append(np.zeros(size + 128, dtype=np.uint8))
        dsts.append(raws[-1][shift:shift + size].view(np.uint16).reshape(L, K, H, e - s, D))
    assert copy_chunks(src, spans, dsts)
    for (s, e), dst, raw, shift in zip(spans, dsts, raws, shifts):
        assert np.array_equal(dst, src[:, :, :, s:e])
        assert not raw[:shift].any() and not raw[shift + dst.nbytes:].any()  # nothing written outside


def test_copy_chunks_refuses_what_it_cannot_stream():
    src = np.zeros((2, 2, 3, 8, 4), dtype=np.float16)
    good = [np.zeros((2, 2, 3, 4, 4), dtype=np.float16) for _ in range(2)]
    assert not copy_chunks(src[:, :, :, :, :2], [(0, 4), (4, 8)], good)  # rows not one run each
    assert not copy_chunks(src, [(0, 4), (4, 8)], [good[0], good[1].astype(np.float32)])  # another dtype
    assert not copy_chunks(src, [(0, 4), (4, 7)], good)  # a destination of another size
    assert not copy_chunks(src, [(0, 4), (4, 8)], [good[0], np.zeros((2, 2, 3, 8, 4), np.float16)[:, :, :, ::2]])


def test_a_token_slice_of_rows_that_are_not_contiguous_is_refused():
    kv = np.zeros((2, 2, 3, 8, 4), dtype=np.float16)
    assert rows(kv[:, :, :, :, :2]) is None  # D sliced: a token's values are not one run with the next token's
    assert rows(kv[:, :, :, 2:5]).shape == (2, 2, 3, 3 * 4 * 2)


def test_the_compiled_kernel_is_there_when_numba_is():
    pytest.importorskip("numba")
    assert HAVE_STREAMING
