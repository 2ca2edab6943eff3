"""`kvfabric bench vllm`: TTFT of a real vLLM (CPU) with and without KVFabricConnector.

For each prompt size (default 1k / 4k / 8k tokens, distinct texts so that no prompt is a prefix of another):

    cold        engine without any connector, first time it sees the prompt
    kvf cold    engine with kvfabric, cold: the miss path (lookup, gather, background store)  -> overhead vs cold
    paired      in the kvfabric engine, a same-size prompt with kvfabric switched off for that request
                (kv_transfer_params), measured just before: the miss-path overhead without engine-to-engine noise
    floor       vLLM's own prefix-cache hit: the same prompt again in the no-connector engine
    kvf hit     a FRESH engine with kvfabric on the same cache: cross-process reuse         -> ratio vs floor

plus the tokens and bytes kvfabric loaded per tier, and the tokens each hit reused (vLLM's own hit recomputes
the prompt's last block). TTFT = wall time of `generate(max_tokens=1)`. The columns come from three engine
processes (start-ups of ~1 min); every engine gets a warm-up request first, and `VLLM_CPU_OMP_THREADS_BIND` is set
explicitly (a kv_transfer_config changes vLLM's default binding, which would skew the comparison). vLLM must be
importable by the Python that runs the engines: this one, or `--python`, or the repository's `.venv-vllm`
(scripts/setup_vllm_venv.sh).

Entry points: `main(argv)` (argparse; `--json` prints one JSON object per size), `run(...)` returns the rows.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_SIZES = (1024, 4096, 8000)
CHUNK = 256
MODEL_ID = "kvfabric-bench"
MAX_MODEL_LEN = 8192
WARMUP_TOKENS = 300


# ---- parent ------------------------------------------------------------------------------------------------
def find_python(python: str | None = None) -> str:
    if python:
        return python
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    repo = Path(__file__).resolve().parents[3]
    candidate = repo / ".venv-vllm" / "bin" / "python"
    if candidate.exists():
        return str(candidate)
    raise SystemExit("vLLM is not importable here and .venv-vllm is missing: run scripts/setup_vllm_venv.sh "
                     "or pass --python")


def make_prompts(model: str, sizes: Sequence[int]) -> dict[str, list[int]]:
    """Disjoint token slices of deterministic text (Python's own sources): for each size a measured prompt and a
    same-size "off" prompt (the paired miss-path baseline), plus a warm-up prompt."""
    import argparse as argparse_mod
    import inspect
    import json as json_mod
    import logging
    import typing

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    import dataclasses
    import subprocess as subprocess_mod
    import tarfile
    import zipfile

    modules = (argparse_mod, typing, logging, json_mod.decoder, json_mod.encoder, inspect, dataclasses,
               subprocess_mod, tarfile, zipfile)
    ids = tok("\n".join(inspect.getsource(m) for m in modules)).input_ids
    need = 2 * sum(sizes) + WARMUP_TOKENS
    if len(ids) < need:
        raise SystemExit(f"not enough text for {need} tokens ({len(ids)})")
    prompts, at = {"warmup": ids[:WARMUP_TOKENS]}, WARMUP_TOKENS
    for size in sizes:
        for name in (str(size), f"{size}/off"):
            prompts[name] = ids[at:at + size]
            at += size
    return prompts


def _child(python: str, spec: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    spec_path = workdir / f"spec-{spec['mode']}.json"
    spec["out"] = str(workdir / f"result-{spec['mode']}.json")
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the kvfabric CLI does: spinning OpenMP collapses on busy cores
    log = workdir / f"engine-{spec['mode']}.log"
    with open(log, "w") as f:
        proc = subprocess.run([python, "-m", "kvfabric.bench.vllm", "--_engine", str(spec_path)], stdout=f,
                              stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=workdir)
    if proc.returncode != 0 or not Path(spec["out"]).exists():
        raise RuntimeError(f"engine {spec['mode']} failed (rc={proc.returncode}); log: {log}\n"
                           + log.read_text()[-4000:])
    return json.loads(Path(spec["out"]).read_text())


def run(sizes: Sequence[int] = DEFAULT_SIZES, as_json: bool = False, python: str | None = None,
        model: str | None = None, workdir: str | None = None, timeout: float = 3600) -> list[dict[str, Any]]:
    python = find_python(python)
    if model is None:
        from kvfabric.engines.model import ensure_model
        model = str(ensure_model())
    sizes = [int(s) for s in sizes]
    if max(sizes) >= MAX_MODEL_LEN:
        raise SystemExit(f"sizes must be below max_model_len={MAX_MODEL_LEN}")
    work = Path(workdir or tempfile.mkdtemp(prefix="kvfabric-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    prompts_path = work / "prompts.json"
    prompts_path.write_text(json.dumps(make_prompts(model, sizes)))
    common = {"model": model, "prompts": str(prompts_path), "cache": str(cache), "sizes": sizes}
    log = (lambda msg: None) if as_json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    results = {}
    for mode in ("plain", "kvfabric-cold", "kvfabric-hit"):
        log(f"[bench vllm] engine {mode} ...")
        results[mode] = _child(python, {**common, "mode": mode}, work, timeout)
        log(f"[bench vllm] engine {mode}: start-up {results[mode]['startup_s']} s, "
            f"{json.dumps(results[mode]['ttft'])}")
    rows = []
    for size in sizes:
        key = str(size)
        cold = results["plain"]["ttft"][key]["cold"]
        floor = results["plain"]["ttft"][key]["hit"]
        kvf_cold = results["kvfabric-cold"]["ttft"][key]["cold"]
        hit = results["kvfabric-hit"]["ttft"][key]
        kvf = results["kvfabric-cold"]["ttft"][key]
        rows.append({
            "tokens": size, "cold_s": cold, "kvf_cold_s": kvf_cold, "miss_overhead": kvf_cold / cold - 1,
            "paired_off_s": kvf["off"], "miss_overhead_paired": kvf_cold / kvf["off"] - 1,
            "floor_s": floor, "floor_reused": results["plain"]["ttft"][key]["hit_cached"],
            "kvf_hit_s": hit["cold"], "hit_vs_floor": hit["cold"] / floor, "kvf_reused": hit["cold_cached"],
            "loaded_tokens": hit.get("loaded_tokens", 0), "bytes_loaded": hit.get("bytes_loaded", {}),
            "stored_chunks": kvf.get("chunk_files"),
        })
    if as_json:
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        from kvfabric.bench.common import emit
        table = [{"tokens": row["tokens"], "cold": row["cold_s"], "kvf cold": row["kvf_cold_s"],
                  "miss": f"{row['miss_overhead']:+.1%}", "paired off": row["paired_off_s"],
                  "miss paired": f"{row['miss_overhead_paired']:+.1%}", "floor": row["floor_s"],
                  "kvf hit": row["kvf_hit_s"], "hit/floor": f"{row['hit_vs_floor']:.2f}x",
                  "reused floor/kvf": f"{row['floor_reused']}/{row['kvf_reused']}",
                  "loaded": ", ".join(f"{t} {b / 2**20:.0f}MiB" for t, b in row["bytes_loaded"].items())}
                 for row in rows]
        emit(table, False, "vLLM + kvfabric TTFT (s)", list(table[0]))
        print(f"work dir: {work}", file=sys.stderr)
    return rows


# ---- child: one engine -------------------------------------------------------------------------------------
def _engine(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    mode, cache = spec["mode"], spec["cache"]
    prompts = json.loads(Path(spec["prompts"]).read_text())
    stats_path = Path(cache).parent / f"stats-{mode}.json"
    kwargs: dict[str, Any] = dict(model=spec["model"], dtype="float32", enforce_eager=True,
                                  max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=2 << 30, max_num_seqs=4, seed=0)
    if mode != "plain":
        from kvfabric.connectors.vllm import kv_transfer_config
        kwargs["kv_transfer_config"] = kv_transfer_config({
            "chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": cache}, "model_id": MODEL_ID,
            "stats_path": str(stats_path)})
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=1)
    params_off = SamplingParams(temperature=0.0, max_tokens=1,
                                extra_args={"kv_transfer_params": {"kvfabric": {"load": False, "store": False}}})

    def ttft(tokens: list[int], off: bool = False) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params_off if off else params, use_tqdm=False)
        return time.perf_counter() - t0, int(out[0].num_cached_tokens or 0)

    def worker_counters() -> dict[str, Any]:
        try:
            return json.loads(stats_path.read_text())["connector"]
        except (OSError, ValueError, KeyError):
            return {}

    def chunk_files() -> int:
        return sum(1 for _ in Path(cache).glob("??/*.kvc")) if Path(cache).exists() else 0

    ttft(prompts["warmup"])
    out: dict[str, Any] = {}
    for size in spec["sizes"]:
        key = str(size)
        row: dict[str, Any] = {}
        if mode == "kvfabric-hit":
            before = worker_counters()
            row["cold"], row["cold_cached"] = ttft(prompts[key])
            after = worker_counters()
            row["loaded_tokens"] = after.get("loaded_tokens", 0) - before.get("loaded_tokens", 0)
            row["bytes_loaded"] = {k.split(".", 1)[1]: after[k] - before.get(k, 0) for k in after
                                   if k.startswith("bytes_loaded.") and after[k] != before.get(k, 0)}
        else:
            if mode == "kvfabric-cold":  # same-size prompt, kvfabric off for this request: the paired baseline
                row["off"], _ = ttft(prompts[f"{key}/off"], off=True)
            expected = chunk_files() + size // CHUNK
            row["cold"], row["cold_cached"] = ttft(prompts[key])
            if mode == "plain":
                row["hit"], row["hit_cached"] = ttft(prompts[key])
            else:  # let the background save finish before the next measurement
                deadline = time.time() + 120
                while chunk_files() < expected and time.time() < deadline:
                    time.sleep(0.1)
                row["chunk_files"] = chunk_files()
        out[key] = row
        print(f"[{mode}] {key}: {json.dumps(row)}", flush=True)
    Path(spec["out"]).write_text(json.dumps({"mode": mode, "startup_s": round(startup, 1), "ttft": out}))
    try:
        llm.llm_engine.engine_core.shutdown(timeout=30)
    except Exception as exc:  # noqa: BLE001
        print(f"engine shutdown: {exc!r}", flush=True)
    sys.stdout.flush()
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt size")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="prompt sizes in tokens")
    ap.add_argument("--python", default=None, help="Python with vLLM installed (default: this one or .venv-vllm)")
    ap.add_argument("--model", default=None, help="HF model folder (default: kvfabric's SmolLM2 via ensure_model)")
    ap.add_argument("--workdir", default=None, help="where the cache, prompts and engine logs go (default: a temp dir)")
    ap.add_argument("--_engine", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._engine:
        _engine(args._engine)
        return 0
    run([int(s) for s in args.sizes.split(",") if s], as_json=args.json, python=args.python, model=args.model,
        workdir=args.workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
