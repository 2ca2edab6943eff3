"""vLLM 0.32's GPU KV layouts on CPU tensors (kvfabric.connectors.paged_views): every KVCacheLayout with K|V content
(FLASH_ATTN, FLASHINFER NHD / HND, TRITON_ATTN) and with one latent (MLA). Caches are built as vLLM's
`create_kv_cache_views` builds them (`vllm/v1/kv_cache_interface.py`; tests/test_vllm_paged_layouts.py checks that
the two agree), tokens are put in place through vLLM's slot arithmetic (slot = block_id * block_size + offset,
`vllm/v1/worker/block_table.py`), and every copy round-trips exactly, across every pair of layouts."""
from __future__ import annotations

import itertools

import pytest
import torch

from kvfabric import CacheEngine, Config, KVLayout
from kvfabric.cache.protocol import BlockSource, TokenSource
from kvfabric.config import DiskTierConfig
from kvfabric.connectors.copy_stream import CpuCopyStream, make_copy_stream
from kvfabric.connectors.paged_views import (
    LAYOUTS,
    DeviceLayer,
    PagedSpec,
    block_layout,
    is_cross_layer,
    layer_views,
    layout_order,
    strides,
    zero_tail,
)
from kvfabric.host.pages import Scratch
from kvfabric.kv.blocks import BlockLayout, BlockLayoutError, pack, unpack

BLOCK = 16
CONTENTS = {"kv": (2, 8), "latent": (1, 24)}  # content -> (head slots, head_dim)
CASES = [(layout, content) for layout in LAYOUTS for content in CONTENTS]


def make_spec(layout: str, content: str, dtype: torch.dtype = torch.bfloat16) -> PagedSpec:
    heads, head_dim = CONTENTS[content]
    return PagedSpec(layout, content, num_layers=3, num_blocks=12, num_heads=heads, block_size=BLOCK,
                     head_dim=head_dim, dtype=dtype)


def make_cache(spec: PagedSpec, seed: int) -> list[torch.Tensor]:
    raw = torch.empty(spec.num_bytes, dtype=torch.uint8)
    views = layer_views(raw, spec)
    generator = torch.Generator().manual_seed(seed)
    for view in views:
        view.copy_(torch.randn(view.shape, generator=generator))
    return views


