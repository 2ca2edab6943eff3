"""kvfabric's views of vLLM's GPU layouts are vLLM's own: for every KVCacheLayout, a K|V spec (FLASH_ATTN,
FLASHINFER, TRITON_ATTN) and an MLA spec, `paged_views.layer_views` gives exactly the per-layer views that vLLM's
`create_kv_cache_views` makes of the same buffer (shape, strides, address), with the strides vLLM's
`get_kv_cache_config_from_groups` computes for one group. Runs where vLLM imports (the CPU build in .venv-vllm)."""
from __future__ import annotations

import pytest
import torch

vllm_layout = pytest.importorskip("vllm.v1.kv_cache_layout")
interface = pytest.importorskip("vllm.v1.kv_cache_interface")

from kvfabric.connectors.paged_views import LAYOUTS, PagedSpec, layer_views  # noqa: E402

NUM_LAYERS, NUM_BLOCKS, BLOCK = 3, 10, 16


def vllm_spec(content: str):
    if content == "kv":
        return interface.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return interface.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)


def test_kvfabric_knows_every_layout_vllm_has():
    assert {member.name: member.value for member in vllm_layout.KVCacheLayout} == LAYOUTS


@pytest.mark.parametrize("content", ["kv", "latent"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layer_views_are_vllms_own(name, content):
    layout = vllm_layout.KVCacheLayout[name]
    spec = vllm_spec(content)
    bytes_per_block = spec.page_size_bytes * NUM_LAYERS
    fixed_block = bytes_per_block if layout.is_block_outermost else None  # as get_kv_cache_config_from_groups
    layer_stride, block_stride, *_ = interface.compute_layout_strides(
        spec, NUM_BLOCKS, NUM_LAYERS, layout, fixed_strides=(None, fixed_block, None, None, None))
    tensor = interface.KVCacheTensor(size=bytes_per_block * NUM_BLOCKS, layers=[f"l{i}" for i in range(NUM_LAYERS)],
                                     layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    theirs = interface.create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)

    ours = layer_views(raw, PagedSpec(name, content, NUM_LAYERS, NUM_BLOCKS, 1 if content == "latent" else 2, BLOCK,
                                      576 if content == "latent" else 64, torch.bfloat16))
    for a, b in zip(ours, theirs, strict=True):
        assert (a.shape, a.stride(), a.data_ptr(), a.dtype) == (b.shape, b.stride(), b.data_ptr(), b.dtype)
