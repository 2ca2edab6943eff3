"""The reference engine on Gemma 3 (sliding-window + full layer groups) and Qwen2: a cache hit reproduces the
full prefill's next-token logits in fp32, across Gemma's 512-token window; a corrupt chunk is a miss; layouts of
different models never read each other's chunks. Real models, short prompts (skipped where not set up)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfabric import Config
from kvfabric.codec.format import HEADER_BYTES
from kvfabric.config import DiskTierConfig
from kvfabric.engines.hf import HFEngine
from kvfabric.engines.model import installed_builtin
from kvfabric.engines.runtime import next_logprobs
from kvfabric.kv.shapes import WindowSplit
from kvfabric.kv.shares import shape_of

pytestmark = pytest.mark.slow
TEXT = (Path(__file__).parents[1] / "src/kvfabric/data/demo_document.txt").read_text()
EXACT = 1e-4  # fp32: the bound for a hit against the full prefill


def engine_for(name: str, cache_dir: Path, chunk_size: int, model_id: str | None = None) -> HFEngine:
    path = installed_builtin(name)
    if path is None:
        pytest.skip(f"{name} is not set up under $KVFABRIC_HOME; run `kvfabric setup-model {name}` first")
    config = Config(chunk_size=chunk_size, tiers=("cpu", "disk"), disk=DiskTierConfig(path=str(cache_dir)))
    return HFEngine(path, config=config, kv_dtype="float32", model_id=model_id)


def test_gemma3_hit_across_the_window_is_exact_and_a_corrupt_window_chunk_is_a_miss(tmp_path):
    with engine_for("gemma3-270m", tmp_path / "chunks", chunk_size=128) as engine:
        layout = engine.layout
        (window,) = layout.window_groups
        ids = engine.encode(TEXT)[:680]
        miss = engine.generate(ids, max_new_tokens=1)  # one full prefill; stores 5 chunks
        assert miss.hit_tokens == 0 and miss.stored_chunks == 5
        hit = engine.generate(ids, max_new_tokens=1)
        assert hit.hit_tokens == 640 > window.window  # the window layers read [129, 640): chunk 0 is stale
        assert (hit.logits - miss.logits).abs().max().item() < EXACT
        assert hit.token_ids == miss.token_ids

        # what a chunk must hold for window layers is what layout.stale_rows says: rows before N-W+1 never matter;
        # retrieve reads the window part of chunks 1-4 only (chunk 0 lies before row 129) and zeros the rows before
        buf = torch.full(layout.shape(len(ids)), float("nan"))
        before = engine.cache.stats().counters
        assert engine.cache.retrieve(ids[:640], out=buf).shape[3] == 640
        after = engine.cache.stats().counters
        assert after["window_parts_skipped"] - before.get("window_parts_skipped", 0) == 1
        assert after["window_parts_read"] - before.get("window_parts_read", 0) == 4
        ((layers, end),) = layout.stale_rows(640)
        assert end == 640 - window.window + 1
        assert not buf[:, :, :, :640].isnan().any() and not buf[list(layers), :, :, :128].any()
        zeroed = next_logprobs(engine.model, buf, ids, 640)[-1]
        assert (zeroed - torch.log_softmax(miss.logits, -1)).abs().max().item() < EXACT

        # a flipped byte in a window layer's K of chunk 4's window part on disk (process memory is trusted and
        # emptied): the hit ends before chunk 4, and the part is discarded
        engine.cache.flush()
        engine.cache.clear_tier("cpu")
        shape = shape_of(layout)
        assert isinstance(shape, WindowSplit)
        window_part = shape.window.layout
        key = shape.window.key(engine.cache.keys(ids)[4])
        offset = HEADER_BYTES + window_part.num_bytes(128) // window_part.num_layers * 0  # raw: layer-major
        disk = engine.cache.stack.tiers[1]
        blob = bytearray(disk.get(key))
        blob[offset + 7] ^= 0xFF
        assert disk.put(key, bytes(blob))
        short = engine.generate(ids, max_new_tokens=1)
        assert short.hit_tokens == 512
        assert engine.cache.stats().counters["corrupt.disk"] == 1
        engine.cache.flush()  # the recomputed chunk is stored again (both parts): the damaged bytes are gone
        stored = disk.get(key)
        assert stored is None or bytes(stored) != bytes(blob)
        assert (short.logits - miss.logits).abs().max().item() < EXACT


def test_qwen2_hit_is_exact_and_other_layouts_never_read_its_chunks(tmp_path):
    shared = tmp_path / "chunks"  # one disk directory, one model id: only the layout keeps them apart
    with engine_for("qwen2.5-coder-0.5b", shared, chunk_size=64, model_id="shared") as qwen:
        assert qwen.layout.groups == () and (qwen.layout.num_kv_heads, qwen.layout.head_dim) == (2, 64)
        ids = qwen.encode(TEXT)[:300]
        with torch.inference_mode():  # the plain HF forward, no kvfabric
            reference = qwen.model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
        miss = qwen.generate(ids, max_new_tokens=4)
        hit = qwen.generate(ids, max_new_tokens=4)
        assert (miss.hit_tokens, hit.hit_tokens) == (0, 256)
        assert (miss.logits - reference).abs().max().item() < EXACT
        assert (hit.logits - reference).abs().max().item() < EXACT
        assert hit.token_ids == miss.token_ids
        qwen.cache.flush()
    with engine_for("gemma3-270m", shared, chunk_size=64, model_id="shared") as gemma:
        assert gemma.cache.lookup(ids) == 0  # same ids, same id, same directory: other keys
        assert len(gemma.cache.tier_keys("disk")) == 4  # qwen's chunks are there, unread


def test_blend_refuses_sliding_window_models_at_start_up(tmp_path):
    """CacheBlend's runner re-rotates K with one RoPE and attends without windows: on Gemma 3 it would compute
    wrong KV, so `bench blend` says so before any work."""
    from click.testing import CliRunner

    from kvfabric.apps.cli import main
    if installed_builtin("gemma3-270m") is None:
        pytest.skip("gemma3-270m is not set up under $KVFABRIC_HOME")
    (tmp_path / "q.json").write_text("[]")  # no questions needed: the refusal comes first
    result = CliRunner().invoke(main, ["bench", "blend", "--model", "gemma3-270m", "--questions", "1",
                                       "--data", str(tmp_path / "q.json")])
    assert result.exit_code == 1 and "gemma3_text" in result.output and "Traceback" not in result.output


def test_flexicache_refuses_sliding_window_models(tmp_path):
    """Paged decode attends over every resident page, with no window: on Gemma 3 a KV budget is refused, both when
    configured (at start-up) and when asked per call, never decoded wrong."""
    from kvfabric.config import FlexiCacheConfig
    path = installed_builtin("gemma3-270m")
    if path is None:
        pytest.skip("gemma3-270m is not set up under $KVFABRIC_HOME")
    with pytest.raises(ValueError, match="sliding-window"):
        HFEngine(path, config=Config(tiers=("cpu",), flexicache=FlexiCacheConfig(kv_budget=0.3)))
    with HFEngine(path, config=Config(tiers=("cpu",))) as engine:
        with pytest.raises(ValueError, match="sliding-window"):
            engine.generate("The lighthouse keeper wrote in his log. " * 20, max_new_tokens=2, kv_budget=0.3)
        assert engine.generate("The lighthouse keeper", max_new_tokens=2).token_ids  # dense decode still runs
