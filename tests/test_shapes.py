"""Chunk shapes (kvfabric.kv.shapes): a layout with sliding-window layers stores each chunk as a full part and a
window part, and a load reads the window part only of chunks a continuation still reads (over real cpu and disk
tiers); every other layout stores its chunks whole."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from kvfabric import CacheEngine, Config, KVLayout
from kvfabric.cache.protocol import ChunkHit, ChunkMiss, TokenSource
from kvfabric.codec.cachegen import CacheGenCodec
from kvfabric.codec.cachegen import profile as P
from kvfabric.codec.format import parse
from kvfabric.config import DiskTierConfig
from kvfabric.kv.shapes import ChunkPart, ChunkShape, WindowSplit
from kvfabric.kv.shares import shape_of

# layers 0-4 and 6: window of 20 tokens; layer 5: full attention (a Gemma-3-like map)
TYPES = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
LAYOUT = KVLayout.from_layer_types(TYPES, 2, 8, 20, "float32")
CHUNK = 16
SHAPE = shape_of(LAYOUT)
assert isinstance(SHAPE, WindowSplit)


@pytest.fixture
def config(tmp_path):
    return Config(chunk_size=CHUNK, disk=DiskTierConfig(path=str(tmp_path / "chunks")))


def make_kv(num_tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(num_tokens), generator=torch.Generator().manual_seed(seed))


def expected(kv: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """What a continuation after num_tokens needs: full layers whole, window layers from their live start."""
    want = kv[:, :, :, :num_tokens].clone()
    live = SHAPE.first_live_chunk(num_tokens, CHUNK) * CHUNK
    want[list(LAYOUT.window_layers), :, :, :live] = 0
    return want


def test_shapes_of_layouts():
    full, window = SHAPE.full, SHAPE.window
    assert not SHAPE.is_whole and SHAPE.parts == (full, window) and (full.name, window.name) == ("full", "window")
    assert full.layers == (5,) and window.layers == (0, 1, 2, 3, 4, 6)
    assert full.layout.num_layers == 1 and window.layout.num_layers == 6
    assert full.layout.part_of.parent == LAYOUT.fingerprint and window.layout.part_of.parent == LAYOUT.fingerprint
    # a part never shares a fingerprint with a whole layout of its shape, nor with the other part
    assert full.layout.fingerprint != KVLayout(1, 2, 8, "float32").fingerprint != window.layout.fingerprint
    for layout in (KVLayout(4, 2, 8), KVLayout.from_layer_types(["sliding_attention"] * 3, 2, 8, 20)):
        whole = shape_of(layout)  # no window layers, or all of them window layers: stored whole
        assert isinstance(whole, ChunkShape) and whole.is_whole and whole.is_writer
        assert whole.parts == (ChunkPart("whole", layout, tuple(range(layout.num_layers))),)
    key = bytes(range(32))
    assert full.key(key) == key and SHAPE.part_keys(key) == [key, window.key(key)]
    assert len(window.key(key)) == 32 and window.key(key) != key
    # the window part's key is the one chunks stored before shapes were named by: they are still found
    assert window.key(key) == hashlib.sha256(b"kvfabric/window-part\0" + key).digest()[:32]
    # after 64 tokens the window (20) reads positions 45..63: chunks 2 and 3
    assert LAYOUT.live_start(64) == 45 and SHAPE.first_live_chunk(64, CHUNK) == 2
    assert SHAPE.first_needed(window, 64, CHUNK) == 2 and SHAPE.first_needed(full, 64, CHUNK) == 0
    assert SHAPE.parts_for(None) == SHAPE.parts and SHAPE.parts_for([5]) == (full,)
    assert SHAPE.parts_for([5, 0]) == SHAPE.parts


def test_split_put_and_clear_stale_rows():
    kv = make_kv(2 * CHUNK)
    parts = SHAPE.split(kv)
    assert [tuple(p.shape) for p in parts] == [SHAPE.full.layout.shape(2 * CHUNK), SHAPE.window.layout.shape(2 * CHUNK)]
    assert torch.equal(parts[0], kv[[5]]) and torch.equal(parts[1], kv[[0, 1, 2, 3, 4, 6]])
    assert SHAPE.into(kv, SHAPE.full) is None  # a layer subset is not a view
    out = torch.full(LAYOUT.shape(2 * CHUNK), float("nan"), dtype=torch.float64)  # any float dtype
    for part, part_kv in zip(SHAPE.parts, parts):
        SHAPE.put(out, part, part_kv)
    assert torch.equal(out, kv.double())
    SHAPE.clear_stale_rows(out, 2 * CHUNK, CHUNK)  # 32 tokens: window live from 13, chunk 0 -> nothing stale
    assert torch.equal(out, kv.double())
    out = torch.full(LAYOUT.shape(4 * CHUNK), float("nan"))
    SHAPE.clear_stale_rows(out, 4 * CHUNK, CHUNK)  # 64 tokens: window rows of chunks 0, 1 are stale, zeroed
    assert not out[[0, 1, 2, 3, 4, 6], :, :, :2 * CHUNK].any()
    assert out[[0, 1, 2, 3, 4, 6], :, :, 2 * CHUNK:].isnan().all() and out[5].isnan().all()
    whole = shape_of(KVLayout(3, 2, 8, "float32"))
    kv = torch.randn(3, 2, 2, CHUNK, 8)
    assert len(whole.split(kv)) == 1 and whole.split(kv)[0] is kv and whole.into(kv, whole.parts[0]) is kv


def test_live_prefix_shrinks_past_a_missing_window_part():
    present = {0: True, 1: True, 2: False, 3: True, 4: True}
    asked: list[list[int]] = []

    def has(part, chunks):
        assert part is SHAPE.window
        asked.append(list(chunks))
        return [present[i] for i in chunks]

    # 5 chunks (80 tokens) need window parts 3, 4 (live from 61); present. Then 2 missing: ok at 5 chunks.
    assert SHAPE.live_prefix(5, 80, CHUNK, has) == 5
    # 4 chunks need parts 2 and 3: part 2 is missing -> prefix of 2 chunks, which needs parts 0, 1
    asked.clear()
    assert SHAPE.live_prefix(4, 64, CHUNK, has) == 2
    assert asked == [[2, 3], [0, 1]]
    assert SHAPE.live_prefix(4, 64, CHUNK, lambda part, chunks: [False] * len(chunks)) == 0
    assert shape_of(KVLayout(4, 2, 8)).live_prefix(4, 64, CHUNK, lambda part, chunks: [False] * len(chunks)) == 4


@pytest.mark.parametrize("tiers", [["cpu"], ["disk"], ["cpu", "disk"]])
def test_retrieve_reads_only_live_window_parts(config, tiers):
    tokens, kv = list(range(100)), make_kv(100)
    config = Config(chunk_size=CHUNK, tiers=tiers, disk=config.disk)
    with CacheEngine(config, LAYOUT, "m") as engine:
        assert engine.store(tokens, kv) == 6
        engine.flush()
        assert engine.lookup(tokens) == 96
        out = torch.full(LAYOUT.shape(100), float("nan"))
        got = engine.retrieve(tokens[:96], out=out)
        assert got.shape[3] == 96 and torch.equal(got, expected(kv, 96))
        counters = engine.stats().counters
        # live from 77 (chunk 4): window parts 4 and 5 read, 0-3 skipped
        assert counters["window_parts_read"] == 2 and counters["window_parts_skipped"] == 4
        assert torch.equal(engine.retrieve(tokens[:40])[5], kv[5, :, :, :32])  # lookup of 40 -> 2 chunks


def test_missing_window_part_shortens_the_hit_and_store_restores_it(config):
    tokens, kv = list(range(96)), make_kv(96)
    with CacheEngine(config, LAYOUT, "m") as engine:
        engine.store(tokens, kv)
        keys = engine.keys(tokens)
        engine.stack.delete([engine.shape.window.key(keys[4])])  # chunk 4's window part evicted alone
        # 6 chunks need parts 4 and 5 -> the prefix ends before chunk 4; 4 chunks need parts 2 and 3
        assert engine.lookup(tokens) == 64
        got = engine.retrieve(tokens)
        assert got.shape[3] == 64 and torch.equal(got, expected(kv, 64))
        assert engine.store(tokens, kv) == 1  # chunk 4 stored again (its full part was still there)
        assert engine.lookup(tokens) == 96 and torch.equal(engine.retrieve(tokens), expected(kv, 96))


def test_corrupt_window_part_is_a_miss_never_wrong_kv(config):
    tokens, kv = list(range(64)), make_kv(64)
    with CacheEngine(Config(chunk_size=CHUNK, tiers=["disk"], disk=config.disk), LAYOUT, "m") as engine:
        engine.store(tokens, kv)
        engine.flush()
        wkey = engine.shape.window.key(engine.keys(tokens)[3])
        disk = engine.stack.tiers[0]
        blob = bytearray(disk.get(wkey))
        blob[-5] ^= 0xFF
        disk.put(wkey, bytes(blob))
        got = engine.retrieve(tokens)
        assert got.shape[3] == 48 and torch.equal(got, expected(kv, 48))  # 3 chunks need window parts 1, 2
        assert engine.stats().counters.get("corrupt.disk", 0) + engine.stats().counters.get("discarded", 0) >= 1


def test_reads_and_store_chunks_take_whole_chunks(config):
    tokens, kv = list(range(32)), make_kv(32)
    with CacheEngine(config, LAYOUT, "m") as engine:
        assert engine.shape is engine.core.shape and isinstance(engine.shape, WindowSplit)
        keys = engine.keys(tokens)
        payload = engine.new_payload()
        payload.kv.copy_(kv[:, :, :, :CHUNK])
        assert engine.store_chunks([(keys[0], payload)]) == [True]
        assert engine.store_chunks([(keys[0], engine.new_payload())]) == [False]
        assert engine.stack.contains_many(engine.shape.part_keys(keys[0])) == [True, True]  # stored in both parts
        assert engine.holds(keys) == [True, False] and engine.contains(keys) == [True, False]
        for read in (engine.read_chunk, engine.open_chunk):
            hit = read(keys[0])
            assert isinstance(hit, TokenSource) and hit.layers is None
            with hit:
                assert torch.equal(hit.kv, kv[:, :, :, :CHUNK])
            full = read(keys[0], layers=engine.shape.full.layers)  # a reader of the full-attention layers only
            assert isinstance(full, TokenSource) and full.layers == (5,)
            with full:
                assert torch.equal(full.kv, kv[[5], :, :, :CHUNK])
        out = torch.empty(LAYOUT.shape(CHUNK), dtype=torch.float64)
        assert isinstance(engine.read_into(keys[0], out), ChunkHit) and torch.equal(out, kv[:, :, :, :CHUNK].double())
        engine.stack.delete([engine.shape.window.key(keys[0])])
        assert engine.read_chunk(keys[0]) == ChunkMiss("missing")
        assert engine.read_into(keys[0], out) == ChunkMiss("missing")
        assert engine.holds(keys[:1]) == [False] and engine.contains(keys[:1]) == [False]
        full = engine.read_chunk(keys[0], layers=engine.shape.full.layers)  # the full part alone is still there
        assert isinstance(full, TokenSource)
        with full:
            assert torch.equal(full.kv, kv[[5], :, :, :CHUNK])
        engine.store(tokens, kv)
        assert engine.delete(tokens) == 2
        assert not any(engine.stack.contains_many([engine.shape.window.key(k) for k in keys]))


def test_cachegen_slices_the_parent_profile_for_each_part(config, monkeypatch):
    """A part layout codes with its layers' rows of the parent layout's profile (and decodes with them)."""
    num = 2 * LAYOUT.num_layers, LAYOUT.num_kv_heads * LAYOUT.head_dim
    rng = np.random.default_rng(0)
    parent = P.Profile(LAYOUT.fingerprint, 10, 1, rng.integers(-40, -20, num).astype(np.int16),
                       np.full(num, 60, np.int16), np.full(num, 50, np.int16), np.zeros(num, np.uint8), {})
    monkeypatch.setattr(P, "shipped", lambda: {LAYOUT.fingerprint: parent})
    P._part_profile.cache_clear()
    window = SHAPE.window.layout
    sliced = P.for_layout(window)
    assert sliced is not None and sliced.fingerprint == window.fingerprint
    assert np.array_equal(sliced.e_base, parent.e_base[[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13]])
    assert P.by_id(sliced.id, window) is sliced and P.by_id(sliced.id) is None
    codec = CacheGenCodec(level=1)
    window_kv = make_kv(CHUNK)[list(SHAPE.window.layers)]
    blob = codec.encode(window_kv, bytes(32), window)
    out = torch.empty(window.shape(CHUNK))
    codec.decode(parse(blob, bytes(32)), memoryview(blob), window, out)
    assert (out - window_kv).abs().max() < 0.1
    P._part_profile.cache_clear()
