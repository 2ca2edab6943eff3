"""PagedMover: the worker-side data path for vLLM's GPU layouts, run here on CPU tensors in those layouts, direct
and through the staging buffers a CUDA stream uses (CpuCopyStream(staged=True): the same code as on CUDA but
for the stream and pinned-memory calls). Chunks saved from one layout load exactly into every other, through the
cpu and disk tiers; a miss loads nothing, and a damaged chunk's load fails (the blocks asked for are recomputed)."""
from __future__ import annotations

import itertools

import pytest
import torch

from kvfabric import CacheEngine, Config, KVLayout
from kvfabric.cache.protocol import BlockSource
from kvfabric.config import DiskTierConfig
from kvfabric.connectors.copy_stream import CpuCopyStream
from kvfabric.connectors.paged_mover import ChunkRead, PagedMover
from kvfabric.connectors.paged_views import LAYOUTS, DeviceLayer, PagedSpec, layer_views

BLOCK, CHUNK = 16, 48
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
# an MLA model's cache (DeepSeek-V3: one 576-wide latent per token and layer), narrowed to keep the test small
LATENT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=24, dtype="bfloat16", is_latent=True)


def make_views(layout: str, seed: int, kv: KVLayout = LAYOUT) -> list[torch.Tensor]:
    spec = PagedSpec(layout, "latent" if kv.is_latent else "kv", kv.num_layers, 16, kv.num_kv_heads, BLOCK,
                     kv.head_dim, torch.bfloat16)
    views = layer_views(torch.empty(spec.num_bytes, dtype=torch.uint8), spec)
    generator = torch.Generator().manual_seed(seed)
    for view in views:
        view.copy_(torch.randn(view.shape, generator=generator))
    return views


def tokens_of(views: list[torch.Tensor], block_ids: list[int], start: int, end: int,
              kv: KVLayout = LAYOUT) -> torch.Tensor:
    out = torch.empty(kv.shape(end - start), dtype=torch.bfloat16)
    for index, view in enumerate(views):
        # tokens only: a copy of tokens reads the logical view, whatever the layout's block order
        DeviceLayer.of(view, "LBHNC", "latent" if kv.is_latent else "kv").gather(block_ids, start, end, out[index])
    return out


@pytest.fixture(params=["cpu", "disk"])
def config(request, tmp_path):
    if request.param == "cpu":
        return Config(chunk_size=CHUNK, tiers=("cpu",), save_partial_chunk=True)
    return Config(chunk_size=CHUNK, tiers=("disk",), disk=DiskTierConfig(path=str(tmp_path)), save_partial_chunk=True)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("source,target", [(a, b) for a, b in itertools.product(LAYOUTS, LAYOUTS)
                                           if a == b or (a, b) in {("LBNHC", "LBHNC"), ("BLHNC", "LBNHC"),
                                                                   ("LHBNC", "BLNHC"), ("BHLNC", "LBHNC")}])
