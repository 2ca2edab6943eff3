"""`kvfabric bench vllm`: TTFT of a real vLLM (CPU) with and without KVFabricConnector, and with LMCache.

For each prompt size (default 1k / 4k / 8k tokens, distinct texts so that no prompt is a prefix of another):

    cold        engine without any connector, first time it sees the prompt
    kvf cold    engine with kvfabric, cold: the miss path (lookup, gather, background store)
    miss paired in the kvfabric engine, `--repeats` pairs of same-size prompts, kvfabric switched off for the first
                of each pair (kv_transfer_params): the miss-path overhead without engine-to-engine noise, as the
                median and [min, max] of on/off - 1
    floor       vLLM's own prefix-cache hit: the same prompt again in the no-connector engine
    kvf hit     a FRESH engine with kvfabric on the same cache: cross-process reuse (async load)  -> ratio vs floor
    load/copy   kvfabric's load time / (bytes loaded / the throughput of reading the same chunk files from the page
                cache into a buffer and copying them into a tensor, measured in the same process)
    lmc hit     vLLM + LMCache (its LMCacheMPConnector and a standalone `lmcache server`, LMCache's multi-process
                mode, the one that runs on CPU): a cold engine stores, a fresh one hits. Skipped, with a note, where
                .venv-lmcache is absent (scripts/setup_lmcache_venv.sh)

plus the tokens and bytes kvfabric loaded per tier, the tokens each hit reused (vLLM's own hit recomputes the
prompt's last block), and the inter-token latency of a decoding request while a cached prompt of the largest size
loads asynchronously next to it, over its ITL alone. TTFT = wall time of `generate(max_tokens=1)`. Every column
comes from its own engine process (start-ups of ~1 min); every engine gets a warm-up request first, and
`VLLM_CPU_OMP_THREADS_BIND` is set explicitly (a kv_transfer_config changes vLLM's default binding, which would
skew the comparison). vLLM must be importable by the Python that runs the engines: this one, or `--python`, or the
repository's `.venv-vllm` (scripts/setup_vllm_venv.sh).

Entry points: `main(argv)` (argparse; `--json` prints one JSON object per size), `run(...)` returns the rows.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
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


TEXT_MODULES = ("argparse", "typing", "logging", "json.decoder", "json.encoder", "inspect", "dataclasses",
                "subprocess", "tarfile", "zipfile", "pydoc", "_pydecimal", "shutil", "threading", "difflib",
                "configparser", "calendar", "doctest", "pathlib", "smtplib", "ftplib", "imaplib", "socket",
                "statistics", "unittest.case", "http.server", "email.message", "asyncio.base_events")


def source_text(modules: Sequence[str] = TEXT_MODULES) -> str:
    """Deterministic text: the sources of Python's own modules (same on every machine of one Python version)."""
    import importlib
    import inspect

    return "\n".join(inspect.getsource(importlib.import_module(name)) for name in modules)


def make_prompts(model: str, sizes: Sequence[int], repeats: int = 3) -> dict[str, list[int]]:
    """Disjoint token slices of deterministic text: for each size the measured prompt `size`, `repeats` same-size
    "off" prompts and `repeats - 1` "on" prompts (the paired miss-path runs: kvfabric off / on for the request,
    alternating; the measured prompt is the first "on"), a prompt `itl` of the largest size (loaded while another
    request decodes), and a warm-up prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(source_text()).input_ids
    tags = ["", *(f"/off{r}" for r in range(repeats)), *(f"/on{r}" for r in range(1, repeats))]
    names = ["warmup"] + [f"{size}{tag}" for size in sizes for tag in tags]
    lengths = [WARMUP_TOKENS] + [int(name.split("/")[0]) for name in names[1:]] + [max(sizes)]
    names.append("itl")
    if len(ids) < sum(lengths):
        raise SystemExit(f"not enough text for {sum(lengths)} tokens ({len(ids)})")
    prompts, at = {}, 0
    for name, length in zip(names, lengths):
        prompts[name] = ids[at:at + length]
        at += length
    return prompts


def find_lmcache_python() -> str | None:
    """The LMCache venv's Python (scripts/setup_lmcache_venv.sh), or None: the LMCache column is then skipped."""
    candidate = Path(__file__).resolve().parents[3] / ".venv-lmcache" / "bin" / "python"
    if candidate.exists() and subprocess.run([str(candidate), "-c", "import lmcache, vllm"],
                                             capture_output=True).returncode == 0:
        return str(candidate)
    return None


