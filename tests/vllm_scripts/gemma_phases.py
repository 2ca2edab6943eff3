"""Subprocess driver for tests/test_vllm_gemma.py: one vLLM engine on Gemma 3 per invocation, results as JSON.

    python gemma_phases.py PHASE --model DIR --cache DIR --out FILE [--prompts FILE] [--names p1,p2]

Gemma-3-270m: 18 layers, 15 with a 512-token sliding window (0-4, 6-10, 12-16), 3 full (5, 11, 17).
Phases (engine phases share connector_phases' engine set-up, serving and shutdown):
  prompts   test prompts (token ids, BOS first): long = 1100 tokens (4 whole 256-token chunks, 1024 > the window),
            exact = 768 tokens (3 whole chunks)
  baseline  engine without any connector (prefix caching off): greedy outputs
  store     engine A with KVFabricConnector and vLLM's hybrid KV cache manager off (one full-attention group),
            cold: serves the prompts, waits for their chunk files
  load      fresh engine B (manager off), same disk cache: serves the prompts again (asynchronous loads)
  layerwise the same with load_mode "layerwise" (synchronous loads, one layer ahead of the forward)
  hma_store engine with the connector and vLLM's hybrid KV cache manager on (its default with a SupportsHMA
            connector: 6 KV cache groups on Gemma 3), cold, its own disk cache (CACHE-hma), chunked prefill in
            steps of 384 tokens (vLLM frees window blocks before the prompt is done)
  hma_load  fresh engine, manager on, CACHE-hma: loads the prompts (window layers only from the window)
  hma_layerwise  manager on with load_mode "layerwise": records the start-up error (refused)
  hf        the stored chunks of `long`, read under the layout kvfabric's HF engine uses for Gemma 3 (its layer
            groups), against transformers' K/V of every layer, window layers included (no vLLM engine)
  hma_hf    the same for the chunks hma_store saved (CACHE-hma)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import connector_phases as base  # noqa: E402  (sets vLLM's environment defaults)

CHUNK = base.CHUNK
MODEL_ID = "kvfabric-test-gemma3"
KV_BYTES = 256 << 20  # ~7k fp32 tokens of Gemma-3-270m: ample for one request at a time
HMA_STEP_TOKENS = 384  # hma_store's prefill steps: chunk 1 spans two steps, chunk 0's window blocks go at step 3


def make_prompts(model: str) -> dict[str, list[int]]:
    import inspect
    import json as json_mod

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids_a = tok("Explain what the following Python code does.\n\n" + inspect.getsource(json_mod.decoder)).input_ids
    ids_b = tok(inspect.getsource(argparse)[20000:]).input_ids
    assert len(ids_a) > 1100 and len(ids_b) > 2800, (len(ids_a), len(ids_b))
    return {"long": ids_a[:1100], "exact": ids_a[:1] + ids_b[2000:2767]}


def compare_with_hf(model: str, cache: str, tokens: list[int]) -> dict:
    """Stored chunks of `tokens`, read under the layout kvfabric's HF engine derives for Gemma 3 (`layout_for`:
    its layer groups), vs transformers' K/V of the same tokens per layer group. The reference cache is a plain
    `DynamicCache()`: full-length layers, so window layers keep every row too (the model's own cache would keep
    their last W-1)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    from kvfabric import CacheEngine, Config
    from kvfabric.cache.protocol import ChunkHit
    from kvfabric.config import DiskTierConfig
    from kvfabric.engines.runtime import layout_for

    layout = layout_for(AutoConfig.from_pretrained(model), "float32")
    engine = CacheEngine(Config(chunk_size=CHUNK, tiers=("disk",), disk=DiskTierConfig(path=cache)), layout, MODEL_ID)
    # every whole chunk, both parts (retrieve would zero the window rows a continuation no longer reads); under a
    # layout without Gemma's groups the keys differ: a miss
    parts = []
    for key in engine.keys(tokens)[:len(tokens) // CHUNK]:
        out = torch.empty(layout.shape(CHUNK), dtype=layout.torch_dtype)
        if not isinstance(engine.read_into(key, out), ChunkHit):
            break
        parts.append(out)
    engine.close()
    stored = torch.cat(parts, dim=3)  # [L, 2, H, T, D]
    num = stored.shape[3]
    torch.set_num_threads(2)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        kv = hf(torch.tensor([tokens[:num]]), past_key_values=DynamicCache(), use_cache=True).past_key_values
    ref = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in kv.layers])  # [L, 2, H, T, D]
    assert ref.shape == stored.shape, (tuple(ref.shape), tuple(stored.shape))
    groups = {}
    for group in layout.groups:
        layers = list(group.layers)
        diff = (stored[layers] - ref[layers]).abs()
        stale = group.window_start(num)  # rows a window layer no longer reads after num tokens
        groups["window" if group.window else "full"] = {
            "layers": layers, "window": group.window, "max_diff_k": diff[:, 0].max().item(),
            "max_diff_v": diff[:, 1].max().item(), "max_abs": ref[layers].abs().max().item(),
            "stale_rows_max_abs": stored[layers, :, :, :stale].abs().max().item() if stale else None}
    return {"tokens": num, "groups": groups, "layout_groups": len(layout.groups)}


def refused_layerwise(model: str, cache: str) -> dict:
    try:
        base.make_llm(model, cache, "layerwise", model_id=MODEL_ID, kv_bytes=KV_BYTES)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"error_type": type(exc).__name__, "error": str(exc)}
    return {"error": None}


def main() -> None:
    args, names = base.parse_args(["prompts", "baseline", "store", "load", "layerwise", "hma_store", "hma_load",
                                   "hma_layerwise", "hf", "hma_hf"])
    out: dict = {"phase": args.phase}
    prompts = json.loads(Path(args.prompts).read_text())["prompts"] if args.prompts else {}
    hma = args.phase.startswith("hma")
    cache = args.cache + "-hma" if hma else args.cache  # the manager-on engines' own chunks
    if args.phase == "prompts":
        out["prompts"] = make_prompts(args.model)
    elif args.phase in ("hf", "hma_hf"):
        out["hf"] = compare_with_hf(args.model, cache, prompts[names[0]])
    elif args.phase == "hma_layerwise":
        out["hma_layerwise"] = refused_layerwise(args.model, cache)
    else:
        started = time.perf_counter()
        # the connector is SupportsHMA: vLLM keeps its hybrid manager on unless told otherwise
        manager = {} if hma or args.phase == "baseline" else {"disable_hybrid_kv_cache_manager": True}
        if args.phase == "hma_store":  # chunked prefill (steps of 384 tokens): window blocks are freed meanwhile
            manager["max_num_batched_tokens"] = HMA_STEP_TOKENS
        llm = base.make_llm(args.model, None if args.phase == "baseline" else cache, args.phase,
                            prefix_caching=args.phase != "baseline", model_id=MODEL_ID, kv_bytes=KV_BYTES, **manager)
        out["startup_s"] = round(time.perf_counter() - started, 1)
        out["results"] = base.serve(llm, prompts, names)
        if args.phase in ("store", "hma_store"):  # a Gemma chunk is two files: full layers, window layers
            out["chunk_files"] = base.wait_for_chunks(cache, 2 * sum(len(prompts[n]) // CHUNK for n in names))
        out["worker_stats"] = base.shutdown(llm, cache, args.phase)
    base.write_and_exit(args.out, out)


if __name__ == "__main__":
    main()
