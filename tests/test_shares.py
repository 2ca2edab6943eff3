"""kvfabric.kv.shares: what each rank of a tensor- and pipeline-parallel engine holds (vLLM's rules), and engines of
any parallel shape reading what any other stored, in the model's key space: a share is read from its own part,
the whole chunk, or the parts of another shape, cut to its rows; a share that is missing ends the prefix there."""
from __future__ import annotations

import pytest
import torch

from kvfabric import CacheEngine, Config
from kvfabric.cache.protocol import ChunkMiss, TokenSource
from kvfabric.kv.layout import KVLayout
from kvfabric.kv.shares import Share, grid, rank_heads, rank_share, shape_of, stage_layers

MODEL = KVLayout(num_layers=6, num_kv_heads=4, head_dim=8, dtype="float16")
CHUNK = 16
TOKENS = list(range(100, 100 + 3 * CHUNK))


def _config(tmp_path) -> Config:
    return Config.from_dict({"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})


def _kv(seed: int = 0) -> torch.Tensor:
    return torch.randn(MODEL.shape(len(TOKENS)), generator=torch.Generator().manual_seed(seed)).half()


def _cut(kv: torch.Tensor, share: Share) -> torch.Tensor:
    return kv[slice(*share.layers), :, slice(*share.heads)]


def _engines(tmp_path, pp: int, tp: int) -> list[CacheEngine]:
    return [CacheEngine(_config(tmp_path), MODEL, "m", share=rank_share(MODEL, s, pp, r, tp), parallel=(pp, tp))
            for s in range(pp) for r in range(tp)]


def test_stages_split_layers_as_vllm_does():
    assert [stage_layers(24, s, 2) for s in range(2)] == [(0, 12), (12, 24)]
    assert [stage_layers(25, s, 4) for s in range(4)] == [(0, 6), (6, 12), (12, 19), (19, 25)]  # remainder: [-2]
    assert [stage_layers(26, s, 4) for s in range(4)] == [(0, 6), (6, 13), (13, 20), (20, 26)]
    with pytest.raises(ValueError):
        stage_layers(2, 0, 4)


def test_heads_split_or_replicate_with_one_writer():
    assert [rank_heads(4, r, 2) for r in range(2)] == [((0, 2), True), ((2, 4), True)]
    assert [rank_heads(1, r, 2) for r in range(2)] == [((0, 1), True), ((0, 1), False)]  # Gemma-3-270m at TP=2
    assert [rank_heads(2, r, 4) for r in range(4)] == [((0, 1), True), ((0, 1), False), ((1, 2), True),
                                                       ((1, 2), False)]
    with pytest.raises(ValueError):
        rank_heads(4, 0, 3)
    assert len(grid(MODEL, 2, 8)) == 8  # more ranks than heads: each head once per stage


def test_a_share_layout_names_its_parent_layers_and_heads():
    share = rank_share(MODEL, 1, 2, 1, 2).layout(MODEL)
    assert share.shape(5) == (3, 2, 2, 5, 8)
    assert share.part_of is not None and share.part_of.heads == (2, 4) and share.part_of.layers == (3, 4, 5)
    assert share.fingerprint != MODEL.part((3, 4, 5)).fingerprint != MODEL.fingerprint


@pytest.mark.parametrize("pp,tp", [(1, 2), (2, 1), (2, 2), (1, 4)])
def test_shares_stored_by_one_shape_read_whole_by_a_single_engine(tmp_path, pp, tp):
    kv = _kv()
    ranks = _engines(tmp_path, pp, tp)
    for engine in ranks:
        assert engine.store(TOKENS, _cut(kv, engine.core.shape.share)) == 3
        engine.flush()
    with CacheEngine(_config(tmp_path), MODEL, "m") as whole:
        assert whole.lookup(TOKENS) == 3 * CHUNK
        assert torch.equal(whole.retrieve(TOKENS), kv)
        out = torch.empty(MODEL.shape(CHUNK), dtype=torch.float16)
        assert not isinstance(whole.read_into(whole.keys(TOKENS)[1], out), ChunkMiss)
        assert torch.equal(out, kv[:, :, :, CHUNK:2 * CHUNK])
        assert whole.stats().counters["share_assembled_chunks"] >= 3
    for engine in ranks:
        engine.close()


@pytest.mark.parametrize("pp,tp", [(1, 2), (2, 2), (2, 4)])
def test_a_whole_chunk_read_by_each_rank_of_another_shape(tmp_path, pp, tp):
    kv = _kv(1)
    with CacheEngine(_config(tmp_path), MODEL, "m") as whole:
        assert whole.store(TOKENS, kv) == 3
    for engine in _engines(tmp_path, pp, tp):
        share = engine.core.shape.share
        assert engine.layout.shape(1)[:3] == (share.layers[1] - share.layers[0], 2, share.heads[1] - share.heads[0])
        assert engine.lookup(TOKENS) == 3 * CHUNK
        assert torch.equal(engine.retrieve(TOKENS), _cut(kv, share))
        source = engine.open_chunk(engine.keys(TOKENS)[2])
        assert isinstance(source, TokenSource)
        with source:
            assert torch.equal(source.kv, _cut(kv, share)[:, :, :, 2 * CHUNK:])
        engine.close()


def test_tp2_stores_read_by_pp2_stages(tmp_path):
    """Another grid: stage s of a PP=2 engine takes its layers from both TP=2 shares."""
    kv = _kv(2)
    for engine in _engines(tmp_path, 1, 2):
        engine.store(TOKENS, _cut(kv, engine.core.shape.share))
        engine.close()
    for engine in _engines(tmp_path, 2, 1):
        assert torch.equal(engine.retrieve(TOKENS), _cut(kv, engine.core.shape.share))
        engine.close()


def test_a_missing_share_ends_the_prefix_for_every_reader(tmp_path):
    kv = _kv(3)
    ranks = _engines(tmp_path, 1, 2)
    for engine in ranks:
        engine.store(TOKENS, _cut(kv, engine.core.shape.share))
        engine.flush()
    keys = ranks[1].keys(TOKENS)
    stored = ranks[1].core.shape.parts[0].key(keys[1])
    ranks[1].stack.delete([stored])  # rank 1's share of chunk 1, from every tier
    assert ranks[0].lookup(TOKENS) == 3 * CHUNK and ranks[1].lookup(TOKENS) == CHUNK
    with CacheEngine(_config(tmp_path), MODEL, "m") as whole:
        assert whole.lookup(TOKENS) == CHUNK  # chunk 1 misses a share: neither it nor chunk 2 is promised
        assert torch.equal(whole.retrieve(TOKENS), kv[:, :, :, :CHUNK])
        assert isinstance(whole.read_into(keys[1], torch.empty(MODEL.shape(CHUNK), dtype=torch.float16)), ChunkMiss)
    for engine in ranks:
        engine.close()


def test_a_writer_skips_what_another_shape_holds_in_a_few_questions(tmp_path):
    """A single engine storing a prompt that TP=2 ranks stored: held for every chunk, in a few questions (not one
    per way and chunk); chunks past the stored ones are written; and where another way holds a later chunk but not
    the first missing one, that chunk is written once more (a duplicate, never a chunk lost)."""
    kv = _kv(4)
    ranks = _engines(tmp_path, 1, 2)
    for engine in ranks:
        engine.store(TOKENS[:2 * CHUNK], _cut(kv, engine.core.shape.share)[:, :, :, :2 * CHUNK])
        engine.flush()
    with CacheEngine(_config(tmp_path), MODEL, "m") as whole:
        shape, keys, asked = whole.core.shape, whole.keys(TOKENS), []

        def has(found: list[bytes]) -> list[bool]:
            asked.append(len(found))
            return whole.stack.contains_many(found, writable_only=True)
        assert shape.held(keys, has) == [True, True, False] == shape.present(keys, has)[:3]
        asked.clear()
        shape.held(keys, has)
        assert len(asked) <= 2 + 2 and sum(asked) < sum(len(w) for w in shape.alternatives) * len(keys)
        assert whole.store(TOKENS, kv) == 1  # only chunk 2, which no shape held
        whole.stack.delete([ranks[0].core.shape.parts[0].key(keys[0])])  # TP rank 0's share of chunk 0
        whole.stack.delete([keys[2]])
        assert shape.present(keys, has)[:2] == [False, True]  # chunk 1 is still held by the TP=2 shares
        assert shape.held(keys, has)[:2] == [False, False]
    for engine in ranks:
        engine.close()


def test_a_replica_reads_and_never_writes(tmp_path):
    one_head = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16")
    kv = torch.randn(one_head.shape(len(TOKENS))).half()
    first, replica = (CacheEngine(_config(tmp_path), one_head, "m", share=rank_share(one_head, 0, 1, r, 2),
                                  parallel=(1, 2)) for r in range(2))
    assert not replica.core.shape.is_writer and replica.store(TOKENS, kv) == 0
    assert replica.lookup(TOKENS) == 0
    assert first.store(TOKENS, kv) == 3
    first.flush()
    assert torch.equal(replica.retrieve(TOKENS), kv)  # the same share: the writer's chunks, whole
    first.close()
    replica.close()


def test_a_window_layout_is_not_split_by_heads():
    gemma = KVLayout.from_layer_types(["sliding_attention", "full_attention"], 2, 8, 512)
    with pytest.raises(ValueError, match="sliding-window"):
        shape_of(gemma, rank_share(gemma, 0, 1, 0, 2), (1, 2))
    assert not shape_of(gemma, Share((0, 2), (0, 2), is_writer=False)).is_writer


def test_a_damaged_share_read_by_another_shape_is_a_miss(tmp_path):
    """The assembled read checks every stored part it cuts from: a flipped byte in rank 1's share of chunk 1 on disk
    makes chunk 1 a miss for a single engine (read and retrieve), never KV."""
    kv = _kv(5)
    for engine in _engines(tmp_path, 1, 2):
        engine.store(TOKENS, _cut(kv, engine.core.shape.share))
        engine.close()  # written to disk; process memory goes with it
    share = rank_share(MODEL, 0, 1, 1, 2)
    with CacheEngine(_config(tmp_path), MODEL, "m") as whole:
        keys = whole.keys(TOKENS)
        stored = shape_of(MODEL, share, (1, 2)).parts[0].key(keys[1]).hex()
        (path,) = [p for p in tmp_path.rglob(f"{stored}*")]
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x40  # in the payload
        path.write_bytes(bytes(data))
        assert isinstance(whole.read_into(keys[1], torch.empty(MODEL.shape(CHUNK), dtype=torch.float16)), ChunkMiss)
        assert torch.equal(whole.retrieve(TOKENS), kv[:, :, :, :CHUNK])  # chunk 0 only
