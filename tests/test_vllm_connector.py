"""KVFabricConnector against a real vLLM (CPU), plus the paged-cache copy helpers it is built on.

The vLLM tests need `vllm` (the separate .venv-vllm, see scripts/setup_vllm_venv.sh) and skip cleanly without it:

    .venv-vllm/bin/python -m pytest tests/test_vllm_connector.py

They run six engines, each in its own subprocess (tests/vllm_scripts/connector_phases.py, one engine start-up
of ~1 min each; independent phases two at a time), on the real SmolLM2-135M-Instruct (kvfabric.engines.model.ensure_model(), or the HF folder in
$KVFABRIC_TEST_MODEL_DIR), fp32, greedy, 256-token chunks:

  baseline  no connector, prefix caching off: the reference outputs
  A (store) cold engine with the connector: p1 (1000 tokens), p2 (800), p4 (768 = 3 whole chunks), and p4 with
            cache_salt "t1" -> stored (the salted one in its own key namespace)
  corrupt   flip payload bytes of p2's chunk 1 on disk
  hf        the stored chunks of p4 equal transformers' K/V (the chunk format is engine-independent)
  B (load)  fresh engine (vLLM's own cache empty), same disk cache, in this order:
            p4: full-prompt hit (767 tokens external, the last one computed)
            p3: shares p1's first 600 tokens -> only the two whole shared chunks (512 tokens) hit
            p1: 512 tokens from vLLM's own cache (p3's blocks) + chunk 2 (256 tokens) external
            p2: chunk 1 corrupt -> detected during the async load, blocks reported, vLLM recomputes, output equal
            p4@t2: another salt: nothing hits (salted requests are isolated from unsalted and other salts)
            p4@t1: the salt it was stored under: a full hit
  layerwise fresh engine, load_mode "layerwise" (synchronous per-layer loads): p4 (full hit), p1 (768 loaded,
            232 computed in the same step)
  concurrent fresh engine (async loads): p3 with an unused salt decodes; p2 (cached) joins and waits for its KV
            while p3 keeps decoding
All loads but the layerwise phase's are asynchronous (the default load_mode).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvfabric.cache.builder import build_engine
from kvfabric.connectors.paged import CpuPagedLayer, blocks_of, render_region, segments

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "vllm_scripts" / "connector_phases.py"
CHUNK = 256
STEP = 64  # the connector's default tail_step


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


@pytest.mark.parametrize("block_ids", [[4, 1, 5], [1, 2, 3]])  # scattered, consecutive (one segment per run)
@pytest.mark.parametrize("layouts", [("dt", "td"), ("td", "td"), ("dt", "dt")])
def test_gather_reads_what_the_kernel_wrote(layouts, block_ids):
    block_size, heads, dim = 8, 2, 4
    cache = torch.zeros(6, heads, block_size, 2 * dim)
    kv = torch.randn(2, heads, 20, dim)
    for p in range(20):
        _fake_kernel_write(cache, block_ids[p // block_size] * block_size + p % block_size,
                           kv[0, :, p], kv[1, :, p], layouts, block_size)
    layer = CpuPagedLayer(cache, block_size, *layouts)
    for start, end in [(0, 20), (3, 17), (8, 16), (5, 6)]:
        out = torch.empty(2, heads, end - start, dim)
        layer.gather(block_ids, start, end, out)
        assert torch.equal(out, kv[:, :, start:end])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, block_ids", [(8, [3, 0, 2]), (4, [3, 2, 5, 6, 0])])  # [5, 6]: one run
def test_scatter_round_trip_touches_only_its_slots(block_size, block_ids, dtype):
    heads, dim = 3, 4
    cache = torch.randn(7, heads, block_size, 2 * dim).to(dtype)
    before = cache.clone()
    layer = CpuPagedLayer(cache, block_size)
    src = torch.randn(2, heads, 13, dim).to(dtype)
    layer.scatter(block_ids, 5, 18, src)  # partial first and last blocks
    out = torch.empty_like(src)
    layer.gather(block_ids, 5, 18, out)
    assert torch.equal(out, src)
    # tokens outside [5, 18) of the same blocks are untouched
    rest = torch.empty(2, heads, 5, dim)
    CpuPagedLayer(before, block_size).gather(block_ids, 0, 5, rest)
    again = torch.empty_like(rest)
    layer.gather(block_ids, 0, 5, again)
    assert torch.equal(rest, again)
    assert torch.equal(cache[1], before[1]) and torch.equal(cache[4], before[4])  # blocks not in the table


def test_segments_and_blocks_of():
    assert list(segments([7, 9], 4, 2, 7)) == [(7, 1, 2, 4, 0), (9, 1, 0, 3, 2)]
    # whole blocks with consecutive ids are one segment; a gap in the ids or a partial block starts another
    assert list(segments([3, 4, 5, 9, 10], 4, 0, 19)) == [(3, 3, 0, 4, 0), (9, 1, 0, 4, 12), (10, 1, 0, 3, 16)]
    assert list(segments([3, 4, 5], 4, 1, 12)) == [(3, 1, 1, 4, 0), (4, 2, 0, 4, 3)]
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


def _phase(phase: str, workdir: Path, model: str, names: str = "", timeout: int = 1200, script: Path = SCRIPT) -> dict:
    """One engine process running `phase` of `script`; `timeout` guards against a hang (a loaded 2-core host needs
    minutes)."""
    out = workdir / f"{phase}.json"
    cmd = [sys.executable, str(script), phase, "--model", model, "--cache", str(workdir / "cache"),
           "--out", str(out), "--names", names]
    if phase != "prompts":
        cmd += ["--prompts", str(workdir / "prompts.json")]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("OMP_NUM_THREADS", "2")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=workdir)
    except subprocess.TimeoutExpired as exc:
        tail = b"".join(x if isinstance(x, bytes) else (x or "").encode() for x in (exc.output, exc.stderr))
        pytest.fail(f"phase {phase} ran past {timeout} s:\n{tail.decode(errors='replace')[-6000:]}")
    (workdir / f"{phase}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"phase {phase} failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(out.read_text())


def _side_by_side(workdir: Path, model: str, phases: dict[str, str], script: Path = SCRIPT) -> dict[str, dict]:
    """Independent phases (name -> names), two at a time: an engine phase is mostly its processes' start-up
    (imports, spawns: one core busy), so two overlap on two cores. Each phase's results by name; a failed phase
    fails the caller."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_phase, name, workdir, model, names, script=script)
                   for name, names in phases.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    pytest.importorskip("vllm")
    model = _model_dir()
    work = tmp_path_factory.mktemp("vllm_connector")
    results = {"prompts": _phase("prompts", work, model)["prompts"]}
    results |= _side_by_side(work, model, {"baseline": "p1,p2,p3,p4", "store": "p1,p2,p4,p4@t1"})
    results["corrupt"] = _phase("corrupt", work, model, "p2,1")  # p2's chunk 1, which `load` finds and re-stores
    # layerwise reads p4 and p1 only, which `load` neither damages nor re-stores
    results |= _side_by_side(work, model, {"load": "p4,p3,p1,p2,p4@t2,p4@t1", "layerwise": "p4,p1"})
    # concurrent loads p2 whole (re-stored by `load`); hf reads p4's chunks
    results |= _side_by_side(work, model, {"concurrent": "p3@fresh,p2", "hf": "p4"})
    results["hf"] = results["hf"]["hf"]
    return results


