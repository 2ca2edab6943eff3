"""KVFabricConnector against a real vLLM (CPU), plus the paged-cache copy helpers it is built on.

The vLLM tests need `vllm` (the separate .venv-vllm, see scripts/setup_vllm_venv.sh) and skip cleanly without it:

    .venv-vllm/bin/python -m pytest tests/test_vllm_connector.py

They run three engines, each in its own subprocess (tests/vllm_scripts/connector_phases.py, one engine start-up
of ~1 min each), on the real SmolLM2-135M-Instruct (kvfabric.engines.model.ensure_model(), or the HF folder in
$KVFABRIC_TEST_MODEL_DIR), fp32, greedy, 256-token chunks:

  baseline  no connector, prefix caching off: the reference outputs
  A (store) cold engine with the connector: p1 (1000 tokens), p2 (800), p4 (768 = 3 whole chunks) -> stored
  corrupt   flip payload bytes of p2's chunk 1 on disk
  hf        the stored chunks of p4 equal transformers' K/V (the chunk format is engine-independent)
  B (load)  fresh engine (vLLM's own cache empty), same disk cache, in this order:
            p4: full-prompt hit (767 tokens external, the last one computed)
            p3: shares p1's first 600 tokens -> only the two whole shared chunks (512 tokens) hit
            p1: 512 tokens from vLLM's own cache (p3's blocks) + chunk 2 (256 tokens) external
            p2: chunk 1 corrupt -> detected, blocks reported, vLLM recomputes, output still equal
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvfabric.connectors.paged import CpuPagedLayer, blocks_of, gather, render_region, scatter, segments

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "vllm_scripts" / "connector_phases.py"
CHUNK = 256


# ---- paged-cache helpers (no vLLM needed) ------------------------------------------------------------------
def _fake_kernel_write(cache: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor, layouts: tuple[str, str],
                       block_size: int) -> None:
    """Write token KV (k, v: [H, D]) into `slot` the way the CPU attention kernel does, for given region layouts."""
    num_blocks, num_heads, _, two_d = cache.shape
    head_dim = two_d // 2
    regions = cache.view(num_blocks, num_heads, 2, block_size * head_dim)
    block, off = divmod(slot, block_size)
    for which, values in ((0, k), (1, v)):
        for h in range(num_heads):
            if layouts[which] == "td":
                regions[block, h, which, off * head_dim:(off + 1) * head_dim] = values[h]
            else:
                regions[block, h, which, off::block_size] = values[h]


@pytest.mark.parametrize("layouts", [("dt", "td"), ("td", "td"), ("dt", "dt")])
def test_gather_reads_what_the_kernel_wrote(layouts):
    block_size, heads, dim = 8, 2, 4
    cache = torch.zeros(6, heads, block_size, 2 * dim)
    block_ids = [4, 1, 5]
    kv = torch.randn(2, heads, 20, dim)
    for p in range(20):
        _fake_kernel_write(cache, block_ids[p // block_size] * block_size + p % block_size,
                           kv[0, :, p], kv[1, :, p], layouts, block_size)
    layer = CpuPagedLayer(cache, block_size, *layouts)
    for start, end in [(0, 20), (3, 17), (8, 16), (5, 6)]:
        out = torch.empty(2, heads, end - start, dim)
        gather(layer, block_ids, start, end, out)
        assert torch.equal(out, kv[:, :, start:end])


def test_scatter_round_trip_touches_only_its_slots():
    block_size, heads, dim = 8, 3, 4
    cache = torch.randn(5, heads, block_size, 2 * dim)
    before = cache.clone()
    layer = CpuPagedLayer(cache, block_size)
    block_ids = [3, 0, 2]
    src = torch.randn(2, heads, 13, dim)
    scatter(layer, block_ids, 5, 18, src)  # partial first and last blocks
    out = torch.empty_like(src)
    gather(layer, block_ids, 5, 18, out)
    assert torch.equal(out, src)
    # tokens outside [5, 18) of the same blocks are untouched
    rest = torch.empty(2, heads, 5, dim)
    gather(CpuPagedLayer(before, block_size), block_ids, 0, 5, rest)
    again = torch.empty_like(rest)
    gather(layer, block_ids, 0, 5, again)
    assert torch.equal(rest, again)
    assert torch.equal(cache[1], before[1]) and torch.equal(cache[4], before[4])  # blocks not in the table


def test_segments_and_blocks_of():
    assert list(segments([7, 9], 4, 2, 7)) == [(7, 2, 4, 0), (9, 0, 3, 2)]
    assert blocks_of([7, 9, 11], 4, 4, 9) == [9, 11]
    assert blocks_of([7, 9], 4, 3, 3) == []
    with pytest.raises(ValueError):
        list(segments([7], 4, 0, 5))
    assert torch.equal(render_region(torch.arange(6.).view(3, 2), "dt"), torch.tensor([0., 2, 4, 1, 3, 5]))


# ---- real vLLM ---------------------------------------------------------------------------------------------
def _model_dir() -> str:
    explicit = os.environ.get("KVFABRIC_TEST_MODEL_DIR")
    if explicit:
        return explicit
    try:
        from kvfabric.engines.model import ensure_model

        return str(ensure_model())
    except Exception as exc:  # noqa: BLE001 - e.g. conversion deps missing in the vLLM venv
        main_python = ROOT / ".venv" / "bin" / "python"
        if main_python.exists():  # the main venv has the GGUF conversion dependencies
            proc = subprocess.run([str(main_python), "-c", "from kvfabric.engines.model import ensure_model; "
                                   "print(ensure_model())"], capture_output=True, text=True, timeout=900)
            if proc.returncode == 0:
                return proc.stdout.strip().splitlines()[-1]
        pytest.skip(f"no model: ensure_model() failed ({exc}); set KVFABRIC_TEST_MODEL_DIR")


def _phase(phase: str, workdir: Path, model: str, names: str = "", timeout: int = 420) -> dict:
    out = workdir / f"{phase}.json"
    cmd = [sys.executable, str(SCRIPT), phase, "--model", model, "--cache", str(workdir / "cache"),
           "--out", str(out), "--names", names]
    if phase != "prompts":
        cmd += ["--prompts", str(workdir / "prompts.json")]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("OMP_NUM_THREADS", "2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=workdir)
    (workdir / f"{phase}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"phase {phase} failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    pytest.importorskip("vllm")
    model = _model_dir()
    work = tmp_path_factory.mktemp("vllm_connector")
    results = {"prompts": _phase("prompts", work, model)["prompts"]}
    results["baseline"] = _phase("baseline", work, model, "p1,p2,p3,p4")
    results["store"] = _phase("store", work, model, "p1,p2,p4")
    results["corrupt"] = _phase("corrupt", work, model, "p2,1")
    results["hf"] = _phase("hf", work, model, "p4")["hf"]
    results["load"] = _phase("load", work, model, "p4,p3,p1,p2")
    return results


def _out(runs: dict, phase: str, name: str) -> dict:
    return runs[phase]["results"][name]


@pytest.mark.slow
def test_cold_engine_stores_and_output_unchanged(runs):
    for name in ("p1", "p2", "p4"):
        got = _out(runs, "store", name)
        assert got["tokens"] == _out(runs, "baseline", name)["tokens"], name
        assert got["kvfabric"]["saved_tokens"] == len(runs["prompts"][name]) // CHUNK * CHUNK
    assert runs["store"]["chunk_files"] == 3 + 3 + 3


@pytest.mark.slow
def test_stored_chunks_are_the_models_kv(runs):
    """Chunks gathered from vLLM's paged cache equal transformers' K and V (so HF and vLLM can share them)."""
    hf = runs["hf"]
    assert hf["tokens"] == 768
    assert hf["max_diff_k"] < 1e-3 * max(1.0, hf["max_abs"]), hf
    assert hf["max_diff_v"] < 1e-3 * max(1.0, hf["max_abs"]), hf


@pytest.mark.slow
def test_fresh_engine_full_prompt_hit(runs):
    got = _out(runs, "load", "p4")  # first request of a fresh engine: vLLM's own cache is empty
    stats = got["kvfabric"]
    assert stats["external_hit_tokens"] == 767  # whole prompt stored; the last token is computed
    assert stats["loaded_tokens"] == 767 and not stats.get("failed_tokens")
    assert stats["bytes"].get("disk", 0) > 0  # read across processes from the disk tier
    assert got["num_cached_tokens"] == 767
    assert got["tokens"] == _out(runs, "baseline", "p4")["tokens"]


@pytest.mark.slow
def test_shared_prefix_only_shared_chunks_hit(runs):
    got = _out(runs, "load", "p3")  # p3 = p1[:600] + other tokens; p1 was stored by engine A
    assert got["kvfabric"]["external_hit_tokens"] == 512  # chunks 0-1; chunk 2 diverges at token 600
    assert got["num_cached_tokens"] == 512
    assert got["tokens"] == _out(runs, "baseline", "p3")["tokens"]
    p1 = _out(runs, "load", "p1")  # now 512 tokens come from vLLM's own cache (p3's blocks), chunk 2 from kvfabric
    assert p1["num_cached_tokens"] == 768
    assert p1["kvfabric"]["external_hit_tokens"] == 256
    assert p1["tokens"] == _out(runs, "baseline", "p1")["tokens"]


@pytest.mark.slow
def test_corrupt_chunk_is_recomputed(runs):
    got = _out(runs, "load", "p2")
    stats = got["kvfabric"]
    assert stats["external_hit_tokens"] == 768  # the lookup sees all three chunks (it reads no data)
    assert stats["loaded_tokens"] == 256  # chunk 0 only: chunk 1 fails its checksum
    assert stats["failed_tokens"] == 512  # chunks 1-2 -> blocks reported -> vLLM recomputes them
    assert got["tokens"] == _out(runs, "baseline", "p2")["tokens"]
    assert stats["saved_tokens"] >= 256  # the corrupt chunk was deleted, recomputed and stored again
    worker = runs["load"]["worker_stats"]
    assert worker["engine"].get("corrupt.disk", 0) >= 1


# ---- scheduler-side keys (vLLM importable, no engine) ------------------------------------------------------
def _lookup(tmp_path):
    pytest.importorskip("vllm")
    from kvfabric.config import Config
    from kvfabric.connectors.vllm.scheduler import ChunkLookup
    from kvfabric.layout import KVLayout

    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})
    return ChunkLookup(config, KVLayout(2, 1, 4, "float32"), "m")


def test_vllm_key_mode_names_the_last_block_of_each_chunk(tmp_path):
    lookup = _lookup(tmp_path)
    hashes = [bytes([i]) * 32 for i in range(7)]  # vLLM block hashes, block size 128: 2 blocks per chunk
    keys = lookup.keys_from_block_hashes(hashes, 7 * 128, 128)
    assert len(keys) == 3  # whole chunks only
    other = lookup.keys_from_block_hashes(hashes[:3] + [b"x" * 32] + hashes[4:], 7 * 128, 128)
    assert other[0] == keys[0] and other[1] != keys[1] and other[2] == keys[2]  # vLLM's hashes carry the chain
    assert lookup.keys_from_block_hashes(hashes, 3 * 128, 128) == keys[:1]  # prompt tokens bound the chunks
    assert len(set(keys)) == 3 and all(len(k) == 32 for k in keys)


def test_token_keys_skip_requests_that_tokens_do_not_name(tmp_path):
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from kvfabric.config import Config
    from kvfabric.connectors.vllm.scheduler import SchedulerSide
    from kvfabric.layout import KVLayout

    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})
    side = SchedulerSide(config, KVLayout(2, 1, 4, "float32"), "m", 128, "tokens")
    plain = SimpleNamespace(request_id="a", prompt_token_ids=list(range(600)), lora_request=None, mm_features=[],
                            cache_salt=None, block_hashes=[])
    assert len(side.request_keys(plain)) == 2
    lora = SimpleNamespace(**{**vars(plain), "request_id": "b", "lora_request": object()})
    salted = SimpleNamespace(**{**vars(plain), "request_id": "c", "cache_salt": "tenant"})
    assert side.request_keys(lora) == [] and side.request_keys(salted) == []


def test_request_stats_add_up_across_steps_and_processes():
    import pickle

    pytest.importorskip("vllm")
    from kvfabric.connectors.vllm.metadata import KVFabricWorkerMetadata, RequestStats

    step1 = RequestStats(loaded_tokens=256, load_read_s=0.5, bytes_loaded=(("disk", 100),))
    step2 = RequestStats(loaded_tokens=256, failed_tokens=512, bytes_loaded=(("cpu", 7), ("disk", 50)))
    meta = KVFabricWorkerMetadata({"a": step1}, [b"k1"], [])
    meta.aggregate(pickle.loads(pickle.dumps(KVFabricWorkerMetadata({"a": step2, "b": RequestStats(saved_tokens=256)},
                                                                    [b"k2"], [b"k1"]))))
    assert meta.stored == [b"k1", b"k2"] and meta.removed == [b"k1"]
    assert meta.requests["b"].saved_tokens == 256
    params = meta.requests["a"].as_params()
    assert params == {"external_hit_tokens": 0, "local_hit_tokens": 0, "loaded_tokens": 512, "failed_tokens": 512,
                      "saved_tokens": 0, "load_read_s": 0.5, "bytes": {"cpu": 7, "disk": 150}}
    assert json.loads(json.dumps(params)) == params  # it rides in the request's output as plain JSON
