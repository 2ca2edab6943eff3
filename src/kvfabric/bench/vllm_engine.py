"""The engine side of `kvfabric bench vllm`: one vLLM engine per process, run by the parent as
`python -m kvfabric.bench.vllm_engine SPEC.json` (modes plain, kvfabric-cold, kvfabric-hit, lmcache-cold,
lmcache-hit; see kvfabric.bench.vllm), results written as JSON to the spec's `out`.

Also `pagecache_copy_bps` (the physical floor of a load from the disk tier) and `itl_under_load` (a decoding
request's inter-token latency alone and while a cached prompt joins and loads asynchronously).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvfabric.bench.vllm import CHUNK, MAX_MODEL_LEN, MODEL_ID, cpu_bind


def run_engine(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    tp, pp = spec.get("tp", 1), spec.get("pp", 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(tp * pp))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    mode, cache = spec["mode"], spec["cache"]
    prompts = json.loads(Path(spec["prompts"]).read_text())
    stats_path = Path(cache).parent / f"stats-{mode}.json"
    # eager except under pipeline parallelism: vllm-cpu allocates a later stage's intermediate tensors in its
    # warm-up, which it skips when eager, and PP=2 then fails its first request (docs/vllm.md)
    kwargs: dict[str, Any] = dict(model=spec["model"], dtype="float32", enforce_eager=pp == 1,
                                  max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=1 << 30, max_num_seqs=4, seed=0,
                                  tensor_parallel_size=tp, pipeline_parallel_size=pp)
    if mode.startswith("kvfabric"):
        from kvfabric.connectors.vllm import kv_transfer_config
        kwargs["kv_transfer_config"] = kv_transfer_config({
            "chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": cache}, "model_id": MODEL_ID,
            "save_partial_chunk": True,  # an exact repeat then reuses all but one token (vLLM: all but the last block)
            "stats_path": str(stats_path)})
    elif mode.startswith("lmcache"):
        kwargs["kv_transfer_config"] = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": spec["lmcache"]}
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

    def worker_counters() -> list[dict[str, Any]]:  # one per rank (rank r > 0 writes stats_path.rank{r})
        counters = []
        for rank in range(tp * pp):
            try:
                path = stats_path if rank == 0 else Path(f"{stats_path}.rank{rank}")
                counters.append(json.loads(path.read_text())["connector"])
            except (OSError, ValueError, KeyError):
                counters.append({})
        return counters

    def chunk_files() -> set[str]:
        return {str(p) for p in Path(cache).glob("??/*.kvc")} if Path(cache).exists() else set()

    def wait_stored(expected: int) -> None:  # let the background save finish before the next measurement
        deadline = time.time() + 120
        while len(chunk_files()) < expected and time.time() < deadline:
            time.sleep(0.1)

    ttft(prompts["warmup"])
    out: dict[str, Any] = {}
    files: dict[str, list[str]] = {}
    for size in spec["sizes"]:
        key = str(size)
        row: dict[str, Any] = {}
        if mode.endswith("-hit"):
            # fresh-engine hits: the prompt, then the same-size "on" prompts, which the cold engine stored too;
            # each sample's load figures from the worker's counters (load_s: wall time of the load; the others
            # summed over the load threads)
            samples, loads = [], []
            for name in [key] + [f"{key}/on{r}" for r in range(1, spec["repeats"])]:
                read_files(spec.get("files", {}).get(name, []))  # in the page cache, as the floor reads them
                before = worker_counters()
                samples.append(ttft(prompts[name]))
                loads.append(load_figures(before, worker_counters()))
            row["cold"], row["cold_cached"] = samples[0]
            row.update(loads[0])  # the first sample's, as before; the per-sample lists beside them
            row["load_samples"] = loads
            row["hits"], row["hits_cached"] = [t for t, _ in samples], [n for _, n in samples]
            if spec.get("files"):
                row["pagecache_copy_bps"] = pagecache_copy_bps(spec["files"][key])
                row["memcpy_bps"] = memcpy_bps(max(os.path.getsize(p) for p in spec["files"][key]))
        elif mode == "kvfabric-cold":  # paired: kvfabric off, then on, for distinct same-size prompts
            row["off"], row["on"] = [], []
            for r in range(spec["repeats"]):
                row["off"].append(ttft(prompts[f"{key}/off{r}"], off=True)[0])
                known = chunk_files()
                name = key if r == 0 else f"{key}/on{r}"
                row["on"].append(ttft(prompts[name])[0])
                wait_stored(len(known) + -(-size // CHUNK) * spec.get("writers", 1))  # and the partial last one
                files[name] = sorted(chunk_files() - known)
            row["cold"] = row["on"][0]
        else:
            row["cold"], row["cold_cached"] = ttft(prompts[key])
            if mode == "plain":  # vLLM's own prefix-cache hit, `repeats` times (the KV stays in its cache)
                samples = [ttft(prompts[key]) for _ in range(spec["repeats"])]
                row["hit"], row["hit_cached"] = samples[0]
                row["hits"] = [t for t, _ in samples]
            elif mode == "lmcache-cold":  # stores the "on" prompts too: the hit engine's further samples
                for r in range(1, spec["repeats"]):
                    ttft(prompts[f"{key}/on{r}"])
        out[key] = row
        print(f"[{mode}] {key}: {json.dumps(row)}", flush=True)
    result: dict[str, Any] = {"mode": mode, "startup_s": round(startup, 1), "ttft": out, "files": files}
    if mode == "kvfabric-cold":  # the prompt the hit engine loads while another request decodes
        known = chunk_files()
        ttft(prompts["itl"])
        wait_stored(len(known) + -(-len(prompts["itl"]) // CHUNK) * spec.get("writers", 1))
    if mode == "kvfabric-hit":
        result["itl"] = itl_under_load(llm, prompts)
        print(f"[{mode}] itl: {json.dumps(result['itl'])}", flush=True)
    Path(spec["out"]).write_text(json.dumps(result))
    try:
        llm.llm_engine.engine_core.shutdown(timeout=30)
    except Exception as exc:  # noqa: BLE001
        print(f"engine shutdown: {exc!r}", flush=True)
    sys.stdout.flush()
    os._exit(0)


def load_figures(befores: Sequence[dict[str, Any]], afters: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One load's figures from the workers' counters before and after it. With several ranks (each loading its
    share at once) the slowest rank's: its time, its bytes (the load floor is that of the rank's bytes), and the
    tokens every rank loaded (the same)."""
    rows = [_load_figures(before, after) for before, after in zip(befores, afters)]
    return max(rows, key=lambda row: row["load_s"])