def _stored_end(num_tokens: int) -> int:
    """Where the stored KV of a prompt ends: its whole chunks, then its tail in whole steps (the connector's default
    tail_step, 64): p1 (1000 tokens) 768 + 192, p2 (800) 768 (32 left over: less than a step), p4 (768) 768."""
    return num_tokens // CHUNK * CHUNK + num_tokens % CHUNK // STEP * STEP


def _out(runs: dict, phase: str, name: str) -> dict:
    return runs[phase]["results"][name]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one pays for the module's eight engine phases
def test_cold_engine_stores_and_output_unchanged(runs):
    for name in ("p1", "p2", "p4"):
        got = _out(runs, "store", name)
        assert got["tokens"] == _out(runs, "baseline", name)["tokens"], name
        assert got["kvfabric"]["saved_tokens"] == _stored_end(len(runs["prompts"][name]))
    assert runs["store"]["chunk_files"] == 4 + 3 + 3 + 3  # p1's tail: one partial chunk
    assert _out(runs, "store", "p4@t1")["tokens"] == _out(runs, "baseline", "p4")["tokens"]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one pays for the module's eight engine phases
def test_stored_chunks_are_the_models_kv(runs):
    """Chunks gathered from vLLM's paged cache equal transformers' K and V (so HF and vLLM can share them)."""
    hf = runs["hf"]
    assert hf["tokens"] == 768
    assert hf["max_diff_k"] < 1e-3 * max(1.0, hf["max_abs"]), hf
    assert hf["max_diff_v"] < 1e-3 * max(1.0, hf["max_abs"]), hf


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one pays for the module's eight engine phases
def test_fresh_engine_full_prompt_hit(runs):
    got = _out(runs, "load", "p4")  # first request of a fresh engine: vLLM's own cache is empty
    stats = got["kvfabric"]
    assert stats["external_hit_tokens"] == 767  # whole prompt stored; the last token is computed
    assert stats["loaded_tokens"] == 767 and not stats.get("failed_tokens")
    assert stats["bytes"].get("disk", 0) > 0  # read across processes from the disk tier
    assert got["num_cached_tokens"] == 767
    assert got["tokens"] == _out(runs, "baseline", "p4")["tokens"]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one pays for the module's eight engine phases
def test_shared_prefix_only_shared_chunks_hit(runs):
    got = _out(runs, "load", "p3")  # p3 = p1[:600] + other tokens; p1 was stored by engine A
    assert got["kvfabric"]["external_hit_tokens"] == 512  # chunks 0-1; chunk 2 diverges at token 600
    assert got["num_cached_tokens"] == 512
    assert got["tokens"] == _out(runs, "baseline", "p3")["tokens"]
    p1 = _out(runs, "load", "p1")  # now 512 tokens come from vLLM's own cache (p3's blocks), chunk 2 and p1's tail
    assert p1["num_cached_tokens"] == 960  # from kvfabric
    assert p1["kvfabric"]["external_hit_tokens"] == 256 + 192 == p1["kvfabric"]["loaded_tokens"]
    assert p1["tokens"] == _out(runs, "baseline", "p1")["tokens"]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one pays for the module's eight engine phases
