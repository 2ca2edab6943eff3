"""`kvfabric bench serve`: a serving workload against OpenAI-compatible endpoints, per system, same prompts.

Systems (each a `vllm serve` process on 127.0.0.1, started and stopped here, one after the other, all with the same
small KV-memory budget, so that vLLM's own prefix cache must evict once the working set exceeds it):

    vllm       vLLM alone, prefix caching on
    kvfabric   vLLM + KVFabricConnector (process-memory tier, async loads)
    lmcache    vLLM + LMCache 0.5.6 in its multi-process mode (the mode that runs on CPU): a standalone
               `lmcache server` and vLLM's LMCacheMPConnector; from .venv-lmcache (scripts/setup_lmcache_venv.sh),
               skipped with a note where that venv is absent

Workloads (`workloads.py`): long-document QA (N users x M questions over shared documents, LMCache's own benchmark
shape) and multi-round chat sessions replayed from the first requests of the Mooncake conversation trace. Prompts
are token ids (the completions API takes them), so every system gets exactly the same input.

Per (system, workload): TTFT mean / p50 / p90 / p99 (time to the first streamed token), inter-token latency
(p50 and mean over all gaps between streamed tokens), throughput (requests/s and generated tokens/s over the
workload's wall time), and hit tokens (vLLM's `prompt_tokens_details.cached_tokens`: its own prefix cache plus
what the connector loaded), and the machine's 1-minute load average before and after. `--json`: one object per
(system, workload); `--plot FILE.png`: TTFT and throughput.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvfabric.bench import step_trace
from kvfabric.bench.lmcache import LMCacheServer, find_lmcache_python
from kvfabric.bench.vllm import find_python
from kvfabric.bench.vllm_server import VllmServer, free_port
from kvfabric.bench.workloads import Request, Workload, chat_sessions, doc_qa

SYSTEMS = ("vllm", "kvfabric", "lmcache")
STORE_GB = 3.0  # both connectors' process-memory store: holds either workload's working set (~1 GB)


@dataclass(frozen=True, slots=True)
class Timing:
    name: str
    sent_s: float  # when the request was sent, from the workload's start
    ttft_s: float
    itls_s: tuple[float, ...]
    num_output: int
    cached_tokens: int
    prompt_tokens: int


def stream_completion(client: httpx.Client, model: str, request: Request, origin: float = 0.0,
                      request_id: str | None = None) -> Timing:
    """One streamed completion; times measured on the client from sending the request (`origin`: the
    workload's start, on the `perf_counter` clock). `request_id`: sent as X-Request-Id (vLLM's id then holds it)."""
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    headers = {"X-Request-Id": request_id} if request_id else None
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                stamps.append(time.perf_counter())
            if event.get("usage"):
                usage = event["usage"]
    if not stamps:
        raise RuntimeError(f"no tokens streamed for request {request.name}")
    details = usage.get("prompt_tokens_details") or {}
    return Timing(request.name, started - origin, stamps[0] - started,
                  tuple(b - a for a, b in zip(stamps, stamps[1:])), len(stamps), int(details.get("cached_tokens") or 0), int(usage.get("prompt_tokens") or len(request.prompt)))


def drive(base_url: str, workload: Workload) -> tuple[list[Timing], float]:
    """Each user sends its requests one after the other (a session's next round waits for the answer); users run
    concurrently. Returns the timings (in workload order) and the wall time."""
    results: dict[str, Timing] = {}
    errors: list[BaseException] = []
    with httpx.Client(base_url=base_url.removesuffix("/v1"), timeout=1800) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]

        def user(requests: Sequence[Request]) -> None:
            try:
                for request in requests:
                    results[request.name] = stream_completion(client, model, request, started,
                                                              f"{workload.name}.{request.name}")
            except BaseException as exc:  # noqa: BLE001 - reported after the join
                errors.append(exc)

        started = time.perf_counter()
        threads = [threading.Thread(target=user, args=(requests,)) for requests in workload.users]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return [results[r.name] for requests in workload.users for r in requests], wall


def write_per_request(path: Path, system: str, workload: str, timings: Sequence[Timing],
                      steps: dict[str, dict[str, Any]] | None = None) -> None:
    """One JSON line per request (the per-request view behind a row's means: which requests were slow, and
    whether they hit), with what vLLM's scheduler did with it (`steps`, by request name: step_trace.per_request)."""
    with path.open("a") as out:
        for t in timings:
            out.write(json.dumps({"system": system, "workload": workload, "request": t.name,
                                  "sent_s": round(t.sent_s, 4), "ttft_s": round(t.ttft_s, 4),
                                  "hit_tokens": t.cached_tokens, "prompt_tokens": t.prompt_tokens,
                                  "num_output": t.num_output, **(steps or {}).get(f"{workload}.{t.name}", {})}) + "\n")


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(system: str, workload: Workload, timings: list[Timing], wall: float) -> dict[str, Any]:
    ttfts = [t.ttft_s for t in timings]
    itls = [gap for t in timings for gap in t.itls_s]
    return {"system": system, "workload": workload.name, "requests": len(timings), "users": len(workload.users),
            "ttft_mean_s": statistics.fmean(ttfts), "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p90_s": percentile(ttfts, 90), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(itls, 50) if itls else None, "itl_mean_s": statistics.fmean(itls) if itls else None,
            "throughput_rps": len(timings) / wall, "tokens_per_s": sum(t.num_output for t in timings) / wall,
            "hit_tokens": sum(t.cached_tokens for t in timings), "prompt_tokens": sum(t.prompt_tokens for t in timings),
            "wall_s": wall}


def server_argv(python: str, model: str, port: int, kv_bytes: int, max_len: int,
                host: str = "127.0.0.1") -> list[str]:
    return [python, "-c", "import sys; from vllm.entrypoints.cli.main import main; sys.exit(main())", "serve", model,
            "--host", host, "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", str(max_len), "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(kv_bytes),
            "--seed", "0", "--enable-prompt-tokens-details"]


def run_system(system: str, workloads: Sequence[Workload], model: str, work: Path, kv_bytes: int, max_len: int,
               log, python: str, store_gb: float = STORE_GB,  # noqa: ANN001
               load_nice: int | None = None, per_request: Path | None = None) -> list[dict[str, Any]]:
    """Start the system's server once (`python`: one with vllm, and lmcache for that system), run every workload
    on it (each with its own prompts), stop it. `per_request`: append one JSON line per request there."""
    port = free_port()
    argv = server_argv(python, model, port, kv_bytes, max_len)
    lmcache = None
    if system == "kvfabric":
        # spelled out as a user passes it to `vllm serve` (kvfabric.connectors.vllm imports vLLM, absent here)
        argv += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric.connectors.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {
                "chunk_size": 256, "tiers": ["cpu"], "cpu": {"capacity": f"{store_gb}GiB"},
                "model_id": "kvfabric-bench-serve", "stats_path": str(work / "stats-kvfabric.json"),
                **({} if load_nice is None else {"load_nice": load_nice})}})]
    elif system == "lmcache":
        lmcache = LMCacheServer(python, work, l1_gb=store_gb)
        argv += ["--kv-transfer-config", json.dumps({"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                                                     "kv_connector_extra_config": lmcache.extra_config()})]
    trace = work / f"steps-{system}"  # with per_request: vLLM's scheduler steps (step_trace.py), same for every system
    site = [str(step_trace.site_dir(work))] if per_request is not None else []
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           **({"KVFABRIC_STEP_TRACE": str(trace)} if site else {}),
           "PYTHONPATH": os.pathsep.join(p for p in (*site, str(Path(__file__).resolve().parents[2]),
                                                     os.environ.get("PYTHONPATH", "")) if p)}
    rows = []
    try:
        with VllmServer(argv, port, work / f"serve-{system}.log", env) as server:
            server.wait_ready(900)
            for workload in workloads:
                log(f"[bench serve] {system}: {workload.name} ({workload.num_requests} requests) ...")
                load_before = os.getloadavg()[0]
                timings, wall = drive(server.base_url, workload)
                if per_request is not None:
                    steps = step_trace.per_request(step_trace.read(trace), [f"{workload.name}.{t.name}" for t in timings])
                    write_per_request(per_request, system, workload.name, timings, steps)
                # the machine's 1-minute load average before and after: the systems run one after the other, so a
                # busier machine during one of them skews the comparison
                rows.append({**summarize(system, workload, timings, wall),
                             "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]})
                log(f"[bench serve] {system}: {workload.name}: {json.dumps(rows[-1])}")
    finally:
        if lmcache is not None:
            lmcache.stop()
    return rows


def run(systems: Sequence[str] = SYSTEMS, workload_names: Sequence[str] = ("docqa", "chat"), as_json: bool = False,
        plot: str | None = None, model: str | None = None, workdir: str | None = None, kv_tokens: int = 6144,
        max_len: int = 4096, docs: int = 4, doc_tokens: int = 1800, questions: int = 3, users: int = 2,
        sessions: int = 6, trace: str | None = None, python: str | None = None,
        store_gb: float = STORE_GB, load_nice: int | None = None,
        num_requests: int | None = None, per_request: str | None = None) -> list[dict[str, Any]]:
    if model is None:
        from kvfabric.engines.model import ensure_model
        model = str(ensure_model())
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = kv_tokens * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4  # fp32 KV
    log = (lambda msg: None) if as_json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if num_requests:  # at least that many requests a workload: more questions a document, more chat sessions
        questions = max(questions, -(-num_requests // docs))
    makers = {"docqa": lambda: doc_qa(model, docs, doc_tokens, questions, users),
              "chat": lambda: chat_sessions(model, trace, sessions, users, max_prompt=max_len - 64,
                                            scan=20000 if num_requests else 2000, min_requests=num_requests or 0)}
    workloads = [makers[name]() for name in workload_names]
    # made once the workloads are built: a workload that cannot be built (a missing trace) leaves no folder behind
    work = Path(workdir or tempfile.mkdtemp(prefix="kvfabric-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    for workload in workloads:
        log(f"[bench serve] {workload.name}: {workload.num_requests} requests, {len(workload.users)} users, "
            f"{workload.num_prompt_tokens} prompt tokens, distinct working set ~{workload.working_set} tokens; "
            f"KV budget {kv_tokens} tokens")
    rows: list[dict[str, Any]] = []
    notes = []
    for system in systems:
        system_python = find_lmcache_python() if system == "lmcache" else find_python(python)
        if system_python is None:
            notes.append("lmcache skipped: no .venv-lmcache with lmcache and vllm (scripts/setup_lmcache_venv.sh)")
            continue
        try:
            rows += run_system(system, workloads, model, work, kv_bytes, max_len, log, system_python, store_gb,
                               load_nice, Path(per_request) if per_request else None)
        except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
            notes.append(f"{system} failed: {str(exc)[:500]} (logs in {work})")
    for note in notes:  # also with --json: a system that did not run must never pass silently
        print(f"[bench serve] {note}", file=sys.stderr, flush=True)
    if as_json:
        for row in rows:
            nice = {"load_nice": load_nice} if row["system"] == "kvfabric" else {}  # None: the connector's default
            print(json.dumps({**row, "kv_budget_tokens": kv_tokens, **nice}), flush=True)
    else:
        from kvfabric.bench.common import emit

        table = [{"workload": r["workload"], "system": r["system"], "requests": r["requests"],
                  "TTFT mean": r["ttft_mean_s"], "p50": r["ttft_p50_s"], "p90": r["ttft_p90_s"], "p99": r["ttft_p99_s"],
                  "ITL p50": r["itl_p50_s"], "req/s": r["throughput_rps"], "tok/s": r["tokens_per_s"],
                  "hit tokens": f"{r['hit_tokens']}/{r['prompt_tokens']}",
                  "load": "{:.1f}-{:.1f}".format(*r["loadavg_1m"])} for r in rows]
        if table:
            emit(table, False, f"bench serve (KV budget {kv_tokens} tokens; seconds)", list(table[0]))
    if workdir is None and not notes:  # the servers' logs are kept only where a note names them (or --workdir)
        shutil.rmtree(work, ignore_errors=True)
    if plot and rows:
        plot_rows(rows, plot)
    return rows


def plot_rows(rows: list[dict[str, Any]], path: str) -> None:
    from kvfabric.bench.common import save_figure, subplots  # torch and rich load only when plotting
    workloads = sorted({r["workload"] for r in rows})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    fig, axes = subplots(1, 3, figsize=(13, 4))
    for ax, (metric, label) in zip(axes, (("ttft_mean_s", "TTFT mean (s)"), ("ttft_p99_s", "TTFT p99 (s)"),
                                          ("throughput_rps", "throughput (req/s)"))):
        width = 0.8 / len(systems)
        for k, system in enumerate(systems):
            values = [next((r[metric] for r in rows if r["system"] == system and r["workload"] == w), 0)
                      for w in workloads]
            ax.bar([i + k * width for i in range(len(workloads))], values, width, label=system)
        ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(workloads))], workloads)
        ax.set_title(label)
    axes[0].legend()
    save_figure(fig, path, 120)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per (system, workload)")
    ap.add_argument("--plot", default=None, help="write TTFT and throughput per system to this PNG")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--workloads", default="docqa,chat")
    ap.add_argument("--model", default=None, help="HF model folder (default: kvfabric's SmolLM2 via ensure_model)")
    ap.add_argument("--python", default=None, help="Python with vLLM installed (default: this one or .venv-vllm)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--kv-tokens", type=int, default=6144, help="vLLM's KV memory, in tokens, for every system")
    ap.add_argument("--store-gb", type=float, default=STORE_GB,
                    help="kvfabric's cpu tier and LMCache's L1 (allocated up front), GB each")
    ap.add_argument("--requests", type=int, default=None, metavar="N",
                    help="at least N requests a workload (docqa: more questions a document; chat: more sessions); "
                         "rows carry `requests`")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=1800)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--users", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=6, help="chat sessions taken from the trace")
    ap.add_argument("--load-nice", type=int, default=None,
                    help="kvfabric's load_nice (niceness of its load threads; default: the connector's)")
    ap.add_argument("--per-request", default=None, metavar="FILE",
                    help="append one JSON line per request (system, workload, request, sent_s, ttft_s, hit_tokens, "
                         "prompt_tokens, and from vLLM's scheduler: queue_s, computed_tokens, prefill_steps, "
                         "prefill_s, prefill_batch_tokens, prefill_peers, prefill_step_s) to FILE")
    ap.add_argument("--trace", default=None, help="conversation trace (default ../shared/data/mooncake_conversation_"
                                                  "trace.jsonl)")
    args = ap.parse_args(argv)
    if args.per_request:
        try:  # before minutes of serving: a path that cannot be written is one line now, not a lost run later
            Path(args.per_request).open("a").close()
        except OSError as exc:
            print(f"kvfabric bench serve: --per-request {args.per_request}: {exc.strerror}", file=sys.stderr)
            return 2
    try:
        run([s for s in args.systems.split(",") if s], [w for w in args.workloads.split(",") if w], args.json,
            args.plot, args.model, args.workdir, args.kv_tokens, docs=args.docs, doc_tokens=args.doc_tokens,
            questions=args.questions, users=args.users, sessions=args.sessions, trace=args.trace,
            python=args.python, store_gb=args.store_gb, load_nice=args.load_nice, num_requests=args.requests,
            per_request=args.per_request)
    except (ValueError, FileNotFoundError) as exc:  # a workload that cannot be built (no trace, too few sessions)
        print(f"kvfabric bench serve: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
