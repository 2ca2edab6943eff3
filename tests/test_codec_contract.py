"""One contract suite, run against every codec of the registry at every level (raw, int8, cachegen), and video
(lossless, near-lossless on both backends, 10-bit: its encodes are slow, so a sample of its settings).

- round trip within the codec's stated error bound (exact for lossless codecs), into outputs of any float dtype
  and any strides, for every layout dtype and odd shapes;
- every single-byte corruption and every truncation of a blob is refused (ChunkFormatError) by the chunk format;
- a payload that passes the checksums but was crafted or damaged (the checksum rewritten) is either refused with
  ChunkFormatError or decodes to finite values: never another exception, a crash, a hang or a huge allocation;
- hypothesis fuzzes payload bytes and structured fields.
A hang fails through the suite's per-test timeout (pyproject: --timeout), not through a wall-clock assert.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.codec import registry
from kvfabric.codec.cachegen import CacheGenCodec
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, parse, write_blob
from kvfabric.codec.registry import codec_for_id
from kvfabric.codec.video import VideoCodec
from kvfabric.kv.layout import KVLayout

KEY = bytes(range(32))
CODECS = [(f"{entry.name}-{lvl}", entry.make(lvl)) for entry in registry.CODECS if entry.name != "video"
          for lvl in entry.levels] + \
    [("cachegen-5-g1", CacheGenCodec(5, group_size=1, threads=2))] + \
    [("video-0", VideoCodec(0)), ("video-6", VideoCodec(6)), ("video-9-tile5", VideoCodec(9, tile=5)),
     ("video-6-x264", VideoCodec(6, backend="x264")), ("video-2-x264-10bit", VideoCodec(2, backend="x264", bits=10))]
IDS = [name for name, _ in CODECS]


def kv_like(layout: KVLayout, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """KV with the features that matter: per-channel offsets and scales, an outlier channel, a sink token."""
    g = torch.Generator().manual_seed(seed)
    L, S, H, T, D = layout.shape(num_tokens)
    scale = torch.rand(L, S, H, 1, D, generator=g) * 2 + 0.05
    offset = torch.randn(L, S, H, 1, D, generator=g) * 2
    kv = torch.randn(L, S, H, T, D, generator=g) * scale + offset
    kv[:, 0, :, :, 0] *= 20  # outlier channel in K (or the latent)
    kv[:, :, :, 0, :] *= 5  # sink-like first token
    kv += 0.3 * torch.sin(torch.arange(T, dtype=torch.float32) / 3)[None, None, None, :, None]  # token locality
    return kv.to(layout.torch_dtype)


def bound(codec, kv: torch.Tensor, blob: bytearray, layout: KVLayout) -> torch.Tensor:
    if codec.is_lossless:
        return torch.zeros(kv.shape)
    return codec.error_bound(kv, blob, layout)


def round_trip(codec, kv: torch.Tensor, layout: KVLayout, out: torch.Tensor) -> bytearray:
    blob = codec.encode(kv, KEY, layout)
    header = parse(blob, KEY)
    assert header.codec_id == codec.codec_id
    codec_for_id(header.codec_id).decode(header, memoryview(blob), layout, out)
    return blob


@pytest.mark.parametrize("name,codec", CODECS, ids=IDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_round_trip_within_stated_bound(name, codec, dtype):
    layout = KVLayout(3, 2, 8, dtype)
    for num_tokens in (1, 2, 17, 64):
        kv = kv_like(layout, num_tokens, seed=num_tokens)
        out = torch.full(layout.shape(num_tokens), float("nan"))
        blob = round_trip(codec, kv, layout, out)
        err = (out - kv.float()).abs()
        if codec.is_lossless:
            assert torch.equal(out, kv.float()), f"{name} is lossless but changed values"
        else:
            assert bool((err <= bound(codec, kv, blob, layout)).all()), f"{name}: error {err.max()} above its bound"
        assert torch.isfinite(out).all()


LATENT_CODECS = [(name, codec) for name, codec in CODECS if registry.handles_latent(codec.codec_id)]


@pytest.mark.parametrize("name,codec", LATENT_CODECS, ids=[name for name, _ in LATENT_CODECS])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_latent_round_trip_within_stated_bound(name, codec, dtype):
    """An MLA layout's chunk [L, 1, 1, T, D] (one latent per token) through the codecs that code latents."""
    layout = KVLayout(3, 1, 40, dtype, is_latent=True)
    for num_tokens in (1, 17, 64):
        kv = kv_like(layout, num_tokens, seed=num_tokens)
        out = torch.full(layout.shape(num_tokens), float("nan"))
        blob = round_trip(codec, kv, layout, out)
        assert parse(blob, KEY).shape == (3, 1, 1, num_tokens, 40)
        if codec.is_lossless:
            assert torch.equal(out, kv.float())
        else:
            assert bool(((out - kv.float()).abs() <= bound(codec, kv, blob, layout)).all())