def test_corrupt_chunk_is_recomputed(runs):
    got = _out(runs, "load", "p2")
    stats = got["kvfabric"]
    assert stats["external_hit_tokens"] == 768  # the lookup sees all three chunks (it reads no data)
    assert stats["loaded_tokens"] == 256  # chunk 0 only: chunk 1 fails its checksum
    assert stats["failed_tokens"] == 512  # chunks 1-2 -> blocks reported -> vLLM recomputes them
    assert got["tokens"] == _out(runs, "baseline", "p2")["tokens"]
    assert stats["saved_tokens"] >= 256  # the corrupt chunk was deleted, recomputed and stored again
    worker = runs["load"]["worker_stats"]
    assert worker["switch_interval_s"] == pytest.approx(0.0005)  # set at attach: load threads get the GIL sooner
    assert worker["engine"].get("corrupt.disk", 0) >= 1
    assert worker["connector"]["loads_async"] >= 4 and not worker["connector"].get("loads_layered")


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one pays for the module's eight engine phases
def test_salted_requests_are_isolated_in_tokens_mode(runs):
    other = _out(runs, "load", "p4@t2")  # p4's KV is stored unsalted and under salt t1, not under t2
    assert other["kvfabric"]["external_hit_tokens"] == 0 and other["num_cached_tokens"] == 0
    same = _out(runs, "load", "p4@t1")
    assert same["kvfabric"]["external_hit_tokens"] == 767 and same["kvfabric"]["loaded_tokens"] == 767
    for got in (other, same):
        assert got["tokens"] == _out(runs, "baseline", "p4")["tokens"]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one pays for the module's eight engine phases
def test_layerwise_loads(runs):
    full, partial = _out(runs, "layerwise", "p4"), _out(runs, "layerwise", "p1")
    assert full["kvfabric"]["loaded_tokens"] == 767 and full["num_cached_tokens"] == 767
    assert partial["kvfabric"]["loaded_tokens"] == 960 and partial["num_cached_tokens"] == 960  # with p1's tail
    assert full["tokens"] == _out(runs, "baseline", "p4")["tokens"]
    assert partial["tokens"] == _out(runs, "baseline", "p1")["tokens"]
    worker = runs["layerwise"]["worker_stats"]["connector"]
    assert worker["loads_layered"] == 2 and not worker.get("loads_async")


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one pays for the module's eight engine phases
def test_async_load_while_another_request_decodes(runs):
    run = runs["concurrent"]
    decode, hit = run["results"]["p3@fresh"], run["results"]["p2"]
    assert decode["tokens"][:len(_out(runs, "baseline", "p3")["tokens"])] == _out(runs, "baseline", "p3")["tokens"]
    assert hit["tokens"] == _out(runs, "baseline", "p2")["tokens"]
    assert hit["kvfabric"]["loaded_tokens"] == 768 and not hit["kvfabric"]["failed_tokens"]
    assert decode["kvfabric"]["external_hit_tokens"] == 0  # its salt has no chunks: a cold prefill
    steps = run["steps"]
    added = steps.index({"hit_added": 1})
    before = steps[added - 1].get("p3@fresh", 0)
    # an engine output after p2 joined in which p3 got a token while p2 had none: p2 was waiting for its KV
    waiting = [s for s in steps[added + 1:] if s.get("p3@fresh", 0) > before and "p2" not in s]
    assert waiting, steps
    assert runs["concurrent"]["worker_stats"]["connector"]["loads_async"] >= 1


# ---- scheduler-side keys (vLLM importable, no engine) ------------------------------------------------------
def _lookup(tmp_path):
    pytest.importorskip("vllm")
    from kvfabric.config import Config
    from kvfabric.connectors.lookup import LookupClient
    from kvfabric.connectors.vllm.prompt_keys import ChunkLookup
    from kvfabric.kv.layout import KVLayout

    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})
    return ChunkLookup(config, KVLayout(2, 1, 4, "float32"), "m", LookupClient(str(tmp_path / "nobody.sock")))


def test_vllm_key_mode_names_the_last_block_of_each_chunk(tmp_path):
    lookup = _lookup(tmp_path)
    hashes = [bytes([i]) * 32 for i in range(7)]  # vLLM block hashes, block size 128: 2 blocks per chunk
    keys = lookup.keys_from_block_hashes(hashes, 7 * 128, 128)
    assert len(keys) == 3  # whole chunks only
    other = lookup.keys_from_block_hashes(hashes[:3] + [b"x" * 32] + hashes[4:], 7 * 128, 128)
    assert other[0] == keys[0] and other[1] != keys[1] and other[2] == keys[2]  # vLLM's hashes carry the chain
    assert lookup.keys_from_block_hashes(hashes, 3 * 128, 128) == keys[:1]  # prompt tokens bound the chunks
    assert len(set(keys)) == 3 and all(len(k) == 32 for k in keys)


