"""Block-layout chunks (kvfabric.kv.blocks, connectors.paged save_blocks / load_blocks, CacheEngine open_chunk(blocks=)):
a chunk saved from a paged layer in layout A loads exactly into a layer of layout B for every pair (and into the
token-major readers), and a damaged block-layout chunk is a miss on disk, in shm and in process memory."""
from __future__ import annotations

import itertools
import os
import uuid

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric import CacheEngine, Config, KVLayout
from kvfabric.cache.protocol import BlockSource, ChunkFailed, ChunkMiss, TokenSource
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, parse, write_blob
from kvfabric.codec.raw import RawCodec
from kvfabric.config import DiskTierConfig, ShmTierConfig
from kvfabric.connectors.paged import CpuPagedLayer
from kvfabric.host.pages import Scratch
from kvfabric.kv.blocks import BlockLayout, BlockLayoutError, as_words, from_tokens, pack, to_tokens, unpack
from kvfabric.tiers.shm import ShmTier

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32")
CHUNK = 32
KEY = bytes(range(32))
ORDERS = list(itertools.product(("td", "dt"), repeat=2))  # (K, V) region orders of vLLM's CPU cache


def paged(orders: tuple[str, str], block_size: int, num_blocks: int = 24, dtype=torch.float32,
          layout: KVLayout = LAYOUT) -> list[CpuPagedLayer]:
    return [CpuPagedLayer(torch.zeros(num_blocks, layout.num_kv_heads, block_size, 2 * layout.head_dim, dtype=dtype),
                          block_size, *orders) for _ in range(layout.num_layers)]


def fill(layers: list[CpuPagedLayer], block_ids: list[int], kv: torch.Tensor) -> None:
    for index, layer in enumerate(layers):
        layer.scatter(block_ids, 0, kv.shape[3], kv[index].to(layer.dtype))


def read_back(layers: list[CpuPagedLayer], block_ids: list[int], start: int, end: int) -> torch.Tensor:
    out = torch.empty(len(layers), 2, layers[0].num_heads, end - start, layers[0].head_dim, dtype=layers[0].dtype)
    for index, layer in enumerate(layers):
        layer.gather(block_ids, start, end, out[index])
    return out


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_tokens", [32, 20, 5])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_conversion_round_trips_exactly(block_size, num_tokens, dtype):
    layout = KVLayout(2, 3, 4, dtype)
    kv = torch.randn(layout.shape(num_tokens), generator=torch.Generator().manual_seed(1)).to(layout.torch_dtype)
    cpu = [BlockLayout(block_size, key_dt, value_dt) for key_dt, value_dt in itertools.product((False, True), repeat=2)]
    gpu = [BlockLayout(block_size, family="vllm", token_major=token_major) for token_major in (False, True)]
    for blocks in cpu + gpu:
        words = {2: np.int16, 4: np.int32}[kv.element_size()]
        payload = np.full(blocks.payload_shape(2, 3, num_tokens, 4), 7, dtype=words)
        from_tokens(as_words(kv), blocks, payload)
        back = torch.empty_like(kv)
        to_tokens(payload, blocks, as_words(back))
        assert torch.equal(back, kv)
        if num_tokens % block_size:  # the partial block's free slots are zero, not left over
            tail = np.asarray(payload[:, -1])
            if blocks.family == "vllm-cpu":  # [L, H, 2, B*D] -> every (K|V, head) region's last slots
                assert (tail.reshape(2, 3, 2, -1) != 7).all()
            else:  # [L, H, B, 2D] or [L, B, H, 2D]: every slot from num_tokens % B on
                by_token = tail if blocks.token_major else tail.swapaxes(1, 2)
                assert (by_token[:, num_tokens % block_size:] == 0).all()


