"""Subprocess driver for tests/test_vllm_connector.py: one vLLM engine per invocation, results as JSON.

    python connector_phases.py PHASE --model DIR --cache DIR --out FILE [--prompts FILE]

Phases (--names: the prompts to serve, in order, "NAME@SALT" for a request with that cache_salt; for corrupt:
"PROMPT,CHUNK_INDEX"; for concurrent: "DECODE,HIT"):
  prompts   write the test prompts (token ids) to --out (no vLLM engine)
  baseline  engine without any connector (prefix caching off): greedy outputs of every prompt
  store     engine A with KVFabricConnector: serves `store` prompts (cold: stores their chunks); waits for the files
  corrupt   flip payload bytes of one stored chunk (no vLLM engine)
  load      fresh engine B with KVFabricConnector on the same cache: serves `load` prompts in order
  layerwise fresh engine with load_mode "layerwise" (synchronous, per-layer loads): serves prompts in order
  concurrent fresh engine (async loads): DECODE decodes; once it has tokens, HIT (a cached prompt) is added;
            records which request got tokens in each engine output, to show DECODE decoding while HIT waits
  hf        compare the stored chunks of one prompt with Hugging Face transformers' K/V (no vLLM engine)

Each engine phase writes {"results": {name: {"tokens", "text", "num_cached_tokens", "kvfabric", "seconds"}}, ...}.
Engines must be created under `if __name__ == "__main__"` (vLLM spawns its processes).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # a kv_transfer_config changes vLLM's default binding
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

CHUNK = 256
MODEL_ID = "kvfabric-test-smollm2"
MAX_TOKENS = 12


def stats_path(cache: str, phase: str) -> Path:
    return Path(cache).parent / f"stats-{phase}.json"


def extra_config(cache: str, phase: str, model_id: str = MODEL_ID) -> dict:
    return {"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": cache}, "model_id": model_id,
            "stats_path": str(stats_path(cache, phase)), "key_mode": os.environ.get("KVFABRIC_TEST_KEY_MODE", "tokens"),
            "load_mode": "layerwise" if phase == "layerwise" else "async"}


def make_prompts(model: str) -> dict[str, list[int]]:
    """Token-id prompts from deterministic text (Python's own sources): p1 1000 tokens, p2 800 tokens,
    p3 = p1[:600] + other text (shares p1's first two 256-token chunks), p4 exactly 768 tokens (3 whole chunks)."""
    import inspect
    import json as json_mod
    import textwrap

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text_a = textwrap.dedent(inspect.getsource(json_mod.decoder)) + inspect.getsource(json_mod.encoder)
    text_b = inspect.getsource(argparse)[20000:]
    ids_a = tok("Explain what the following Python code does.\n\n" + text_a).input_ids
    ids_b = tok("Summarize this module in one sentence.\n\n" + text_b).input_ids
    assert len(ids_a) > 3000 and len(ids_b) > 3000, (len(ids_a), len(ids_b))
    p1 = ids_a[:1000]
    p2 = ids_b[:800]
    p3 = ids_a[:600] + ids_b[1000:1300]
    p4 = ids_b[2000:2768]
    return {"p1": p1, "p2": p2, "p3": p3, "p4": p4}


def make_llm(model: str, cache: str | None, phase: str = "", prefix_caching: bool = True, model_id: str = MODEL_ID,
             kv_bytes: int = 1 << 30, **overrides):
    from vllm import LLM

    kwargs = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=4,
                  kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=prefix_caching, seed=0, **overrides)
    if cache is not None:
        from kvfabric.connectors.vllm import kv_transfer_config

        kwargs["kv_transfer_config"] = kv_transfer_config(extra_config(cache, phase, model_id))
    return LLM(**kwargs)


def token_prompt(prompts: dict[str, list[int]], name: str):
    """The TokensPrompt of "NAME" or "NAME@SALT" (with that cache_salt)."""
    from vllm.inputs import TokensPrompt

    base, _, salt = name.partition("@")
    return TokensPrompt(prompt_token_ids=prompts[base], **({"cache_salt": salt} if salt else {}))


def serve(llm, prompts: dict[str, list[int]], names: list[str]) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = {}
    for name in names:  # one at a time: each request sees what the previous ones stored
        started = time.perf_counter()
        out = llm.generate([token_prompt(prompts, name)], params, use_tqdm=False)[0]
        results[name] = {
            "tokens": list(out.outputs[0].token_ids),
            "text": out.outputs[0].text,
            "num_cached_tokens": out.num_cached_tokens,
            "kvfabric": (out.kv_transfer_params or {}).get("kvfabric"),
            "seconds": round(time.perf_counter() - started, 3),
        }
        print(f"[{name}] {json.dumps(results[name])}", flush=True)
    return results


def concurrent(llm, prompts: dict[str, list[int]], decode: str, hit: str) -> dict:
    """DECODE runs alone until it has 2 tokens, then HIT joins. Per engine output: tokens so far per request."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3 * MAX_TOKENS, ignore_eos=True)
    engine.add_request(decode, token_prompt(prompts, decode), params)
    steps: list[dict[str, int]] = []
    done: dict[str, dict] = {}
    counts: dict[str, int] = {}
    hit_added = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                done[out.request_id] = {"tokens": list(out.outputs[0].token_ids),
                                        "num_cached_tokens": out.num_cached_tokens,
                                        "kvfabric": (out.kv_transfer_params or {}).get("kvfabric")}
        steps.append(dict(counts))
        if not hit_added and counts.get(decode, 0) >= 2:
            engine.add_request(hit, token_prompt(prompts, hit), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                             ignore_eos=True))
            hit_added = True
            steps.append({"hit_added": 1})
    return {"results": done, "steps": steps}


def num_chunk_files(num_tokens: int, tail_step: int = 64) -> int:
    """Files a prompt's KV is stored in: its whole chunks, and its tail past them when that holds a whole step (the
    connector's default tail_step)."""
    return num_tokens // CHUNK + (1 if num_tokens % CHUNK >= tail_step else 0)


def wait_for_chunks(cache: str, expected: int, timeout: float = 60.0) -> int:
    deadline = time.time() + timeout
    while True:
        found = len(glob.glob(os.path.join(cache, "??", "*.kvc")))
        if found >= expected or time.time() > deadline:
            return found
        time.sleep(0.2)


def model_layout(model: str):
    from transformers import AutoConfig

    from kvfabric.kv.layout import KVLayout

    cfg = AutoConfig.from_pretrained(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, "float32")


def chunk_key(model: str, tokens: list[int], index: int) -> bytes:
    from kvfabric.kv.hashing import chunk_keys, root_key

    return chunk_keys(tokens, root_key(MODEL_ID, model_layout(model), CHUNK), CHUNK)[index]


def compare_with_hf(model: str, cache: str, tokens: list[int]) -> dict:
    """Max |difference| between the stored chunks of `tokens` and transformers' K/V for the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvfabric import CacheEngine, Config

    engine = CacheEngine(Config.from_dict({"chunk_size": CHUNK, "tiers": ["disk"], "disk": {"path": cache}}),
                         model_layout(model), MODEL_ID)
    stored = engine.retrieve(tokens)  # [L, 2, H, T, D]
    num = stored.shape[3]
    torch.set_num_threads(2)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:num]]), use_cache=True)
    cache_obj = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    diff_k = diff_v = scale = 0.0
    for layer in range(stored.shape[0]):
        k, v = cache_obj.layers[layer].keys[0], cache_obj.layers[layer].values[0]  # [H, T, D]
        diff_k = max(diff_k, (k - stored[layer, 0]).abs().max().item())
        diff_v = max(diff_v, (v - stored[layer, 1]).abs().max().item())
        scale = max(scale, k.abs().max().item(), v.abs().max().item())
    return {"tokens": num, "max_diff_k": diff_k, "max_diff_v": diff_v, "max_abs": scale}


def parse_args(phases: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command line of a phase driver (see the module doc): (args, the --names list)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=phases)
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts")
    ap.add_argument("--names", default="")
    args = ap.parse_args()
    return args, [n for n in args.names.split(",") if n]


def main() -> None:
    args, names = parse_args(["prompts", "baseline", "store", "corrupt", "load", "hf", "layerwise", "concurrent"])
    out: dict = {"phase": args.phase}
    if args.phase == "prompts":
        out["prompts"] = make_prompts(args.model)
    else:
        prompts = json.loads(Path(args.prompts).read_text())["prompts"] if args.prompts else {}
        if args.phase == "hf":
            out["hf"] = compare_with_hf(args.model, args.cache, prompts[names[0]])
        elif args.phase == "corrupt":
            name, index = names[0], int(names[1])
            key = chunk_key(args.model, prompts[name], index)
            path = Path(args.cache) / key.hex()[:2] / (key.hex() + ".kvc")
            data = bytearray(path.read_bytes())
            for i in range(len(data) // 2, len(data) // 2 + 64):  # inside the payload; header stays valid
                data[i] ^= 0xFF
            path.write_bytes(bytes(data))
            out["corrupted"] = str(path)
        else:
            started = time.perf_counter()
            llm = make_llm(args.model, None if args.phase == "baseline" else args.cache, args.phase,
                           prefix_caching=args.phase != "baseline")
            out["startup_s"] = round(time.perf_counter() - started, 1)
            if args.phase == "concurrent":
                out.update(concurrent(llm, prompts, *names))
            else:
                out["results"] = serve(llm, prompts, names)
            if args.phase == "store":
                expected = sum(num_chunk_files(len(prompts[n.partition("@")[0]])) for n in names)
                out["chunk_files"] = wait_for_chunks(args.cache, expected)
            out["worker_stats"] = shutdown(llm, args.cache, args.phase)
    write_and_exit(args.out, out)


def shutdown(llm, cache: str, phase: str) -> dict | None:
    """Stop the engine gracefully (the worker's connector flushes its saver and writes its stats): those stats."""
    try:
        llm.llm_engine.engine_core.shutdown(timeout=30)
    except Exception as exc:  # noqa: BLE001
        print(f"engine shutdown: {exc!r}", flush=True)
    stats = stats_path(cache, phase)
    return json.loads(stats.read_text()) if stats.exists() else None


def write_and_exit(path: str, out: dict) -> None:
    Path(path).write_text(json.dumps(out))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (vLLM's atexit hooks can hang after the engine is gone)


if __name__ == "__main__":
    main()
