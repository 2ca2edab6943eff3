"""The GPU backends' worker side (DeviceWorkerSide) of a tensor- or pipeline-parallel engine, on CPU tensors in the
GPU layouts: each rank saves its share of the model's KV (its KV heads, its stage's layers, named by vLLM's global
layer names), and chunks stored by one parallel shape load exactly into another's blocks. Needs vllm importable
(.venv-vllm); skips otherwise."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from kvfabric import CacheEngine, Config, KVLayout  # noqa: E402
from kvfabric.connectors.copy_stream import CpuCopyStream  # noqa: E402
from kvfabric.connectors.paged_views import DeviceLayer, PagedSpec, layer_views  # noqa: E402
from kvfabric.connectors.vllm.device import DeviceWorkerSide  # noqa: E402
from kvfabric.connectors.vllm.metadata import KVFabricMetadata, LoadSpec, SaveSpec  # noqa: E402
from kvfabric.kv.shares import Share, rank_share  # noqa: E402
from tests.test_vllm_device import step, wait_loaded  # noqa: E402

BLOCK, CHUNK = 16, 32
MODEL = KVLayout(4, 2, 8, "float16")  # 4 layers, 2 KV heads
TOKENS = list(range(1, 3 * CHUNK + 1))
BLOCKS = [3, 4, 9, 10, 0, 1]


def caches(share: Share, layout: str, seed: int) -> dict[str, torch.Tensor]:
    """A rank's paged caches: its layers (vLLM's global names) of its heads, random."""
    heads = share.heads[1] - share.heads[0]
    spec = PagedSpec(layout, "kv", len(share.layer_indices), 24, heads, BLOCK, MODEL.head_dim, torch.float16)
    views = layer_views(torch.empty(spec.num_bytes, dtype=torch.uint8), spec)
    generator = torch.Generator().manual_seed(seed)
    for view in views:
        view.copy_(torch.randn(view.shape, generator=generator))
    return {f"model.layers.{i}.self_attn.attn": view for i, view in zip(share.layer_indices, views)}


def kv_of(kv: dict[str, torch.Tensor], share: Share, layout: str) -> torch.Tensor:
    """The rank's KV of the prompt [L', 2, H', T, D]."""
    out = torch.empty(share.layout(MODEL).shape(len(TOKENS)), dtype=torch.float16)
    for index, view in enumerate(kv.values()):
        DeviceLayer.of(view, layout).gather(BLOCKS, 0, len(TOKENS), out[index])
    return out


def worker(config: Config, share: Share, parallel: tuple[int, int], kv: dict[str, torch.Tensor],
           layout: str, load_mode: str = "async") -> DeviceWorkerSide:
    side = DeviceWorkerSide(config, MODEL, "m", BLOCK, {"load_threads": 1, "load_mode": load_mode}, share=share,
                            parallel=parallel)
    side.register(kv, layout)
    side.mover.stream = CpuCopyStream(staged=True)  # the CUDA path's staging buffers, on the CPU
    return side


def save(config: Config, shares: list[Share], parallel: tuple[int, int], layout: str) -> list[torch.Tensor]:
    """Every rank of one shape saves the prompt; the model's KV they held, by rank."""
    with CacheEngine(config, MODEL, "m") as keys_of:
        keys = keys_of.keys(TOKENS)
    held = []
    for rank, share in enumerate(shares):
        kv = caches(share, layout, seed=rank + 1)
        side = worker(config, share, parallel, kv, layout)
        step(side, KVFabricMetadata(saves=[SaveSpec("w", keys, 0, len(TOKENS), BLOCKS)]))
        side.saver.join()
        side.engine.flush()
        side.close()
        held.append(kv_of(kv, share, layout))
    return held


def load(config: Config, share: Share, parallel: tuple[int, int], layout: str, load_mode: str) -> torch.Tensor:
    """A rank loads the prompt asynchronously, or layer by layer (each layer found by vLLM's global name)."""
    with CacheEngine(config, MODEL, "m") as keys_of:
        keys = keys_of.keys(TOKENS)
    kv = caches(share, layout, seed=99)
    side = worker(config, share, parallel, kv, layout, load_mode)
    try:
        spec = LoadSpec("r", keys, 0, len(TOKENS), BLOCKS, is_async=load_mode == "async")
        if load_mode == "async":
            step(side, KVFabricMetadata(loads=[spec]))
            wait_loaded(side, "r")
        else:
            side.bind(KVFabricMetadata(loads=[spec]))
            side.start_loads()
            for name in kv:
                side.layer_load(name)
            side.end_step()
        assert side.take_invalid_blocks() == set()
        return kv_of(kv, share, layout)
    finally:
        side.close()


def model_kv(held: list[torch.Tensor], shares: list[Share]) -> torch.Tensor:
    """The model's KV [L, 2, H, T, D] from the ranks' shares."""
    out = torch.empty(MODEL.shape(len(TOKENS)), dtype=torch.float16)
    for kv, share in zip(held, shares):
        out[slice(*share.layers), :, slice(*share.heads)] = kv
    return out


SHAPES = {"tp1": (1, 1), "tp2": (1, 2), "pp2": (2, 1), "pp2tp2": (2, 2)}


def shares_of(pp: int, tp: int) -> list[Share]:
    return [rank_share(MODEL, stage, pp, rank, tp) for stage in range(pp) for rank in range(tp)]


@pytest.mark.parametrize("writer,reader", [("tp2", "tp1"), ("tp1", "tp2"), ("pp2", "tp2"), ("pp2tp2", "pp2"),
                                           ("tp2", "tp2")])
@pytest.mark.parametrize("layout,load_mode", [("BLHNC", "async"), ("LBNHC", "async"), ("LBHNC", "layerwise")])
def test_each_rank_loads_its_share_of_what_another_shape_stored(tmp_path, writer, reader, layout, load_mode):
    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})
    stored = shares_of(*SHAPES[writer])
    model = model_kv(save(config, stored, SHAPES[writer], layout), stored)
    for share in shares_of(*SHAPES[reader]):  # each rank a fresh process: its cpu tier empty, the chunks on disk
        got = load(config, share, SHAPES[reader], layout, load_mode)
        assert torch.equal(got, model[slice(*share.layers), :, slice(*share.heads)]), share