@pytest.mark.parametrize("num_tokens", [32, 20])
@pytest.mark.parametrize("token_major", [False, True])
def test_latent_blocks_round_trip_exactly(num_tokens, token_major):
    """An MLA latent in vLLM's block family: [1, B, D] / [B, 1, D] per block, one state (no K|V halves)."""
    layout = KVLayout(2, 1, 24, "bfloat16", is_latent=True)
    kv = torch.randn(layout.shape(num_tokens), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    blocks = BlockLayout(16, family="vllm", token_major=token_major)
    shape = blocks.payload_shape(2, 1, num_tokens, 24, num_states=1)
    assert shape == (2, 2, *((16, 1) if token_major else (1, 16)), 24)
    payload = np.full(shape, 7, dtype=np.int16)
    from_tokens(as_words(kv), blocks, payload)
    back = torch.empty_like(kv)
    to_tokens(payload, blocks, as_words(back))
    assert torch.equal(back, kv)
    by_token = payload[:, -1].reshape(2, 16, 24)
    assert (by_token[:, num_tokens % 16 or 16:] == 0).all()
    with pytest.raises(BlockLayoutError, match="no latent"):
        BlockLayout(16).block_shape(1, 24, num_states=1)


def test_a_latent_chunk_in_cpu_blocks_is_refused_at_parse():
    """vLLM's CPU blocks hold K and V regions: a header pairing them with a latent shape is damage, a miss."""
    layout = KVLayout(2, 1, 8, "float32", is_latent=True)
    blob = bytearray(RawCodec().encode(torch.zeros(layout.shape(16)), KEY, layout))
    assert parse(blob, KEY).shape[1] == 1
    header = parse(blob, KEY)
    forged = ChunkHeader(header.codec_id, header.dtype_code, 0, header.fingerprint, header.shape, KEY,
                         header.payload_len, BlockLayout(16))
    write_blob(forged, blob)
    with pytest.raises(ChunkFormatError, match="holds K and V"):
        parse(blob, KEY)


def test_descriptor_packs_and_rejects_unknown_bytes():
    for blocks in (None, BlockLayout(16, True, False), BlockLayout(128, False, True)):
        assert unpack(pack(blocks)) == blocks
    raw = bytearray(pack(BlockLayout(16, True, False)))
    for at, value in ((0, 9), (1, 2), (3, 1), (12, 1)):
        bad = bytearray(raw)
        bad[at] = value
        with pytest.raises(BlockLayoutError):
            unpack(bytes(bad))
    with pytest.raises(BlockLayoutError):
        BlockLayout(0, False, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("src,dst", list(itertools.product(ORDERS, ORDERS)))
def test_every_layout_pair_loads_exactly(tmp_path, src, dst, dtype):
    """Saved from a layer in layout `src` (whole blocks, as they are), stored on disk, read back by a fresh engine
    asking for layout `dst`: the payload as it is when they match, converted once when they do not; the KV that
    lands in the destination layer is exactly what the source layer held, and only the loaded slots change."""
    layout = KVLayout(3, 2, 8, "float32" if dtype == torch.float32 else "bfloat16")
    config = Config(chunk_size=CHUNK, tiers=("disk",), disk=DiskTierConfig(path=str(tmp_path)),
                    save_partial_chunk=True)
    num_tokens, block_size = 2 * CHUNK + 12, 8  # two whole chunks and a partial one
    kv = torch.randn(layout.shape(num_tokens), generator=torch.Generator().manual_seed(3)).to(dtype)
    table = [3, 4, 5, 6, 10, 11, 12, 13, 0, 1, 20]  # runs of consecutive blocks and jumps
    source = paged(src, block_size, dtype=dtype, layout=layout)
    fill(source, table, kv)
    tokens = list(range(num_tokens))
    with CacheEngine(config, layout, "m") as engine:
        keys = engine.keys(tokens)
        for i, key in enumerate(keys):
            first, last = i * CHUNK, min(num_tokens, (i + 1) * CHUNK)
            payload = engine.new_payload(last - first, source[0].blocks)
            assert payload.blocks == source[0].blocks and tuple(payload.kv.shape[:2]) == (3, -(-(last - first) // 8))
            for index, layer in enumerate(source):
                layer.save_blocks(table, first, last, as_words(payload.kv[index]))
            assert engine.store_chunks([(key, payload)]) == [True]
    target = paged(dst, block_size, dtype=dtype, layout=layout)
    sentinel = [layer.block_array.copy() for layer in target]
    dst_table = [7, 8, 9, 2, 14, 15, 16, 17, 18, 19, 21]
    with CacheEngine(config, layout, "m") as engine:
        for i, key in enumerate(keys):
            first, last = i * CHUNK, min(num_tokens, (i + 1) * CHUNK)
            lo = first + 8 if i == 1 else first  # a load from a block inside the chunk, as after a prefix hit
            hit = engine.open_chunk(key, num_tokens=last - first, scratch=Scratch(), blocks=target[0].blocks)
            assert isinstance(hit, BlockSource if src == dst else TokenSource)
            digest = xxhash.xxh3_64()
            with hit:  # a BlockSource from disk is hashed as it is copied, its verdict at the exit (none raised)
                for index, layer in enumerate(target):
                    if isinstance(hit, BlockSource):  # read from disk one layer's slab at a time
                        assert hit.blocks == target[0].blocks and hit.is_checked_on_exit
                        slab = hit.slab(index)
                        digest.update(slab)
                        layer.load_blocks(dst_table, lo, last, slab, first)
                    else:
                        layer.scatter(dst_table, lo, last, hit.kv[index, :, :, lo - first:, :])
            if isinstance(hit, BlockSource):  # the slabs handed out are the payload as stored, every byte
                stored = engine.stack.tiers[0].path(key).read_bytes()
                assert parse(stored, key).payload_sum == digest.intdigest()
        # token-major readers (the HF engine, CacheBlend): the converted chunks, exactly
        assert torch.equal(engine.retrieve(tokens), kv)
    got = read_back(target, dst_table, 0, num_tokens)
    loaded = torch.ones(num_tokens, dtype=torch.bool)
    loaded[CHUNK:CHUNK + 8] = False
    assert torch.equal(got[:, :, :, loaded], kv[:, :, :, loaded])
    assert not got[:, :, :, ~loaded].any()  # never loaded: still the zeros the cache started with
    for layer, before in zip(target, sentinel):  # blocks outside the table, and the partial block's free slots
        untouched = [b for b in range(24) if b not in dst_table]
        assert np.array_equal(layer.block_array[untouched], before[untouched])


def store_blocks(engine: CacheEngine, layers: list[CpuPagedLayer], table: list[int], num_tokens: int) -> list[bytes]:
    keys = engine.keys(list(range(num_tokens)))
    for i, key in enumerate(keys):
        first, last = i * CHUNK, min(num_tokens, (i + 1) * CHUNK)
        payload = engine.new_payload(last - first, layers[0].blocks)
        for index, layer in enumerate(layers):
            layer.save_blocks(table, first, last, as_words(payload.kv[index]))
        assert engine.store_chunks([(key, payload)]) == [True]
    engine.flush()
    return keys


def flipped_load(engine: CacheEngine, key: bytes, layers: list[CpuPagedLayer], table: list[int]) -> bool:
    """A loader's read of one chunk with the cache's fastest read (open_chunk: the hash in the copy): True when it
    would be served. A damaged chunk must be a miss, or fail (ChunkFailed "corrupt") by the source's exit."""
    hit = engine.open_chunk(key, num_tokens=CHUNK, scratch=Scratch(), blocks=layers[0].blocks)
    if isinstance(hit, ChunkMiss):
        assert hit.reason in ("corrupt", "missing")
        return False
    assert isinstance(hit, BlockSource)
    try:
        with hit:
            for index, layer in enumerate(layers):
                layer.load_blocks(table, 0, CHUNK, hit.slab(index), 0)
    except ChunkFailed as exc:
        assert exc.miss == ChunkMiss("corrupt")
        return False
    return True


@settings(max_examples=25, deadline=None)
@given(at=st.integers(HEADER_BYTES, HEADER_BYTES + LAYOUT.num_bytes(CHUNK) - 1), bit=st.integers(0, 7))
def test_a_flipped_payload_byte_on_disk_is_a_miss(tmp_path_factory, at, bit):
    path = tmp_path_factory.mktemp("disk")
    config = Config(chunk_size=CHUNK, tiers=("disk",), disk=DiskTierConfig(path=str(path)))
    layers = paged(("dt", "td"), 16)
    fill(layers, list(range(4)), torch.randn(LAYOUT.shape(2 * CHUNK)))
    with CacheEngine(config, LAYOUT, "m") as engine:
        keys = store_blocks(engine, layers, list(range(4)), 2 * CHUNK)
        (chunk,) = [p for p in path.rglob("*.kvc") if keys[0].hex() in p.name]
        data = bytearray(chunk.read_bytes())
        data[at] ^= 1 << bit
        chunk.write_bytes(bytes(data))
        target = paged(("dt", "td"), 16)
        assert not flipped_load(engine, keys[0], target, [0, 1])
        assert flipped_load(engine, keys[1], target, [2, 3])
        assert torch.equal(read_back(target, [2, 3], 0, CHUNK), read_back(layers, [2, 3], 0, CHUNK))
        assert engine.lookup(list(range(2 * CHUNK))) == 0  # the damaged chunk is gone
        assert engine.stats().counters["corrupt.disk"] == 1


def test_a_flipped_byte_in_shm_is_a_miss_and_intact_chunks_are_served():
    name = f"kvf-test-{uuid.uuid4().hex[:8]}"
    config = Config(chunk_size=CHUNK, tiers=("shm",), shm=ShmTierConfig(name=name, capacity=8 << 20))
    layers = paged(("dt", "td"), 16)
    fill(layers, list(range(4)), torch.randn(LAYOUT.shape(2 * CHUNK)))
    try:
        with CacheEngine(config, LAYOUT, "m") as engine:
            keys = store_blocks(engine, layers, list(range(4)), 2 * CHUNK)
            pool = f"/dev/shm/kvfabric-{name}"  # the pool file every process maps: flip a payload byte there
            with open(pool, "r+b") as f:
                data = f.read()
                i = data.find(keys[0])  # the blob's key sits at offset 36 of its header (the index holds it too)
                while data[i - 36:i - 32] != b"KVFC":
                    i = data.find(keys[0], i + 1)
                at = i - 36 + HEADER_BYTES + 100
                f.seek(at)
                f.write(bytes([data[at] ^ 0x10]))
            target = paged(("dt", "td"), 16)
            assert not flipped_load(engine, keys[0], target, [0, 1])
            assert flipped_load(engine, keys[1], target, [2, 3])
            assert torch.equal(read_back(target, [2, 3], 0, CHUNK), read_back(layers, [2, 3], 0, CHUNK))
            assert engine.lookup(list(range(2 * CHUNK))) == 0  # the damaged chunk is gone
    finally:
        ShmTier.destroy(name)


def test_a_version_1_chunk_is_a_clean_miss(tmp_path):
    """A chunk written by kvfabric before the block layouts (format version 1, 92-byte header) is not read: a miss,
    removed, and the prompt is stored again in the current format."""
    import struct
    config = Config(chunk_size=CHUNK, tiers=("disk",), disk=DiskTierConfig(path=str(tmp_path)))
    tokens = list(range(CHUNK))
    kv = torch.randn(LAYOUT.shape(CHUNK))
    with CacheEngine(config, LAYOUT, "m") as engine:
        engine.store(tokens, kv)
        engine.flush()
        key = engine.keys(tokens)[0]
    (path,) = tmp_path.rglob("*.kvc")
    header = parse(path.read_bytes(), key)
    payload = path.read_bytes()[HEADER_BYTES:]
    head = struct.pack("<4sBBBB8s5I32sQQ", b"KVFC", 1, 0, LAYOUT.dtype_code, 0, LAYOUT.fingerprint, *header.shape,
                       key, len(payload), xxhash.xxh3_64_intdigest(payload))
    path.write_bytes(head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + payload)
    with CacheEngine(config, LAYOUT, "m") as engine:
        assert engine.retrieve(tokens).shape[3] == 0
        assert engine.stats().counters["corrupt.disk"] == 1
        assert engine.store(tokens, kv) == 1
        engine.flush()
        assert torch.equal(engine.retrieve(tokens), kv)
    assert parse(path.read_bytes(), key).blocks is None


def test_cpu_tier_chunks_need_no_hash_and_other_codec_tiers_get_token_major_kv(tmp_path):
    """Process memory holds the unsealed blob (nothing to check later); a tier with another codec (int8 on disk)
    encodes the converted [L, 2, H, T, D], and that chunk decodes to the values within int8's error."""
    config = Config(chunk_size=CHUNK, tiers=("cpu", "disk"), disk=DiskTierConfig(path=str(tmp_path), codec="int8"))
    layers = paged(("dt", "td"), 16)
    kv = torch.randn(LAYOUT.shape(CHUNK))
    fill(layers, [0, 1], kv)
    with CacheEngine(config, LAYOUT, "m") as engine:
        (key,) = store_blocks(engine, layers, [0, 1], CHUNK)
        hit = engine.open_chunk(key, num_tokens=CHUNK, blocks=layers[0].blocks)
        assert isinstance(hit, BlockSource) and hit.tier == "cpu" and not hit.is_checked_on_exit
        with hit:
            for index in range(LAYOUT.num_layers):
                hit.slab(index)
        assert hit.check_ns == 0  # nothing hashed
        engine.clear_tier("cpu")
        got = engine.retrieve(list(range(CHUNK)))
    assert got.shape == kv.shape and (got - kv).abs().max() < 0.05
    assert os.path.exists(tmp_path)


def test_a_truncated_block_layout_chunk_on_disk_is_a_miss(tmp_path):
    config = Config(chunk_size=CHUNK, tiers=("disk",), disk=DiskTierConfig(path=str(tmp_path)))
    layers = paged(("dt", "td"), 16)
    fill(layers, list(range(2)), torch.randn(LAYOUT.shape(CHUNK)))
    with CacheEngine(config, LAYOUT, "m") as engine:
        (key,) = store_blocks(engine, layers, list(range(2)), CHUNK)
        (path,) = tmp_path.rglob("*.kvc")
        path.write_bytes(path.read_bytes()[:-1000])
        assert not flipped_load(engine, key, paged(("dt", "td"), 16), [0, 1])
        assert engine.stats().counters["corrupt.disk"] == 1 and not path.exists()