class LMCacheServer:
    """LMCache's standalone server (its multi-process mode, the one that runs on CPU), on 127.0.0.1."""

    def __init__(self, python: str, workdir: Path, l1_gb: float = 4.0) -> None:
        from kvfabric.bench.vllm_server import free_port

        self.port, http_port = free_port(), free_port()
        self.log = workdir / "lmcache-server.log"
        lmcache = str(Path(python).parent / "lmcache")
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [lmcache, "server", "--host", "127.0.0.1", "--port", str(self.port), "--chunk-size", str(CHUNK),
                 "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
                 "--http-host", "127.0.0.1", "--http-port", str(http_port), "--disable-observability"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 180
        while "cache server is running" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"lmcache server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)  # its log line is the only readiness signal it gives

    def extra_config(self) -> dict[str, Any]:
        return {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _child(python: str, spec: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    spec_path = workdir / f"spec-{spec['mode']}.json"
    spec["out"] = str(workdir / f"result-{spec['mode']}.json")
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the kvfabric CLI does: spinning OpenMP collapses on busy cores
    src = str(Path(__file__).resolve().parents[2])  # this checkout's kvfabric, whichever venv runs the engine
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    log = workdir / f"engine-{spec['mode']}.log"
    with open(log, "w") as f:
        proc = subprocess.run([python, "-m", "kvfabric.bench.vllm", "--_engine", str(spec_path)], stdout=f,
                              stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=workdir)
    if proc.returncode != 0 or not Path(spec["out"]).exists():
        raise RuntimeError(f"engine {spec['mode']} failed (rc={proc.returncode}); log: {log}\n"
                           + log.read_text()[-4000:])
    return json.loads(Path(spec["out"]).read_text())


def _median_spread(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def run(sizes: Sequence[int] = DEFAULT_SIZES, as_json: bool = False, python: str | None = None,
        model: str | None = None, workdir: str | None = None, timeout: float = 3600, repeats: int = 3,
        lmcache: bool = True) -> list[dict[str, Any]]:
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
    prompts_path.write_text(json.dumps(make_prompts(model, sizes, repeats)))
    common = {"model": model, "prompts": str(prompts_path), "cache": str(cache), "sizes": sizes, "repeats": repeats}
    log = (lambda msg: None) if as_json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    results = {}
    for mode in ("plain", "kvfabric-cold", "kvfabric-hit"):
        log(f"[bench vllm] engine {mode} ...")
        spec = {**common, "mode": mode}
        if mode == "kvfabric-hit":
            spec["files"] = results["kvfabric-cold"]["files"]
        results[mode] = _child(python, spec, work, timeout)
        log(f"[bench vllm] engine {mode}: start-up {results[mode]['startup_s']} s, "
            f"{json.dumps(results[mode]['ttft'])}")
    lmcache_python = find_lmcache_python() if lmcache else None
    lmcache_note = "" if lmcache_python else ("LMCache column skipped: no .venv-lmcache with lmcache and vllm "
                                              "(scripts/setup_lmcache_venv.sh)" if lmcache else "LMCache: --no-lmcache")
    if lmcache_python:
        server = LMCacheServer(lmcache_python, work)
        try:
            for mode in ("lmcache-cold", "lmcache-hit"):
                log(f"[bench vllm] engine {mode} ...")
                try:
                    results[mode] = _child(lmcache_python, {**common, "mode": mode, "lmcache": server.extra_config()},
                                           work, timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    lmcache_note = f"LMCache failed: {str(exc)[:300]}"
                    break
        finally:
            server.stop()
    if lmcache_note:
        log(f"[bench vllm] {lmcache_note}")
    rows = [_row(results, size, repeats, lmcache_note) for size in sizes]
    if as_json:
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        _table(rows)
        itl = results["kvfabric-hit"].get("itl", {})
        if itl:
            print(f"async load while another request decodes: ITL during the load / alone = "
                  f"{itl['ratio']:.2f} ({itl['num_during']} tokens during the load)", file=sys.stderr)
        print(f"work dir: {work}", file=sys.stderr)
    return rows


def _row(results: dict[str, Any], size: int, repeats: int, lmcache_note: str) -> dict[str, Any]:
    key = str(size)
    plain, cold, hit = (results[m]["ttft"][key] for m in ("plain", "kvfabric-cold", "kvfabric-hit"))
    overheads = [on / off - 1 for on, off in zip(cold["on"], cold["off"])]
    median, low, high = _median_spread(overheads)
    load_s, copy_bps = hit.get("load_s", 0.0), hit.get("pagecache_copy_bps", 0.0)
    bytes_loaded = sum(hit.get("bytes_loaded", {}).values())
    floor_s = bytes_loaded / copy_bps if copy_bps else 0.0
    row = {
        "tokens": size, "cold_s": plain["cold"], "kvf_cold_s": cold["on"][0], "miss_overhead": cold["on"][0] /
        plain["cold"] - 1, "miss_overhead_paired": median, "miss_overhead_paired_min": low,
        "miss_overhead_paired_max": high, "paired_runs": len(overheads),
        "floor_s": plain["hit"], "floor_reused": plain["hit_cached"],
        "kvf_hit_s": hit["cold"], "hit_vs_floor": hit["cold"] / plain["hit"], "kvf_reused": hit["cold_cached"],
        "loaded_tokens": hit.get("loaded_tokens", 0), "bytes_loaded": hit.get("bytes_loaded", {}),
        "load_s": load_s, "pagecache_copy_MBps": copy_bps / 1e6, "load_vs_copy": load_s / floor_s if floor_s else None,
    }
    if "lmcache-hit" in results:
        lm_hit = results["lmcache-hit"]["ttft"][key]
        row.update({"lmcache_cold_s": results["lmcache-cold"]["ttft"][key]["cold"], "lmcache_hit_s": lm_hit["cold"],
                    "lmcache_reused": lm_hit["cold_cached"], "kvf_vs_lmcache": hit["cold"] / lm_hit["cold"]})
    else:
        row["lmcache_note"] = lmcache_note
    return row


def _table(rows: list[dict[str, Any]]) -> None:
    from kvfabric.bench.common import emit

    table = []
    for row in rows:
        line = {"tokens": row["tokens"], "cold": row["cold_s"], "kvf cold": row["kvf_cold_s"],
                "miss paired": f"{row['miss_overhead_paired']:+.1%} [{row['miss_overhead_paired_min']:+.1%}, "
                               f"{row['miss_overhead_paired_max']:+.1%}]",
                "floor": row["floor_s"], "kvf hit": row["kvf_hit_s"], "hit/floor": f"{row['hit_vs_floor']:.2f}x",
                "load/copy": f"{row['load_vs_copy']:.2f}x" if row["load_vs_copy"] else "-",
                "reused floor/kvf": f"{row['floor_reused']}/{row['kvf_reused']}"}
        if "lmcache_hit_s" in row:
            line.update({"lmc hit": row["lmcache_hit_s"], "kvf/lmc": f"{row['kvf_vs_lmcache']:.2f}x"})
        table.append(line)
    emit(table, False, "vLLM + kvfabric TTFT (s); miss paired: median [min, max] of kvfabric on/off - 1",
         list(table[0]))
    if "lmcache_note" in rows[0]:
        print(rows[0]["lmcache_note"], file=sys.stderr)


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
    if mode.startswith("kvfabric"):
        from kvfabric.connectors.vllm import kv_transfer_config
        kwargs["kv_transfer_config"] = kv_transfer_config({
            "chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": cache}, "model_id": MODEL_ID,
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

    def worker_counters() -> dict[str, Any]:
        try:
            return json.loads(stats_path.read_text())["connector"]
        except (OSError, ValueError, KeyError):
            return {}

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
            before = worker_counters()
            row["cold"], row["cold_cached"] = ttft(prompts[key])
            after = worker_counters()
            row["loaded_tokens"] = after.get("loaded_tokens", 0) - before.get("loaded_tokens", 0)
            row["load_s"] = (after.get("load_read_ns", 0) - before.get("load_read_ns", 0)) / 1e9
            row["bytes_loaded"] = {k.split(".", 1)[1]: after[k] - before.get(k, 0) for k in after
                                   if k.startswith("bytes_loaded.") and after[k] != before.get(k, 0)}
            if spec.get("files"):
                row["pagecache_copy_bps"] = pagecache_copy_bps(spec["files"][key])
        elif mode == "kvfabric-cold":  # paired: kvfabric off, then on, for distinct same-size prompts
            row["off"], row["on"] = [], []
            for r in range(spec["repeats"]):
                row["off"].append(ttft(prompts[f"{key}/off{r}"], off=True)[0])
                known = chunk_files()
                row["on"].append(ttft(prompts[key if r == 0 else f"{key}/on{r}"])[0])
                wait_stored(len(known) + size // CHUNK)
                if r == 0:
                    files[key] = sorted(chunk_files() - known)
            row["cold"] = row["on"][0]
        else:
            row["cold"], row["cold_cached"] = ttft(prompts[key])
            if mode == "plain":
                row["hit"], row["hit_cached"] = ttft(prompts[key])
        out[key] = row
        print(f"[{mode}] {key}: {json.dumps(row)}", flush=True)
    result: dict[str, Any] = {"mode": mode, "startup_s": round(startup, 1), "ttft": out, "files": files}
    if mode == "kvfabric-cold":  # the prompt the hit engine loads while another request decodes
        known = chunk_files()
        ttft(prompts["itl"])
        wait_stored(len(known) + len(prompts["itl"]) // CHUNK)
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


def pagecache_copy_bps(paths: Sequence[str], repeats: int = 3) -> float:
    """Bytes/s of reading these files (in the page cache: just written and read) into one buffer and copying each
    into a tensor: the physical floor of a load from the disk tier. Best of `repeats`."""
    import torch

    sizes = [os.path.getsize(p) for p in paths]
    buf = bytearray(max(sizes))
    dst = torch.empty(max(sizes), dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for path, size in zip(paths, sizes):
            with open(path, "rb") as f:
                f.readinto(memoryview(buf)[:size])
            dst[:size].copy_(torch.frombuffer(buf, dtype=torch.uint8, count=size))
        best = min(best, time.perf_counter() - started)
    return sum(sizes) / best


def itl_under_load(llm: Any, prompts: dict[str, list[int]], num_tokens: int = 48) -> dict[str, Any]:
    """Inter-token latency of a decoding request alone, and while a cached long prompt (`itl`) joins and waits for
    its asynchronous load: the median ITL of the tokens produced during the load over the median alone."""
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
    times, joined, first_hit = one("join", True)
    base = [b - a for a, b in zip(alone[1:], alone[2:])]  # the first gap includes the prefill
    end = first_hit if first_hit is not None else float("inf")
    during = [b - a for a, b in zip(times, times[1:]) if a >= joined and b < end]
    ratio = statistics.median(during) / statistics.median(base) if during and base else None
    return {"itl_alone_s": statistics.median(base), "itl_during_load_s": statistics.median(during) if during else None,
            "ratio": ratio, "num_during": len(during), "load_window_s": end - joined}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt size")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="prompt sizes in tokens")
    ap.add_argument("--python", default=None, help="Python with vLLM installed (default: this one or .venv-vllm)")
    ap.add_argument("--model", default=None, help="HF model folder (default: kvfabric's SmolLM2 via ensure_model)")
    ap.add_argument("--workdir", default=None, help="where the cache, prompts and engine logs go (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3, help="paired miss-path runs per size (median and spread)")
    ap.add_argument("--no-lmcache", action="store_true", help="skip the LMCache column")
    ap.add_argument("--_engine", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._engine:
        _engine(args._engine)
        return 0
    run([int(s) for s in args.sizes.split(",") if s], as_json=args.json, python=args.python, model=args.model,
        workdir=args.workdir, repeats=args.repeats, lmcache=not args.no_lmcache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