def test_token_keys_skip_lora_and_salt_selects_a_namespace(tmp_path):
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from kvfabric.config import Config
    from kvfabric.connectors.lookup import LookupClient
    from kvfabric.connectors.vllm.scheduler import SchedulerSide
    from kvfabric.kv.layout import KVLayout

    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})
    layout = KVLayout(2, 1, 4, "float32")
    side = SchedulerSide(config, layout, "m", 128, "tokens", client=LookupClient(str(tmp_path / "nobody.sock")))
    plain = SimpleNamespace(request_id="a", prompt_token_ids=list(range(600)), lora_request=None, mm_features=[],
                            cache_salt=None, block_hashes=[])
    keys = side.request_keys(plain)
    assert len(keys) == 2
    lora = SimpleNamespace(**{**vars(plain), "request_id": "b", "lora_request": object()})
    assert side.request_keys(lora) == []
    salted = side.request_keys(SimpleNamespace(**{**vars(plain), "request_id": "c", "cache_salt": "tenant"}))
    other = side.request_keys(SimpleNamespace(**{**vars(plain), "request_id": "d", "cache_salt": "other"}))
    assert len(salted) == len(other) == 2 and not {*salted} & {*keys} and not {*salted} & {*other}
    # cache_salt S is kvfabric's tenant salt S: an engine configured with that salt shares the chunks
    tenant = build_engine(Config.from_dict({**config.to_dict(), "salt": "tenant", "tiers": ["cpu"]}), layout, "m")
    assert tenant.keys(plain.prompt_token_ids) == salted
    tenant.close()
    salted_config = Config.from_dict({**config.to_dict(), "salt": "base"})
    both = SchedulerSide(salted_config, layout, "m", 128, "tokens", client=side.lookup.client).request_keys(
        SimpleNamespace(**{**vars(plain), "cache_salt": "tenant"}))
    assert not {*both} & {*salted}
    # tenant mode: a request that names no tenant is served without the cache (no keys: no lookup, load or store)
    tenants = Config.from_dict({**config.to_dict(), "tenant_mode": True})
    for key_mode in ("tokens", "vllm"):
        strict = SchedulerSide(tenants, layout, "m", 128, key_mode, client=side.lookup.client)
        blocks = [bytes([i]) * 32 for i in range(4)]
        assert strict.request_keys(SimpleNamespace(**{**vars(plain), "block_hashes": blocks})) == []
        assert strict.num_new_matched_tokens(SimpleNamespace(**{**vars(plain), "request_id": "e", "num_tokens": 600,
                                                                 "kv_transfer_params": None}), 0) == 0
        named = strict.request_keys(SimpleNamespace(**{**vars(plain), "request_id": "f", "cache_salt": "tenant",
                                                       "block_hashes": blocks}))
        assert len(named) == 2 and (key_mode == "vllm" or named == salted)