def test_saved_chunks_load_exactly_into_other_blocks_and_layouts(config, source, target, staged):
    tokens = list(range(CHUNK + 20))  # a whole chunk and a partial one
    src_ids, dst_ids = [3, 4, 5, 9, 10], [12, 13, 0, 1, 2]
    src_views, dst_views = make_views(source, seed=1), make_views(target, seed=2)
    with CacheEngine(config, LAYOUT, "m") as engine:
        stream = CpuCopyStream(staged=staged)
        mover = PagedMover(engine, src_views, source, stream)
        keys = engine.keys(tokens)
        jobs = [mover.save(key, src_ids, i * CHUNK, min(len(tokens), (i + 1) * CHUNK)) for i, key in enumerate(keys)]
        assert all(job.is_done() for job in jobs) and [job.finish() for job in jobs] == [True, True]
        assert mover.save(keys[0], src_ids, 0, CHUNK).finish() is False  # held already
        engine.flush()
        # loads through another stream: a staging buffer the save left (with the same bytes) must not hide a bug
        loads = CpuCopyStream(staged=staged)
        if config.tiers == ("cpu",):
            _load_all(PagedMover(engine, dst_views, target, loads), keys, dst_ids, len(tokens))
        else:
            with CacheEngine(config, LAYOUT, "m") as fresh:  # another process, from disk
                _load_all(PagedMover(fresh, dst_views, target, loads), keys, dst_ids, len(tokens))
        assert stream.num_over_budget == loads.num_over_budget == 0
    assert torch.equal(tokens_of(dst_views, dst_ids, 0, len(tokens)), tokens_of(src_views, src_ids, 0, len(tokens)))


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("source", list(LAYOUTS))
def test_mla_latents_load_exactly_into_every_layout(config, source, staged):
    """The MLA backends' one-latent caches ([B, 1, N, D]): a chunk saved in one layout loads into every other, and a
    token-major latent chunk (another engine's, [L, 1, 1, T, D]) loads too."""
    tokens = list(range(CHUNK + 20))
    src_ids, dst_ids = [3, 4, 5, 9, 10], [12, 13, 0, 1, 2]
    src_views = make_views(source, seed=21, kv=LATENT)
    expected = tokens_of(src_views, src_ids, 0, len(tokens), kv=LATENT)
    with CacheEngine(config, LATENT, "m") as engine:
        mover = PagedMover(engine, src_views, source, CpuCopyStream(staged=staged))
        assert mover.block_layout.block_shape(1, LATENT.head_dim, 1)[-1] == LATENT.head_dim
        keys = engine.keys(tokens)
        jobs = [mover.save(key, src_ids, i * CHUNK, min(len(tokens), (i + 1) * CHUNK)) for i, key in enumerate(keys)]
        assert [job.finish() for job in jobs] == [True, True]
        engine.flush()
    fresh = config if config.tiers == ("disk",) else Config(chunk_size=CHUNK, tiers=("cpu",), save_partial_chunk=True)
    with CacheEngine(fresh, LATENT, "m") as engine:
        if config.tiers == ("cpu",):  # another engine's token-major chunks in a fresh process memory
            assert engine.store(tokens, expected) == 2
            engine.flush()
        for target in LAYOUTS:
            dst_views = make_views(target, seed=22, kv=LATENT)
            _load_all(PagedMover(engine, dst_views, target, CpuCopyStream(staged=staged)), keys, dst_ids, len(tokens))
            assert torch.equal(tokens_of(dst_views, dst_ids, 0, len(tokens), kv=LATENT), expected), target


def _load_all(mover: PagedMover, keys: list[bytes], block_ids: list[int], num_tokens: int) -> None:
    for i, key in enumerate(keys):
        first = i * CHUNK
        start = first + BLOCK if i == 0 else first  # a load from a block inside a chunk, as after a prefix hit
        end = min(num_tokens, first + CHUNK)
        job = mover.load(key, block_ids, start, end, first=first, chunk_tokens=end - first)
        assert job is not None
        job.done.hold_compute()
        job.finish()
    # the first block was not asked for: load it too, from its own chunk, to compare the whole range
    mover.load(keys[0], block_ids, 0, BLOCK, first=0, chunk_tokens=CHUNK).finish()


def test_a_miss_loads_nothing_and_a_damaged_chunk_fails_its_load(tmp_path):
    """A miss writes nothing. A damaged chunk is found while it is copied (open_chunk's check at the source's exit):
    the load answers None (vLLM recomputes the blocks asked for), the chunk is discarded and counted, and no block
    outside the ones asked for is written."""
    config = Config(chunk_size=CHUNK, tiers=("disk",), disk=DiskTierConfig(path=str(tmp_path)))
    views = make_views("LBNHC", seed=3)
    tokens = list(range(CHUNK))
    with CacheEngine(config, LAYOUT, "m") as engine:
        mover = PagedMover(engine, views, "LBNHC", CpuCopyStream())
        (key,) = engine.keys(tokens)
        assert mover.load(key, [0, 1, 2], 0, CHUNK, first=0, chunk_tokens=CHUNK) is None
        assert mover.save(key, [0, 1, 2], 0, CHUNK).finish()
        engine.flush()
    (path,) = tmp_path.rglob("*.kvc")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.write_bytes(bytes(data))
    target = make_views("LBNHC", seed=4)
    before = [view.clone() for view in target]
    with CacheEngine(config, LAYOUT, "m") as engine:
        mover = PagedMover(engine, target, "LBNHC", CpuCopyStream())
        assert mover.load(b"\1" * 32, [5, 6, 7], 0, CHUNK, first=0, chunk_tokens=CHUNK) is None  # a miss
        assert all(torch.equal(a, b) for a, b in zip(target, before))  # wrote nothing
        assert mover.load(key, [5, 6, 7], 0, CHUNK, first=0, chunk_tokens=CHUNK) is None  # damaged: failed
        assert engine.stats().counters["corrupt.disk"] == 1 and not path.exists()
        assert engine.lookup(tokens) == 0
        assert mover.load(key, [5, 6, 7], 0, CHUNK, first=0, chunk_tokens=CHUNK) is None  # gone: a miss now
    untouched = [b for b in range(16) if b not in (5, 6, 7)]
    assert all(torch.equal(a[untouched], b[untouched]) for a, b in zip(target, before))