def test_codecs_of_k_and_v_only_never_decode_a_latent_chunk():
    """cachegen and video model K and V: the registry says so, and a latent chunk under their id (a forged header)
    is a ChunkFormatError for the reader, before their decoder runs."""
    from kvfabric.codec.base import Decoders

    assert {e.name for e in registry.CODECS if e.handles_latent} == {"raw", "int8"}
    layout = KVLayout(2, 1, 16, "float16", is_latent=True)
    blob = registry.entry("raw").make().encode(kv_like(layout, 8), KEY, layout)
    header = parse(blob, KEY)
    for entry in registry.CODECS:
        forged = ChunkHeader(entry.codec_id, header.dtype_code, 0, header.fingerprint, header.shape, KEY,
                             header.payload_len)
        if entry.handles_latent:
            continue
        with pytest.raises(ChunkFormatError, match="codes K and V only"):
            Decoders().decode(forged, blob, layout, torch.empty(layout.shape(8)))


@pytest.mark.parametrize("name,codec", CODECS, ids=IDS)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_into_strided_views_of_any_dtype(name, codec, out_dtype):
    layout = KVLayout(2, 3, 8, "float16")
    kv = kv_like(layout, 20, seed=3)
    blob = codec.encode(kv, KEY, layout)
    header = parse(blob, KEY)
    big = torch.zeros(layout.shape(30), dtype=out_dtype)
    codec_for_id(header.codec_id).decode(header, memoryview(blob), layout, big[:, :, :, 5:25, :])
    ref = torch.empty(layout.shape(20))
    codec_for_id(header.codec_id).decode(header, memoryview(blob), layout, ref)
    assert torch.equal(big[:, :, :, 5:25, :], ref.to(out_dtype)), "strided decode differs from contiguous decode"
    assert big[:, :, :, :5].abs().sum() == 0 and big[:, :, :, 25:].abs().sum() == 0, "wrote outside the view"


@pytest.mark.parametrize("name,codec", CODECS, ids=IDS)
def test_encode_accepts_strided_input_of_any_dtype(name, codec):
    layout = KVLayout(2, 2, 8, "float16")
    base = kv_like(layout, 40, seed=5).float()
    strided = base[:, :, :, 10:30, :]  # a view into a longer fp32 buffer, as the engine stores it
    a = codec.encode(strided, KEY, layout)
    b = codec.encode(strided.contiguous().half(), KEY, layout)
    out_a, out_b = torch.empty(layout.shape(20)), torch.empty(layout.shape(20))
    codec.decode(parse(a, KEY), memoryview(a), layout, out_a)
    codec.decode(parse(b, KEY), memoryview(b), layout, out_b)
    if codec.is_lossless:
        assert torch.equal(out_a, out_b)
    else:
        assert bool(((out_a - strided).abs() <= bound(codec, strided, a, layout)).all())