def test_a_chunk_that_failed_a_load_is_not_offered_again(tmp_path):
    """An async load whose first chunk fails sends the request back to waiting with nothing computed; vLLM then
    asks the scheduler again, which must not offer the same chunk (an endless load-fail loop otherwise): the
    worker's cache dropped the damaged chunk when the load read it, and the scheduler asks that cache."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from kvfabric.cache.protocol import ChunkMiss
    from kvfabric.config import Config
    from kvfabric.kv.layout import KVLayout
    from tests.scheduler_fixtures import scheduler_asking

    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["disk"], "disk": {"path": str(tmp_path)}})
    layout = KVLayout(2, 1, 4, "float32")
    tokens = list(range(2 * CHUNK + 5))
    request = SimpleNamespace(request_id="a", prompt_token_ids=tokens, lora_request=None, mm_features=[],
                              cache_salt=None, block_hashes=[], num_tokens=len(tokens), kv_transfer_params=None)
    with build_engine(config, layout, "m") as engine, scheduler_asking(engine, config, layout) as side:
        engine.store(tokens, torch.randn(layout.shape(2 * CHUNK)))
        engine.flush()
        assert side.num_new_matched_tokens(request, 0) == 2 * CHUNK
        keys = side.request_keys(request)
        path = next(tmp_path.rglob(f"{keys[0].hex()}*"))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        assert isinstance(engine.open_chunk(keys[0]), ChunkMiss)  # what the worker's load met
        assert engine.stats().counters["corrupt.disk"] == 1
        assert side.num_new_matched_tokens(request, 0) == 0


def test_partial_last_chunk_is_looked_up_and_saved_with_save_partial_chunk(tmp_path):
    pytest.importorskip("vllm")
    from kvfabric.config import Config
    from kvfabric.kv.layout import KVLayout
    from tests.scheduler_fixtures import scheduler_asking

    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["disk"], "disk": {"path": str(tmp_path)},
                               "save_partial_chunk": True})
    layout = KVLayout(2, 1, 4, "float32")
    tokens = list(range(2 * CHUNK + 40))
    with build_engine(config, layout, "m") as engine, scheduler_asking(engine, config, layout) as side:
        _partial_chunk(engine, side, tokens, layout)


def _partial_chunk(engine, side, tokens, layout) -> None:
    from types import SimpleNamespace

    request = SimpleNamespace(request_id="a", prompt_token_ids=tokens, lora_request=None, mm_features=[],
                              cache_salt=None, block_hashes=[], num_tokens=len(tokens), kv_transfer_params=None)
    assert len(side.request_keys(request)) == 3  # two whole chunks and the partial one
    assert side.num_new_matched_tokens(request, 0) == 0
    side.after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([0, 1, 2, 3, 4],)), 0)
    meta = side.build_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", block_ids=([0, 1, 2, 3, 4],), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]), num_scheduled_tokens={"a": len(tokens)},
        finished_req_ids=set(), total_num_scheduled_tokens=len(tokens)))
    (save,) = meta.saves
    assert (save.start, save.end, len(save.keys)) == (0, len(tokens), 3)  # the partial chunk ends with the prompt
    engine.store(tokens, torch.randn(layout.shape(len(tokens))))
    engine.flush()
    side.forget("a")
    assert side.num_new_matched_tokens(request, 0) == len(tokens) - 1  # all but the one token vLLM computes


def _ask(side, request_id: str, tokens: list[int], num_blocks: int = 8):
    """One request through the scheduler side as vLLM drives it: lookup, allocation, a step computing the rest."""
    from types import SimpleNamespace

    request = SimpleNamespace(request_id=request_id, prompt_token_ids=tokens, lora_request=None, mm_features=[],
                              cache_salt=None, block_hashes=[], num_tokens=len(tokens), kv_transfer_params=None)
    num = side.num_new_matched_tokens(request, 0)
    table = list(range(num_blocks))
    side.after_alloc(request, SimpleNamespace(get_block_ids=lambda: (table,)), num)
    meta = side.build_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=request_id, block_ids=(table,), num_computed_tokens=num)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]), num_scheduled_tokens={request_id: len(tokens) - num},
        finished_req_ids=set(), total_num_scheduled_tokens=len(tokens) - num))
    return num, meta


def test_a_prompts_tail_is_stored_in_steps_and_the_next_turn_loads_it(tmp_path):
    """tail_step: the tokens past a prompt's last whole chunk are saved in whole steps; a longer prompt that goes
    on from them (the next turn of a chat) loads whole chunks then that partial chunk, and saves its own tail."""
    pytest.importorskip("vllm")
    from kvfabric.config import Config
    from kvfabric.connectors.vllm.load_jobs import LoadState
    from kvfabric.kv.layout import KVLayout
    from tests.scheduler_fixtures import scheduler_asking

    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["disk"], "disk": {"path": str(tmp_path)}})
    layout = KVLayout(2, 1, 4, "float32")
    turn1 = list(range(2 * CHUNK + 40))
    with build_engine(config, layout, "m") as engine, \
            scheduler_asking(engine, config, layout, block_size=16, tail_step=16) as side:
        num, meta = _ask(side, "t1", turn1)
        (save,) = meta.saves
        assert num == 0 and (save.start, save.end, len(save.keys)) == (0, 2 * CHUNK + 32, 3)  # 40 -> 2 steps
        engine.store_chunks([(key, engine.new_payload(n)) for key, n in zip(save.keys, (CHUNK, CHUNK, 32))])
        engine.flush()
        side.forget("t1")
        turn2 = [*turn1, *range(9000, 9000 + CHUNK)]  # the answer and the next question
        num, meta = _ask(side, "t2", turn2)
        (load,) = meta.loads
        assert num == 2 * CHUNK + 32 and (load.start, load.end, load.keys_end) == (0, 2 * CHUNK + 32, 2 * CHUNK + 32)
        assert list(load.keys) == [*save.keys[:2], save.keys[2]]
        assert LoadState(load, CHUNK).chunk_tokens(2) == 32  # the partial chunk holds its 32 tokens
        (save2,) = meta.saves  # chunk 2 whole, now that this prompt completes it, then this prompt's own tail
        assert (save2.start, save2.end) == (2 * CHUNK, 3 * CHUNK + 32) and save2.keys[0] != save.keys[2]
        side.forget("t2")
        changed = [*turn1[:2 * CHUNK + 20], 7, *turn1[2 * CHUNK + 21:]]  # differs inside the stored tail
        assert _ask(side, "t3", changed)[0] == 2 * CHUNK  # 16 tokens agree, but only 32 were stored
    off = Config.from_dict({"chunk_size": CHUNK, "tiers": ["disk"], "disk": {"path": str(tmp_path)}})
    with build_engine(off, layout, "m") as engine, scheduler_asking(engine, off, layout, block_size=16) as side:
        num, meta = _ask(side, "t4", turn1)  # tail_step 0 (the side's default): whole chunks only
        assert num == 2 * CHUNK and [(s.start, s.end) for s in meta.saves] == []


def test_request_stats_add_up_across_steps_and_processes():
    import pickle

    pytest.importorskip("vllm")
    from kvfabric.connectors.vllm.metadata import KVFabricWorkerMetadata, RequestStats

    step1 = RequestStats(loaded_tokens=256, load_read_s=0.5, bytes_loaded=(("disk", 100),))
    step2 = RequestStats(loaded_tokens=256, failed_tokens=512, bytes_loaded=(("cpu", 7), ("disk", 50)))
    meta = KVFabricWorkerMetadata({"a": step1})
    meta.aggregate(pickle.loads(pickle.dumps(KVFabricWorkerMetadata({"a": step2, "b": RequestStats(saved_tokens=256)}))))
    assert meta.requests["b"].saved_tokens == 256
    params = meta.requests["a"].as_params()
    assert params == {"external_hit_tokens": 0, "local_hit_tokens": 0, "loaded_tokens": 512, "failed_tokens": 512,
                      "saved_tokens": 0, "load_read_s": 0.5, "bytes": {"cpu": 7, "disk": 150}}
    assert json.loads(json.dumps(params)) == params  # it rides in the request's output as plain JSON


def test_scheduler_counts_chunks_a_peer_holds(tmp_path):
    """With tier "peer", the scheduler's lookup asks the controller: chunks another instance holds are a hit (the
    worker's peer tier fetches them), chunks nobody holds are not."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from kvfabric.cluster.controller_app import create_app
    from kvfabric.cluster.index_memory import MemoryIndex
    from kvfabric.config import ClusterConfig, Config
    from kvfabric.kv.layout import KVLayout
    from tests.cluster_scripts.helpers import ControllerThread, wait_for
    from tests.scheduler_fixtures import scheduler_asking

    layout = KVLayout(2, 1, 4, "float32")
    controller = ControllerThread(create_app(MemoryIndex(), token="t", instance_ttl_s=30, sweep_interval_s=0.2)).start()
    try:
        def config(name: str) -> Config:
            return Config(chunk_size=CHUNK, tiers=("cpu", "peer"), cluster=ClusterConfig(
                controller_url=controller.url, token="t", instance_id=name, report_interval_s=0.05,
                heartbeat_interval_s=0.2, lookup_ttl_s=0.05))
        tokens = list(range(3 * CHUNK + 10))
        with build_engine(config("holder"), layout, "m") as holder, build_engine(config("vllm"), layout, "m") as \
                worker, scheduler_asking(worker, config("vllm"), layout) as side:
            request = SimpleNamespace(request_id="a", prompt_token_ids=tokens, lora_request=None, mm_features=[],
                                      cache_salt=None, block_hashes=[], num_tokens=len(tokens), kv_transfer_params=None)
            assert side.num_new_matched_tokens(request, 0) == 0  # nobody holds anything yet
            holder.store(tokens, torch.randn(layout.shape(2 * CHUNK)))  # chunks 0-1 only
            assert wait_for(lambda: side.num_new_matched_tokens(request, 0) == 2 * CHUNK)
    finally:
        controller.stop()


