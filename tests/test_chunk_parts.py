"""Chunk parts: a layout with sliding-window layers stores each chunk as a full part and a window part, and a load
reads the window part only of chunks a continuation still reads (over real cpu and disk tiers)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfabric import CacheEngine, Config, KVLayout
from kvfabric.chunk_parts import ChunkParts
from kvfabric.codec.cachegen import CacheGenCodec
from kvfabric.codec.cachegen import profile as P
from kvfabric.codec.format import parse
from kvfabric.config import DiskTierConfig
from kvfabric.kvcache import ChunkHit, ChunkMiss

# layers 0-4 and 6: window of 20 tokens; layer 5: full attention (a Gemma-3-like map)
TYPES = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
LAYOUT = KVLayout.from_layer_types(TYPES, 2, 8, 20, "float32")
CHUNK = 16


@pytest.fixture
def config(tmp_path):
    return Config(chunk_size=CHUNK, disk=DiskTierConfig(path=str(tmp_path / "chunks")))


def make_kv(num_tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(num_tokens), generator=torch.Generator().manual_seed(seed))


def expected(kv: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """What a continuation after num_tokens needs: full layers whole, window layers from their live start."""
    want = kv[:, :, :, :num_tokens].clone()
    live = ChunkParts.of(LAYOUT).first_live_chunk(num_tokens, CHUNK) * CHUNK
    want[list(LAYOUT.window_layers), :, :, :live] = 0
    return want


def test_parts_of_layouts():
    parts = ChunkParts.of(LAYOUT)
    assert parts.full_layers == (5,) and parts.window_layers == (0, 1, 2, 3, 4, 6)
    assert parts.full.num_layers == 1 and parts.window.num_layers == 6
    assert parts.full.part_of.parent == LAYOUT.fingerprint
    # a part never shares a fingerprint with a whole layout of its shape, nor with the other part
    assert parts.full.fingerprint != KVLayout(1, 2, 8, "float32").fingerprint != parts.window.fingerprint
    assert ChunkParts.of(KVLayout(4, 2, 8)) is None  # no window layers: stored whole
    assert ChunkParts.of(KVLayout.from_layer_types(["sliding_attention"] * 3, 2, 8, 20)) is None  # all window
    key = bytes(range(32))
    assert len(parts.window_key(key)) == 32 and parts.window_key(key) != key
    # after 64 tokens the window (20) reads positions 45..63: chunks 2 and 3
    assert LAYOUT.live_start(64) == 45 and parts.first_live_chunk(64, CHUNK) == 2


def test_live_prefix_shrinks_past_a_missing_window_part():
    parts = ChunkParts.of(LAYOUT)
    present = {0: True, 1: True, 2: False, 3: True, 4: True}
    asked: list[list[int]] = []

    def has(chunks):
        asked.append(list(chunks))
        return [present[i] for i in chunks]

    # 5 chunks (80 tokens) need window parts 3, 4 (live from 61); present. Then 2 missing: ok at 5 chunks.
    assert parts.live_prefix(5, 80, CHUNK, has) == 5
    # 4 chunks need parts 2 and 3: part 2 is missing -> prefix of 2 chunks, which needs parts 0, 1
    asked.clear()
    assert parts.live_prefix(4, 64, CHUNK, has) == 2
    assert asked == [[2, 3], [0, 1]]
    assert parts.live_prefix(4, 64, CHUNK, lambda chunks: [False] * len(chunks)) == 0


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
        engine.stack.delete([ChunkParts.window_key(keys[4])])  # chunk 4's window part evicted alone
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
        wkey = ChunkParts.window_key(engine.keys(tokens)[3])
        disk = engine.stack.tiers[0]
        blob = bytearray(disk.get(wkey))
        blob[-5] ^= 0xFF
        disk.put(wkey, bytes(blob))
        got = engine.retrieve(tokens)
        assert got.shape[3] == 48 and torch.equal(got, expected(kv, 48))  # 3 chunks need window parts 1, 2
        assert engine.stats().counters.get("corrupt.disk", 0) + engine.stats().counters.get("discarded", 0) >= 1


def test_read_chunk_and_store_chunk_take_whole_chunks(config):
    tokens, kv = list(range(32)), make_kv(32)
    with CacheEngine(config, LAYOUT, "m") as engine:
        keys = engine.keys(tokens)
        payload = engine.new_payload()
        payload.kv.copy_(kv[:, :, :, :CHUNK])
        assert engine.store_chunk(keys[0], payload) and not engine.store_chunk(keys[0], engine.new_payload())
        hit = engine.read_chunk(keys[0])
        assert isinstance(hit, ChunkHit) and torch.equal(hit.kv, kv[:, :, :, :CHUNK])
        out = torch.empty(LAYOUT.shape(CHUNK), dtype=torch.float64)
        assert isinstance(engine.read_chunk(keys[0], out), ChunkHit) and torch.equal(out, kv[:, :, :, :CHUNK].double())
        engine.stack.delete([ChunkParts.window_key(keys[0])])
        assert engine.read_chunk(keys[0]) == ChunkMiss("missing")
        engine.store(tokens, kv)
        assert engine.delete(tokens) == 2
        assert not any(engine.stack.contains_many([ChunkParts.window_key(k) for k in keys]))


def test_cachegen_slices_the_parent_profile_for_each_part(config, monkeypatch):
    """A part layout codes with its layers' rows of the parent layout's profile (and decodes with them)."""
    num = 2 * LAYOUT.num_layers, LAYOUT.num_kv_heads * LAYOUT.head_dim
    rng = np.random.default_rng(0)
    parent = P.Profile(LAYOUT.fingerprint, 10, 1, rng.integers(-40, -20, num).astype(np.int16),
                       np.full(num, 60, np.int16), np.full(num, 50, np.int16), np.zeros(num, np.uint8), {})
    monkeypatch.setattr(P, "shipped", lambda: {LAYOUT.fingerprint: parent})
    P._part_profile.cache_clear()
    parts = ChunkParts.of(LAYOUT)
    sliced = P.for_layout(parts.window)
    assert sliced is not None and sliced.fingerprint == parts.window.fingerprint
    assert np.array_equal(sliced.e_base, parent.e_base[[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13]])
    assert P.by_id(sliced.id, parts.window) is sliced and P.by_id(sliced.id) is None
    codec = CacheGenCodec(level=1)
    window_kv = make_kv(CHUNK)[list(parts.window_layers)]
    blob = codec.encode(window_kv, bytes(32), parts.window)
    out = torch.empty(parts.window.shape(CHUNK))
    codec.decode(parse(blob, bytes(32)), memoryview(blob), parts.window, out)
    assert (out - window_kv).abs().max() < 0.1
    P._part_profile.cache_clear()