def test_views_of_another_model_and_ranges_outside_the_chunk_are_refused():
    with CacheEngine(Config(chunk_size=CHUNK, tiers=("cpu",)), LAYOUT, "m") as engine:
        with pytest.raises(ValueError, match="1 layer views for a 2-layer model"):
            PagedMover(engine, make_views("LBHNC", seed=5)[:1], "LBHNC", CpuCopyStream())
        with pytest.raises(ValueError, match="1 layers. KV cache groups for 2 layer views"):
            PagedMover(engine, make_views("LBHNC", seed=5), "LBHNC", CpuCopyStream(), layer_groups=[0])
        mover = PagedMover(engine, make_views("LBHNC", seed=5), "LBHNC", CpuCopyStream())
        with pytest.raises(ValueError, match="not in the chunk"):
            mover.load(b"k" * 32, [0, 1, 2, 3], 0, CHUNK + 1, first=0, chunk_tokens=CHUNK)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_stale_slots_past_a_partial_chunk_are_never_stored(layout, staged):
    from kvfabric.host.pages import Scratch

    views = make_views(layout, seed=9)  # every slot holds (stale) values, past the 20 tokens too
    with CacheEngine(Config(chunk_size=CHUNK, tiers=("cpu",), save_partial_chunk=True), LAYOUT, "m") as engine:
        mover = PagedMover(engine, views, layout, CpuCopyStream(staged=staged))
        (key,) = engine.keys(list(range(20)))
        assert mover.save(key, [4, 5], 0, 20).finish()
        hit = engine.read_chunk(key, num_tokens=20, scratch=Scratch(), blocks=mover.block_layout)
        assert isinstance(hit, BlockSource) and hit.blocks == mover.block_layout
        axis = mover.layers[0].blocks.token_axis
        with hit:
            for index in range(LAYOUT.num_layers):
                last = torch.from_numpy(hit.slab(index)).view(torch.bfloat16)[-1]
                assert not last.narrow(axis, 4, BLOCK - 4).any() and last.narrow(axis, 0, 4).any()


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("source,target", [("BLHNC", "LBNHC"), ("LBHNC", "LBHNC")])
def test_a_layered_load_lands_layer_by_layer_and_stops_at_a_miss(tmp_path, source, target, staged):
    """`load_layered`: every chunk read and staged first, then one CopyDone per layer covering every chunk; a
    token-major chunk (another engine's) and a block-layout one alike; reads after a missing chunk load nothing."""
    config = Config(chunk_size=CHUNK, tiers=("disk",), disk=DiskTierConfig(path=str(tmp_path)), save_partial_chunk=True)
    tokens = list(range(2 * CHUNK + 20))
    src_views, dst_views = make_views(source, seed=11), make_views(target, seed=12)
    src_ids, dst_ids = [3, 4, 5, 9, 10, 11, 14, 15], [12, 13, 0, 1, 2, 6, 7, 8]
    before = tokens_of(dst_views, dst_ids, 0, len(tokens))
    with CacheEngine(config, LAYOUT, "m") as engine:
        keys = engine.keys(tokens)
        mover = PagedMover(engine, src_views, source, CpuCopyStream())
        assert mover.save(keys[0], src_ids, 0, CHUNK).finish()
        engine.store(tokens[:2 * CHUNK], tokens_of(src_views, src_ids, 0, 2 * CHUNK))  # chunk 1 token-major too
        assert mover.save(keys[2], src_ids, 2 * CHUNK, len(tokens)).finish()
        engine.flush()
    with CacheEngine(config, LAYOUT, "m") as engine:
        stream = CpuCopyStream(staged=staged)
        mover = PagedMover(engine, dst_views, target, stream)
        reads = [ChunkRead(keys[0], 0, BLOCK, CHUNK, CHUNK), ChunkRead(keys[1], CHUNK, CHUNK, 2 * CHUNK, CHUNK),
                 ChunkRead(keys[2], 2 * CHUNK, 2 * CHUNK, len(tokens), 20)]
        load = mover.load_layered(reads, dst_ids)
        assert load.num_read == 3 and len(load.layer_done) == LAYOUT.num_layers and set(load.by_tier) == {"disk"}
        for done in load.layer_done:
            done.hold_compute()
        load.finish()
        assert torch.equal(tokens_of(dst_views, dst_ids, BLOCK, len(tokens)),
                           tokens_of(src_views, src_ids, BLOCK, len(tokens)))
        assert torch.equal(tokens_of(dst_views, dst_ids, 0, BLOCK), before[:, :, :, :BLOCK])
        missing = ChunkRead(b"\1" * 32, 0, 0, CHUNK, CHUNK)
        fresh = make_views(target, seed=13)
        untouched = [view.clone() for view in fresh]
        load = PagedMover(engine, fresh, target, stream).load_layered([missing, reads[1]], dst_ids)
        load.finish()
        assert load.num_read == 0 and all(torch.equal(a, b) for a, b in zip(fresh, untouched))
        assert stream.num_over_budget == 0


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("source,target", [("LBHNC", "LBHNC"), ("BLNHC", "LBNHC")])
def test_each_group_moves_through_its_own_table_and_a_window_layer_loads_from_window_from(config, source, target,
                                                                                         staged):
    """vLLM's hybrid manager: layer 0 in a window group (0), layer 1 in a full-attention group (1), each group
    with its own block table; a load puts the window layer in only from window_from (whole blocks as stored, or
    converted token-major)."""
    tables = ([3, 4, 5, 6], [7, 8, 9, 10])  # (window group, full group), token 0 on
    into = ([11, 12, 13, 14], [0, 1, 2, 15])
    src_views, dst_views = make_views(source, seed=21), make_views(target, seed=22)
    untouched = make_views(target, seed=22)
    window_from = BLOCK * 2  # 32: inside the only chunk [0, 48)
    with CacheEngine(config, LAYOUT, "m") as engine:
        key = engine.keys(list(range(CHUNK)))[0]
        writer = PagedMover(engine, src_views, source, CpuCopyStream(staged=staged), layer_groups=[0, 1],
                            window_layers=[0])
        assert writer.save(key, tables[1], 0, CHUNK, group_tables=tables).finish()
        reader = PagedMover(engine, dst_views, target, CpuCopyStream(staged=staged), layer_groups=[0, 1],
                            window_layers=[0])
        job = reader.load(key, into[1], 0, CHUNK, first=0, chunk_tokens=CHUNK, group_tables=into,
                          window_from=window_from)
        assert job is not None
        job.finish()
        with pytest.raises(ValueError, match="one KV cache group"):
            reader.load_layered([ChunkRead(key, 0, 0, CHUNK, CHUNK)], into[1])
    for layer, first in ((0, window_from), (1, 0)):
        table, written = into[layer], tables[layer]
        assert torch.equal(tokens_of([dst_views[layer]], table, first, CHUNK, LAYOUT.part((layer,))),
                           tokens_of([src_views[layer]], written, first, CHUNK, LAYOUT.part((layer,))))
        assert torch.equal(tokens_of([dst_views[layer]], table, 0, first, LAYOUT.part((layer,))),
                           tokens_of([untouched[layer]], table, 0, first, LAYOUT.part((layer,))))