def test_hybrid_manager_specs_carry_every_groups_table_and_skip_chunks_whose_window_blocks_are_gone(tmp_path):
    """Several KV cache groups (window W=512, block 128): a load's window_from is vLLM's first window block of the
    hit; a save covers only chunks whose window blocks vLLM still holds (a local prefix hit nulls older ones)."""
    pytest.importorskip("vllm")
    from kvfabric.config import Config
    from kvfabric.connectors.vllm.config import KVGroups
    from kvfabric.kv.layout import KVLayout
    from tests.scheduler_fixtures import scheduler_asking

    config = Config.from_dict({"chunk_size": 256, "tiers": ["disk"], "disk": {"path": str(tmp_path)}})
    layout = KVLayout.from_layer_types(["sliding_attention", "full_attention"], 1, 4, 512, "float32")
    groups = KVGroups(128, 2, {"model.layers.0.self_attn.attn": 0, "model.layers.1.self_attn.attn": 1}, 512)
    with build_engine(config, layout, "m") as engine, \
            scheduler_asking(engine, config, layout, "layerwise", groups=groups) as side:  # loads ride the step
        _hybrid_specs(engine, side, layout)


def _hybrid_specs(engine, side, layout) -> None:
    from types import SimpleNamespace

    tokens = list(range(1100))
    engine.store(tokens[:512], torch.randn(layout.shape(512)))  # chunks 0-1 stored
    engine.flush()

    def request(req_id):
        return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, lora_request=None, mm_features=[],
                               cache_salt=None, block_hashes=[], num_tokens=len(tokens), kv_transfer_params=None)

    def step(req_id, local, window_table, full_table):
        blocks = SimpleNamespace(get_block_ids=lambda: (window_table, full_table))
        external = side.num_new_matched_tokens(request(req_id), local)
        side.after_alloc(request(req_id), blocks, external)
        computed = local + external
        return side.build_meta(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(window_table, full_table),
                                                num_computed_tokens=computed)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[]), num_scheduled_tokens={req_id: len(tokens) - computed},
            finished_req_ids=set(), total_num_scheduled_tokens=len(tokens) - computed))

    # a hit of 512 tokens loaded from kvfabric: vLLM nulls the window blocks before (512 - 511) // 128 = 0
    meta = step("a", 0, list(range(1, 10)), list(range(11, 20)))
    (load,) = meta.loads
    assert (load.start, load.end, load.window_from) == (0, 512, 0)
    assert load.group_block_ids == ([1, 2, 3, 4], [11, 12, 13, 14]) and load.table(1) == [11, 12, 13, 14]
    (save,) = meta.saves  # chunks 2-3 (0-1 are stored), each group's table
    assert (save.start, save.end) == (512, 1024) and save.group_block_ids[0] == list(range(1, 9))
    side.forget("a")
    # vLLM's own prefix cache held 1024 tokens: its window group's blocks before (1024 - 511) // 128 = 4 are null
    engine.delete(tokens[:256])  # chunk 0 gone from kvfabric: no external hit
    meta = step("b", 1024, [0, 0, 0, 0, 5, 6, 7, 8, 9], list(range(11, 20)))
    assert not meta.loads
    (save,) = meta.saves
    assert (save.start, save.end) == (512, 1024)  # chunks 0-1 lost their window rows: skipped, not stored
    assert side.window_chunks_skipped == 2