def token_values(spec: PagedSpec, num_tokens: int, seed: int) -> torch.Tensor:
    """[S, H, T, D] exchange values of one layer."""
    shape = (spec.num_states, spec.num_heads, num_tokens, spec.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(spec.dtype)


def write_by_slots(view: torch.Tensor, spec: PagedSpec, block_ids: list[int], start: int, values: torch.Tensor) -> None:
    """The reference writer: vLLM's slot mapping, one token at a time (K | V, or the latent, in C)."""
    for i in range(values.shape[2]):
        p = start + i
        slot = block_ids[p // BLOCK] * BLOCK + p % BLOCK
        view[slot // BLOCK, :, slot % BLOCK, :] = torch.cat(list(values[:, :, i, :]), dim=-1)


def read_by_slots(view: torch.Tensor, spec: PagedSpec, block_ids: list[int], start: int, end: int) -> torch.Tensor:
    out = torch.empty((spec.num_states, spec.num_heads, end - start, spec.head_dim), dtype=spec.dtype)
    for i, p in enumerate(range(start, end)):
        slot = block_ids[p // BLOCK] * BLOCK + p % BLOCK
        out[:, :, i, :] = view[slot // BLOCK, :, slot % BLOCK, :].unflatten(-1, (spec.num_states, spec.head_dim)
                                                                             ).transpose(0, 1)
    return out


@pytest.mark.parametrize("layout,content", CASES)
def test_views_lie_in_the_layouts_memory_order(layout, content):
    spec = make_spec(layout, content)
    views = layer_views(torch.empty(spec.num_bytes, dtype=torch.uint8), spec)
    assert [tuple(v.shape) for v in views] == [(12, spec.num_heads, BLOCK, spec.width)] * 3
    order = layout_order(layout)
    element = strides(spec)
    assert [element[axis] for axis in order] == sorted(element, reverse=True)  # outermost axis: largest stride
    step = views[1].data_ptr() - views[0].data_ptr()
    block_step = views[0][1].data_ptr() - views[0][0].data_ptr()
    assert (step < block_step) == is_cross_layer(layout)  # block-outermost: a block's layers are adjacent


@pytest.mark.parametrize("layout,content", CASES)
@pytest.mark.parametrize("start,end", [(0, 16 * 4), (5, 61), (16, 40), (3, 9)])
def test_gather_and_scatter_follow_the_slot_mapping_exactly(layout, content, start, end):
    spec = make_spec(layout, content)
    view = make_cache(spec, seed=1)[1]
    block_ids = [7, 8, 9, 2, 3, 11]  # a run of consecutive ids, then a jump, then another run
    values = token_values(spec, end - start, seed=2)
    write_by_slots(view, spec, block_ids, start, values)
    layer = DeviceLayer.of(view, layout, content)
    out = torch.empty_like(values)
    layer.gather(block_ids, start, end, out)
    assert torch.equal(out, values)

    before = view.clone()
    new = token_values(spec, end - start, seed=3)
    layer.scatter(block_ids, start, end, new)
    assert torch.equal(read_by_slots(view, spec, block_ids, start, end), new)
    touched = torch.zeros(view.shape[:3], dtype=torch.bool)
    for p in range(start, end):
        touched[block_ids[p // BLOCK], :, p % BLOCK] = True
    assert torch.equal(view[~touched], before[~touched])  # no slot outside [start, end) changed


@pytest.mark.parametrize("layout,content", CASES)
def test_blocks_saved_as_they_are_load_into_other_blocks(layout, content):
    spec = make_spec(layout, content)
    view = make_cache(spec, seed=4)[2]
    src_ids, dst_ids = [1, 2, 3, 6], [9, 10, 4, 5]
    num_tokens = 3 * BLOCK + 5  # a partial last block
    layer = DeviceLayer.of(view, layout, content)
    blocks = layer.blocks
    out = torch.empty((4, *blocks.tensor.shape[1:]), dtype=spec.dtype)
    layer.save_blocks(src_ids, 0, num_tokens, out)
    zero_tail(out, blocks.token_axis, num_tokens)
    tail = out[3].narrow(blocks.token_axis, 5, BLOCK - 5)
    assert not tail.any()  # another request's stale KV past the end is never stored
    layer.load_blocks(dst_ids, 0, num_tokens, out, first=0)
    expect, got = (torch.empty((spec.num_states, spec.num_heads, num_tokens, spec.head_dim), dtype=spec.dtype)
                   for _ in range(2))
    layer.gather(src_ids, 0, num_tokens, expect)
    layer.gather(dst_ids, 0, num_tokens, got)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("source,target", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_a_chunk_saved_in_one_layout_loads_exactly_into_every_other(tmp_path, source, target):
    """Whole blocks saved as layout A's engine holds them, stored on disk as a chunk, read by a fresh engine asking
    for layout B: the blocks as they are when A and B keep a block alike, else converted once (kvfabric.kv.blocks);
    either way layout B's slots then hold exactly what layout A's held."""
    spec_a, spec_b = make_spec(source, "kv"), make_spec(target, "kv")
    layout = KVLayout(spec_a.num_layers, spec_a.num_heads, spec_a.head_dim, "bfloat16")
    views_a, views_b = make_cache(spec_a, seed=5), make_cache(spec_b, seed=6)
    ids_a, ids_b = [2, 3, 4], [10, 0, 1]
    num_tokens = 2 * BLOCK + 7  # a partial last block
    config = Config(chunk_size=3 * BLOCK, tiers=("disk",), disk=DiskTierConfig(path=str(tmp_path)),
                    save_partial_chunk=True)
    tokens = list(range(num_tokens))
    with CacheEngine(config, layout, "m") as engine:
        (key,) = engine.keys(tokens)
        payload = engine.new_payload(num_tokens, block_layout(source, BLOCK))
        for index, view in enumerate(views_a):
            layer = DeviceLayer.of(view, source)
            layer.save_blocks(ids_a, 0, num_tokens, payload.kv[index])
            zero_tail(payload.kv[index], layer.blocks.token_axis, num_tokens)
        assert engine.store_chunks([(key, payload)]) == [True]
    wanted = block_layout(target, BLOCK)
    with CacheEngine(config, layout, "m") as engine:
        hit = engine.read_chunk(key, num_tokens=num_tokens, scratch=Scratch(), blocks=wanted)
        assert isinstance(hit, BlockSource if block_layout(source, BLOCK) == wanted else TokenSource)
        with hit:
            for index, view in enumerate(views_b):
                if isinstance(hit, BlockSource):
                    assert hit.blocks == wanted
                    slab = torch.from_numpy(hit.slab(index)).view(spec_b.dtype)
                    DeviceLayer.of(view, target).load_blocks(ids_b, 0, num_tokens, slab, first=0)
                else:
                    DeviceLayer.of(view, target).scatter(ids_b, 0, num_tokens, hit.kv[index])
    for view_a, view_b in zip(views_a, views_b):
        assert torch.equal(read_by_slots(view_b, spec_b, ids_b, 0, num_tokens),
                           read_by_slots(view_a, spec_a, ids_a, 0, num_tokens))


@pytest.mark.parametrize("source,target", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_latent_caches_move_between_layouts_exactly(source, target):
    """MLA: gathered from layout A, scattered into layout B (no chunk format for latents yet)."""
    spec_a, spec_b = make_spec(source, "latent"), make_spec(target, "latent")
    view_a, view_b = make_cache(spec_a, seed=7)[0], make_cache(spec_b, seed=8)[0]
    num_tokens = 2 * BLOCK + 7
    moved = torch.empty((1, 1, num_tokens, spec_a.head_dim), dtype=spec_a.dtype)
    DeviceLayer.of(view_a, source, "latent").gather([2, 3, 4], 0, num_tokens, moved)
    DeviceLayer.of(view_b, target, "latent").scatter([10, 0, 1], 0, num_tokens, moved)
    assert torch.equal(read_by_slots(view_b, spec_b, [10, 0, 1], 0, num_tokens),
                       read_by_slots(view_a, spec_a, [2, 3, 4], 0, num_tokens))


def test_gpu_block_layouts_pack_and_refuse_mixed_fields():
    for token_major in (False, True):
        blocks = BlockLayout(16, family="vllm", token_major=token_major)
        assert unpack(pack(blocks)) == blocks
    assert block_layout("LBNHC", 16).token_major and block_layout("BLNHC", 16).token_major
    assert not any(block_layout(name, 16).token_major for name in ("LBHNC", "LHBNC", "BLHNC", "BHLNC"))
    with pytest.raises(BlockLayoutError):
        BlockLayout(16, key_dt=True, family="vllm")
    with pytest.raises(BlockLayoutError):
        BlockLayout(16, token_major=True)  # a vllm-cpu block has no token-major form


def test_unknown_layouts_and_contents_are_refused_in_one_line():
    with pytest.raises(ValueError, match="unknown KV cache layout 'NCHW'"):
        layout_order("NCHW")
    with pytest.raises(ValueError, match="content"):
        PagedSpec("LBHNC", "qkv", 1, 1, 1, 16, 8, torch.float16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one head slot"):
        PagedSpec("LBHNC", "latent", 1, 1, 2, 16, 8, torch.float16)
    assert layout_order("NHD") == LAYOUTS["LBNHC"] and layout_order("HND") == LAYOUTS["LBHNC"]


def test_the_cpu_copy_stream_runs_copies_at_once_and_bounds_its_free_buffers():
    stream = make_copy_stream("cpu", pinned_bytes=100)
    assert isinstance(stream, CpuCopyStream)
    src, dst = torch.arange(10), torch.zeros(10, dtype=torch.long)
    stream.after_compute()
    stream.run(lambda: dst.copy_(src, non_blocking=True))
    done = stream.record()
    assert done.is_done() and torch.equal(dst, src)
    done.wait()
    done.hold_compute()
    a = stream.host_buffer(60)
    b = stream.host_buffer(60)  # 120 bytes out: beyond the bound, still handed out, counted
    assert a.numel() == b.numel() == 60 and a.dtype == torch.uint8 and stream.num_over_budget == 1
    stream.release(a)
    stream.release(b)  # 120 free bytes > 100: the oldest (a) is let go
    again = stream.host_buffer(60)
    assert again.data_ptr() == b.data_ptr()
    with pytest.raises(ValueError, match="no copy stream for device type 'meta'"):
        make_copy_stream("meta")
