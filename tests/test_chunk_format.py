"""Chunk format: round trip, and every single-byte corruption and every truncation is detected."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, parse
from kvfabric.codec.raw import RawCodec
from kvfabric.kv.layout import KVLayout

LAYOUT = KVLayout(2, 1, 4, "float16")
KEY = bytes(range(32))


def blob_for(seed: int = 0, layout: KVLayout = LAYOUT, num_tokens: int = 3) -> bytes:
    kv = torch.randn(layout.shape(num_tokens), generator=torch.Generator().manual_seed(seed))
    return bytes(RawCodec().encode(kv, KEY, layout))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_round_trip_exact(dtype):
    layout = KVLayout(3, 2, 8, dtype)
    kv = torch.randn(layout.shape(5)).to(layout.torch_dtype)
    blob = RawCodec().encode(kv, KEY, layout)
    header = parse(blob, KEY)
    out = torch.empty(layout.shape(5), dtype=torch.float32)
    RawCodec().decode(header, memoryview(blob), layout, out)
    assert torch.equal(out, kv.float())


def test_decode_into_a_strided_view():
    kv = torch.randn(LAYOUT.shape(3)).half()
    big = torch.zeros(LAYOUT.shape(10))
    RawCodec().decode(parse(RawCodec().encode(kv, KEY, LAYOUT), KEY), memoryview(RawCodec().encode(kv, KEY, LAYOUT)),
                      LAYOUT, big[:, :, :, 4:7, :])
    assert torch.equal(big[:, :, :, 4:7, :], kv.float()) and big[:, :, :, :4].abs().sum() == 0


def test_every_single_byte_corruption_is_detected():
    blob = blob_for()
    for i in range(len(blob)):
        for flip in (0x01, 0x80):
            damaged = bytearray(blob)
            damaged[i] ^= flip
            with pytest.raises(ChunkFormatError):
                parse(damaged, KEY)


def test_every_truncation_is_detected():
    blob = blob_for()
    for n in range(len(blob)):
        with pytest.raises(ChunkFormatError):
            parse(blob[:n], KEY)
    with pytest.raises(ChunkFormatError):
        parse(blob + b"\0", KEY)


def test_wrong_key_is_detected():
    with pytest.raises(ChunkFormatError, match="key"):
        parse(blob_for(), bytes(32))


@settings(max_examples=300)
@given(st.binary(max_size=400))
def test_random_bytes_never_parse_and_never_crash(data):
    with pytest.raises(ChunkFormatError):
        parse(data, KEY)


@settings(max_examples=200)
@given(st.integers(0, 10_000), st.binary(min_size=1, max_size=8), st.data())
def test_random_overwrites_are_detected(seed, patch, data):
    blob = bytearray(blob_for(seed % 7))
    at = data.draw(st.integers(0, len(blob) - len(patch)))
    if bytes(blob[at:at + len(patch)]) == patch:
        return
    blob[at:at + len(patch)] = patch
    with pytest.raises(ChunkFormatError):
        parse(blob, KEY)


def test_header_size_is_stable():
    assert HEADER_BYTES == 128  # version 2: 92 bytes in version 1, before the block layout field