def test_hybrid_manager_failed_load_is_a_failed_receive_not_block_ids(tmp_path):
    """vLLM cannot map block ids of several KV cache groups back to requests (it raises): under the hybrid manager
    a failed load is reported through get_transfer_results' failed_recving, and no block id is."""
    pytest.importorskip("vllm")
    from kvfabric.config import Config
    from kvfabric.connectors.vllm.config import KVGroups
    from kvfabric.connectors.vllm.load_jobs import LoadOutcome
    from kvfabric.connectors.vllm.metadata import RequestStats
    from kvfabric.connectors.vllm.worker import WorkerSide
    from kvfabric.kv.layout import KVLayout

    config = Config.from_dict({"chunk_size": 256, "tiers": ["disk"], "disk": {"path": str(tmp_path)}})
    layout = KVLayout.from_layer_types(["sliding_attention", "full_attention"], 1, 4, 512, "float32")
    failed = LoadOutcome("r", 256, (3, 4), RequestStats(loaded_tokens=256, failed_tokens=256))
    for groups, blocks, receives in ((KVGroups(128, 2, {}, 512), set(), {"r"}), (KVGroups(128), {3, 4}, set())):
        side = WorkerSide(config, layout, "m", 128, {"load_threads": 1}, groups=groups)
        side._apply(failed)
        assert side.take_invalid_blocks() == blocks and side.take_failed_loads() == receives
        assert side.take_failed_loads() == set()  # reported once
        side.close()


def test_a_device_cache_given_to_the_cpu_worker_side_is_refused_in_one_line_naming_the_device(tmp_path):
    """The CPU backend's worker side never moves device tensors (vLLM on a GPU gets DeviceWorkerSide): one line
    saying so, not a shape error from inside the paged copy. A meta tensor stands in for the device tensor."""
    pytest.importorskip("vllm")
    from kvfabric.config import Config
    from kvfabric.connectors.vllm.worker import WorkerSide
    from kvfabric.kv.layout import KVLayout

    config = Config.from_dict({"chunk_size": 256, "tiers": ["disk"], "disk": {"path": str(tmp_path)}})
    side = WorkerSide(config, KVLayout(1, 2, 8, "float32"), "m", 16, {"load_threads": 1})
    try:
        with pytest.raises(ValueError, match=r"the KV cache is on meta, but vLLM's device is the CPU"):
            side.register({"model.layers.0.self_attn.attn": torch.empty(10, 2, 16, 16, device="meta")})
    finally:
        side.close()