def _load_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"loaded_tokens": after.get("loaded_tokens", 0) - before.get("loaded_tokens", 0)}
    for name in ("load_read_ns", "load_chunk_read_ns", "load_scatter_ns", "load_verify_ns"):
        row[name.replace("_ns", "_s")] = (after.get(name, 0) - before.get(name, 0)) / 1e9
    row["load_s"] = row.pop("load_read_s")
    row["bytes_loaded"] = {k.split(".", 1)[1]: after[k] - before.get(k, 0) for k in after
                           if k.startswith("bytes_loaded.") and after[k] != before.get(k, 0)}
    return row


def read_files(paths: Sequence[str]) -> None:
    """Read these files once (into the page cache). The floor (`pagecache_copy_bps`) reads chunk files from the
    page cache, so the load it is compared with must too: a sandbox's host may drop a guest's page cache within a
    minute (seen here: 3.5 GB cached fell to 2.4 GB in 45 s with 23 GB free), and a fresh-engine load of chunks
    written minutes before then read the virtual disk (8k: 8.9x the floor for the oldest files, 3.5x the newest)."""
    for path in paths:
        with open(path, "rb") as f:
            while f.read(8 << 20):
                pass


def pagecache_copy_bps(paths: Sequence[str], repeats: int = 5) -> float:
    """Bytes/s of reading these files (in the page cache: just written and read) into one buffer and copying each
    into a buffer touched before (numpy, one thread): the physical floor of a load from the disk tier. Best of
    `repeats`. (A torch copy_ here forked its OpenMP team and ran at 1.5-5 GB/s from run to run.)"""
    import numpy as np

    sizes = [os.path.getsize(p) for p in paths]
    buf = np.zeros(max(sizes), dtype=np.uint8)
    dst = np.zeros(max(sizes), dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for path, size in zip(paths, sizes):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.preadv(fd, [memoryview(buf)[:size]], 0)
            finally:
                os.close(fd)
            np.copyto(dst[:size], buf[:size])
        best = min(best, time.perf_counter() - started)
    return sum(sizes) / best


def memcpy_bps(size: int, repeats: int = 5) -> float:
    """Bytes/s of one memcpy of `size` bytes between two buffers touched before (the unit of a load's CPU work:
    the bench reports the verification's time in memcpys of the same bytes). Best of `repeats`."""
    import numpy as np

    src, dst = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return size / best


def itl_under_load(llm: Any, prompts: dict[str, list[int]], num_tokens: int = 48, joins: int = 5) -> dict[str, Any]:
    """Inter-token latency of a decoding request alone, and while a cached long prompt (`itl`) joins and waits for
    its asynchronous load, `joins` times (vLLM's prefix cache reset before each, so that every join loads the
    prompt through kvfabric again): the median ITL of the tokens produced during the loads over the median alone.
    A fast load covers few tokens; the joins together give enough of them for a median (`num_during`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    decode = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)

    def one(tag: str, join: bool) -> tuple[list[float], float | None, float | None]:
        engine.add_request(f"d-{tag}", TokensPrompt(prompt_token_ids=prompts["warmup"]), decode)
        times: list[float] = []
        joined = first_hit = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for o in outputs:
                if o.request_id == f"d-{tag}" and len(o.outputs[0].token_ids) > len(times):
                    times.append(now)
                elif o.request_id == f"h-{tag}" and first_hit is None and o.outputs[0].token_ids:
                    first_hit = now
            if join and joined is None and len(times) >= 8:
                engine.add_request(f"h-{tag}", TokensPrompt(prompt_token_ids=prompts["itl"]),
                                   SamplingParams(temperature=0.0, max_tokens=1))
                joined = time.perf_counter()
        return times, joined, first_hit

    alone, _, _ = one("alone", False)
    base = [b - a for a, b in zip(alone[1:], alone[2:])]  # the first gap includes the prefill
    during: list[float] = []
    windows: list[float] = []
    for j in range(joins):
        llm.reset_prefix_cache()  # the prompt is not in vLLM's cache: kvfabric loads it
        times, joined, first_hit = one(f"join{j}", True)
        end = first_hit if first_hit is not None else float("inf")
        during += [b - a for a, b in zip(times, times[1:]) if a >= joined and b < end]
        windows.append(end - joined)
    ratio = statistics.median(during) / statistics.median(base) if during and base else None
    return {"itl_alone_s": statistics.median(base), "itl_during_load_s": statistics.median(during) if during else None,
            "ratio": ratio, "num_during": len(during), "num_joins": joins, "load_window_s": statistics.median(windows)}


if __name__ == "__main__":
    run_engine(sys.argv[1])