@pytest.mark.parametrize("name,codec", CODECS, ids=IDS)
def test_every_byte_flip_and_truncation_is_refused(name, codec):
    layout = KVLayout(2, 1, 4, "float16")
    blob = bytes(codec.encode(kv_like(layout, 3), KEY, layout))
    for i in range(len(blob)):
        damaged = bytearray(blob)
        damaged[i] ^= 0x40
        with pytest.raises(ChunkFormatError):
            parse(damaged, KEY)
    for n in range(0, len(blob), max(1, len(blob) // 50)):
        with pytest.raises(ChunkFormatError):
            parse(blob[:n], KEY)


def rewrap(blob: bytearray | bytes, payload: bytes | bytearray) -> tuple[ChunkHeader, bytearray]:
    """A blob whose checksums are valid around `payload` (what a hostile writer of the store can make)."""
    h = parse(blob, KEY)
    header = ChunkHeader(h.codec_id, h.dtype_code, h.level, h.fingerprint, h.shape, h.key, len(payload))
    out = bytearray(HEADER_BYTES + len(payload))
    out[HEADER_BYTES:] = payload
    write_blob(header, out)
    return parse(out, KEY), out


def decode_hostile(codec, header: ChunkHeader, blob: bytearray, layout: KVLayout) -> None:
    """Decode must refuse (ChunkFormatError) or return; any other exception fails the test (a hang: the timeout)."""
    out = torch.zeros(header.shape) if header.shape == layout.shape(header.num_tokens) else None
    if out is None:
        return  # the engine checks the header's shape against the layout before any decode
    try:
        codec_for_id(header.codec_id).decode(header, memoryview(blob), layout, out)
    except ChunkFormatError:
        return
    # raw bytes (the raw codec, cachegen's lossless level and its raw segments) may legitimately hold NaN bits;
    # int8 has no way to express one
    assert codec.name != "int8" or not torch.isnan(out).any(), "int8 decoded a NaN"


@pytest.mark.parametrize("name,codec", CODECS, ids=IDS)
def test_crafted_payloads_are_refused_or_harmless(name, codec):
    layout = KVLayout(2, 2, 8, "float16")
    blob = codec.encode(kv_like(layout, 16), KEY, layout)
    payload = bytes(blob[HEADER_BYTES:])
    cases = [b"", payload[:-1], payload[:-4], payload + b"\0", payload + b"\0" * 4, payload[: len(payload) // 2],
             bytes(len(payload)), b"\xff" * len(payload)]
    for i in range(0, len(payload), max(1, len(payload) // 64)):
        for flip in (0x01, 0x80):
            p = bytearray(payload)
            p[i] ^= flip
            cases.append(bytes(p))
    for p in cases:
        header, hostile = rewrap(blob, p)
        decode_hostile(codec, header, hostile, layout)


@pytest.mark.parametrize("name,codec", CODECS, ids=IDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_payload_bytes(name, codec, data):
    layout = KVLayout(2, 1, 8, "float16")
    num_tokens = data.draw(st.integers(1, 24))
    blob = codec.encode(kv_like(layout, num_tokens, seed=num_tokens), KEY, layout)
    payload = bytearray(blob[HEADER_BYTES:])
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["overwrite", "insert", "delete", "truncate"]))
        at = data.draw(st.integers(0, max(0, len(payload) - 1)))
        if kind == "overwrite" and payload:
            patch = data.draw(st.binary(min_size=1, max_size=8))
            payload[at:at + len(patch)] = patch
        elif kind == "insert":
            payload[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del payload[at:at + data.draw(st.integers(1, 8))]
        else:
            del payload[at:]
    header, hostile = rewrap(blob, payload)
    decode_hostile(codec, header, hostile, layout)


@settings(max_examples=60, deadline=None)
@given(codec_id=st.sampled_from([entry.codec_id for entry in registry.CODECS]), level=st.integers(0, 255),
       tokens=st.integers(1, 1 << 20), payload=st.binary(max_size=600))
def test_fuzz_headers_with_random_payloads(codec_id, level, tokens, payload):
    """Random header fields around random payloads: refused or harmless, and no allocation from the header
    (the output buffer is the caller's; a header whose shape does not match it is refused up front)."""
    layout = KVLayout(2, 1, 8, "float16")
    shape = (2, 2, 1, tokens, 8)
    header = ChunkHeader(codec_id, layout.dtype_code, level % 256, layout.fingerprint, shape, KEY, len(payload))
    blob = bytearray(HEADER_BYTES + len(payload))
    blob[HEADER_BYTES:] = payload
    write_blob(header, blob)
    out = torch.zeros(layout.shape(min(tokens, 16)))
    try:
        codec_for_id(codec_id).decode(parse(blob, KEY), memoryview(blob), layout, out)
    except ChunkFormatError:
        return
    assert tokens <= 16