def test_on_a_gpu_the_connector_asks_vllm_for_a_block_outermost_layout():
    """`get_required_kvcache_layout`: BLHNC by default on a GPU (a block's KV of every layer in one run), the
    configured `kv_cache_layout` otherwise, nothing for "" or on the CPU (one layout there); a name vLLM does not
    know is a one-line config error. Every name is a member of vLLM's own KVCacheLayout."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvfabric.config import ConfigError
    from kvfabric.connectors.vllm import KVFabricConnector

    def ask(device: str, extra: dict):
        config = SimpleNamespace(device_config=SimpleNamespace(device_type=device),
                                 kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
        return KVFabricConnector.get_required_kvcache_layout(config)

    assert ask("cuda", {}) == "BLHNC" and KVCacheLayout["BLHNC"].is_block_outermost
    assert ask("cuda", {"kv_cache_layout": "LBHNC"}) == "LBHNC" and ask("cuda", {"kv_cache_layout": ""}) is None
    assert ask("cpu", {}) is None
    with pytest.raises(ConfigError, match="kv_cache_layout: 'NCHW' is not one of"):
        ask("cuda", {"kv_cache_layout": "NCHW"})
    # layer-wise loads wait inside the forward: CUDA graphs must run piecewise then
    assert KVFabricConnector.requires_piecewise_for_cudagraph({"load_mode": "layerwise"})
    assert not KVFabricConnector.requires_piecewise_for_cudagraph({})


def test_a_prefix_whose_window_part_is_gone_is_not_promised(tmp_path):
    """A Gemma-3-like layout (window layers, W = 512): a chunk's window part has its own key and can be evicted
    alone. The scheduler asks the worker's cache, so it promises a prefix only with the window parts its load
    needs (CacheEngine.lookup's rule), held in process memory or on disk alike; parts older than the window are
    not needed."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from kvfabric.config import Config
    from kvfabric.kv.layout import KVLayout
    from kvfabric.kv.shapes import WindowSplit
    from kvfabric.tiers.factory import build_tiers
    from tests.scheduler_fixtures import scheduler_asking

    config = Config.from_dict({"chunk_size": 256, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})
    layout = KVLayout.from_layer_types(["sliding_attention", "full_attention"], 1, 4, 512, "float32")
    tokens = list(range(1100))  # 4 whole chunks: a hit of 1024 tokens needs the window parts of chunks 2 and 3
    request = SimpleNamespace(request_id="a", prompt_token_ids=tokens, lora_request=None, mm_features=[],
                              cache_salt=None, block_hashes=[], num_tokens=len(tokens), kv_transfer_params=None)
    cpu, disk = build_tiers(config, ("cpu", "disk"))
    with build_engine(config, layout, "m", tiers=[cpu, disk]) as engine, \
            scheduler_asking(engine, config, layout) as side:
        engine.store(tokens, torch.randn(layout.shape(1024)))
        engine.flush()
        keys = engine.keys(tokens)
        assert side.num_new_matched_tokens(request, 0) == 1024
        window = WindowSplit(layout).window
        for tier in (cpu, disk):
            assert tier.delete(window.key(keys[0]))  # older than the window: not needed
        assert side.num_new_matched_tokens(request, 0) == 1024
        assert disk.delete(window.key(keys[3]))  # still in process memory
        assert side.num_new_matched_tokens(request, 0) == 1024
        assert cpu.delete(window.key(keys[3]))  # gone everywhere: the prefix ends before chunk 3
        assert side.num_new_matched_tokens(request, 0) == 768
        assert engine.lookup(tokens) == 768  # the same answer as the cache's own lookup


def test_a_newcomer_waits_one_step_while_a_prefill_finishes(tmp_path):
    """hold_budget (the connector's hold_newcomers, vLLM's token budget): a request the scheduler has not seen gets
    "not yet" (None) while the step just planned left a prefill with at most the budget to compute, once; with no
    prefill finishing, or with hold_budget 0, it is looked up at once."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from kvfabric.config import Config
    from kvfabric.kv.layout import KVLayout
    from tests.scheduler_fixtures import scheduler_asking

    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["disk"], "disk": {"path": str(tmp_path)}})
    layout = KVLayout(2, 1, 4, "float32")
    budget = 2 * CHUNK

    def request(req_id, num_tokens):
        tokens = [hash((req_id, i)) % 30000 for i in range(num_tokens)]
        return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, lora_request=None, mm_features=[],
                               cache_salt=None, block_hashes=[], num_tokens=num_tokens, kv_transfer_params=None)

    def schedule(side, req, computed, scheduled, fresh=True):
        new = [SimpleNamespace(req_id=req.request_id, block_ids=(list(range(40)),), num_computed_tokens=computed)]
        cached = SimpleNamespace(req_ids=[req.request_id], new_block_ids=[None], num_computed_tokens=[computed],
                                 resumed_req_ids=set())
        return side.build_meta(SimpleNamespace(
            scheduled_new_reqs=new if fresh else [],
            scheduled_cached_reqs=cached if not fresh else SimpleNamespace(req_ids=[]),
            num_scheduled_tokens={req.request_id: scheduled}, finished_req_ids=set(),
            total_num_scheduled_tokens=scheduled))

    with build_engine(config, layout, "m") as engine, \
            scheduler_asking(engine, config, layout, hold_budget=budget) as side:
        a = request("a", 5 * CHUNK)
        assert side.num_new_matched_tokens(a, 0) == 0  # nothing finishing: looked up at once
        side.after_alloc(a, SimpleNamespace(get_block_ids=lambda: (list(range(40)),)), 0)
        schedule(side, a, 0, budget)  # 3 chunks left: more than the budget, a's prefill does not finish next step
        b = request("b", 3 * CHUNK)
        assert side.num_new_matched_tokens(b, 0) == 0
        schedule(side, a, budget, budget, fresh=False)  # 1 chunk left: a finishes in the next step
        c = request("c", 3 * CHUNK)
        assert side.num_new_matched_tokens(c, 0) is None  # held ...
        assert side.num_new_matched_tokens(c, 0) == 0  # ... once
        assert side.num_new_matched_tokens(a, budget) == 0  # a request the scheduler knows is never held
        schedule(side, a, 2 * budget, CHUNK, fresh=False)  # a's last chunk: nothing left to finish after it
        assert side.num_new_matched_tokens(request("d", CHUNK), 0) == 0
        side.forget("c")
        assert not side.held
    with build_engine(config, layout, "m") as engine, scheduler_asking(engine, config, layout) as side:  # off
        a = request("a", 3 * CHUNK)
        side.num_new_matched_tokens(a, 0)
        side.after_alloc(a, SimpleNamespace(get_block_ids=lambda: (list(range(40)),)), 0)
        schedule(side, a, 0, 2 * CHUNK)
        assert side.num_new_matched_tokens(request("b", CHUNK), 0) == 0
