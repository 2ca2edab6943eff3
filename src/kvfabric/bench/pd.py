"""`kvfabric bench pd`: prefill/decode disaggregation with real `vllm serve` processes, against one colocated instance.

Paths (each started here, one after the other, never two pairs at once):

    colocated  one vLLM instance, no connector, both cores
    shm        a prefill instance (kv_role kv_producer) and a decode instance (kv_consumer), each on its own core,
               sharing KV through one shared-memory pool, behind `kvfabric pd-proxy` (ProxyThread)
    p2p        the same pair as members of one cluster (a controller run by this process): the prefill instance
               keeps KV in its process memory and serves it over kvfabric's P2P TCP protocol; the decode
               instance finds it through the controller and fetches it (tier "peer")
    redis      the same pair sharing KV through a Redis server (`--redis-url`; skipped without)

`--prefill-tp 2`: the prefill instance at tensor parallel size 2 (a rank on each core; the decode instance, at
TP=1, shares core 1), its ranks each storing their share and the decode instance reading the whole chunk from
them; the model is then Qwen2.5-Coder-0.5B (SmolLM2's 3 KV heads do not split). Rows carry `prefill_tp` and
`decode_tp`.

Per (path, prompt size, concurrency), REQUESTS distinct prompts (or `concurrency`, where more): TTFT mean and P99
measured on the client through the proxy (prefill + decode first token), `transfer_s`: the decode instance's KV
load time per request (its connector's counters; at concurrency 1 the median of one sample per request, in
`transfer_samples`, else the group's mean), `chunk_read_s`: finding, opening and checking the chunks (wall time
of the load threads), `scatter_s` / `verify_s`: the copies into the paged cache and the payload checks within
them (CPU time of the load threads), each per request,
`memcpy_s`: the same bytes copied in memory once, `socket_s`: the same bytes over a raw loopback socket, both
measured in this run; `e2e_mean_s`: to the end of the answer's stream; `kv_bytes_per_token` (measured) and
`copies` (of each of those bytes on the path, see COPIES); `same_output`: greedy text equal to the colocated
instance's on every prompt.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvfabric.bench.cluster import TOKEN, RawClient, RawServer, start_controller
from kvfabric.bench.common import emit, paired
from kvfabric.bench.serve import percentile, server_argv
from kvfabric.bench.vllm_server import VllmServer, free_port
from kvfabric.pd.proxy import ProxyThread
from kvfabric.tiers.shm import ShmTier

CHUNK = 256
CHUNK_BYTES = 1 << 20  # the raw socket baseline sends the bytes in pieces of this size
REQUESTS = 5  # per group at least: transfer_s is a median of at least 5 samples
PATHS = ("colocated", "shm", "p2p", "redis")  # redis only with a server's URL
# Copies of each KV byte from the prefill instance's paged cache to the decode instance's, by path (counted from
# the code, not measured): shm: the gather into a chunk blob, its write into the pool, the scatter straight out
# of the pool (read in place); p2p: the gather (the blob process memory keeps), the kernel's copy into the
# socket and out of it into the receive buffer, the scatter; redis: the gather, the client's send, the
# server's receive, its reply, the client's receive, the scatter (Redis's own internal copies not counted).
COPIES = {"shm": 3, "p2p": 4, "redis": 6}


@dataclass(frozen=True, slots=True)
class Site:
    """Where a process of a path runs: a network namespace (None: this process's) and the address it listens on."""
    netns: str | None = None
    host: str = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the parts of a path run: the prefill instance (and the colocated one), the decode instance, and the
    address of the controller, which this process serves (bench.hosts_pd puts each on an emulated host)."""
    prefill: Site = Site()
    decode: Site = Site()
    controller_host: str = "127.0.0.1"


def pd_extra(pool: str, stats: Path, capacity: str = "2GiB", redis_url: str | None = None,
             controller_url: str | None = None, instance_id: str = "", p2p_host: str = "127.0.0.1") -> dict[str, Any]:
    """kv_connector_extra_config of one instance of a pair: one shm pool; with redis_url, one Redis; with
    controller_url, process memory served to the other member of the cluster (P2P, listening on p2p_host)."""
    if redis_url:
        tiers: dict[str, Any] = {"tiers": ["redis"], "redis": {"url": redis_url, "timeout_s": 10.0}}
    elif controller_url:
        tiers = {"tiers": ["cpu", "peer"], "cpu": {"capacity": capacity},
                 "cluster": {"controller_url": controller_url, "token": TOKEN, "instance_id": instance_id,
                             "p2p_host": p2p_host,
                             "serve_tiers": ["cpu"], "keep_fetched": False, "report_interval_s": 0.05,
                             "lookup_timeout_s": 5.0, "fetch_timeout_s": 60.0}}
        if p2p_host != "127.0.0.1":  # an emulated host's address (bench.hosts_pd): the bed's links are private
            tiers["cluster"]["insecure"] = True
    else:
        tiers = {"tiers": ["shm"], "shm": {"name": pool, "capacity": capacity}}
    return {"chunk_size": CHUNK, **tiers, "model_id": "kvfabric-bench-pd", "stats_path": str(stats)}


def start_instance(python: str, model: str, work: Path, name: str, cores: str, kv_role: str | None = None,
                   extra: dict[str, Any] | None = None, max_len: int = 2048,
                   kv_bytes: int = 1 << 30, tp: int = 1, at: Site = Site()) -> VllmServer:
    """A `vllm serve` process pinned to `cores` ("0|1": a core per tensor rank; not yet ready: call wait_ready); with
    kv_role, KVFabricConnector; `at`: on an emulated host (bench.hosts) instead of this namespace's loopback.
    Pinned twice: vLLM binds its OpenMP threads (VLLM_CPU_OMP_THREADS_BIND), `taskset` the process, so that the
    connector's threads, which run on every CPU the engine was given, stay on its cores: left on both, a decode
    instance's niced load threads also ran on the prefill instance's core, beside its busy processes."""
    port = free_port()
    argv = server_argv(python, model, port, kv_bytes, max_len, at.host) + \
        (["--tensor-parallel-size", str(tp)] if tp > 1 else [])
    if shutil.which("taskset"):  # the whole instance, its connector's load threads too: not only vLLM's OpenMP threads
        argv = ["taskset", "-c", cores.replace("|", ","), *argv]
    if at.netns:
        argv = ["ip", "netns", "exec", at.netns, *argv]
    if kv_role is not None:
        argv += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric.connectors.vllm",
            "kv_role": kv_role, "kv_connector_extra_config": extra or {}})]
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores, "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}
    return VllmServer(argv, port, work / f"serve-{name}.log", env, at.host)


def pool_name() -> str:
    return f"pd-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def prompts_of(num_tokens: int, count: int, seed: int) -> list[list[int]]:
    """Distinct random token-id prompts (no shared prefix between them, so every one is a transfer)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 40000, num_tokens).tolist() for _ in range(count)]


@dataclass(frozen=True, slots=True)
class Answer:
    ttft_s: float  # to the first streamed token, on the client
    e2e_s: float  # to the end of the stream
    text: str  # greedy


@dataclass(frozen=True, slots=True)
class Loaded:
    """A decode instance's load counters so far (its connector's stats file)."""
    read_s: float = 0.0  # load time, summed over loads
    chunk_read_s: float = 0.0  # finding, opening and checking chunks (wall time, summed over the load threads)
    scatter_s: float = 0.0  # copies into the paged cache, summed over the load threads
    verify_s: float = 0.0  # payload checks, summed over the load threads
    num_bytes: int = 0

    def minus(self, other: Loaded) -> Loaded:
        return Loaded(self.read_s - other.read_s, self.chunk_read_s - other.chunk_read_s,
                      self.scatter_s - other.scatter_s, self.verify_s - other.verify_s, self.num_bytes - other.num_bytes)

    def per(self, n: int) -> Loaded:
        return Loaded(self.read_s / n, self.chunk_read_s / n, self.scatter_s / n, self.verify_s / n,
                      self.num_bytes // n)


@dataclass(frozen=True, slots=True)
class GroupResult:
    """One path's (prompt size, concurrency) group: per request, and the decode instance's transfers."""
    answers: list[Answer]
    transfer_s: float  # the decode instance's KV load time per request (median of transfer_samples, or the mean)
    transfer_samples: list[float]  # one per request at concurrency 1, else empty
    per_request: Loaded  # the group's load counters / its requests


def ask(client: httpx.Client, model: str, prompt: list[int], max_tokens: int) -> Answer:
    """One streamed completion, timed on the client."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    started, first, parts = time.perf_counter(), None, []
    with client.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text = json.loads(line[6:])["choices"][0].get("text") or ""
                if text and first is None:
                    first = time.perf_counter()
                parts.append(text)
    if first is None:
        raise RuntimeError("no token streamed")
    return Answer(first - started, time.perf_counter() - started, "".join(parts))


def drive(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[Answer]:
    with httpx.Client(base_url=url, timeout=1800) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: ask(client, model, p, max_tokens), prompts))


def copy_baselines(num_bytes: int, repeats: int = 5) -> tuple[float, float]:
    """(memcpy_s, socket_s): the same bytes copied once in memory, and sent over a raw loopback socket."""
    chunk = CHUNK_BYTES
    src, dst = np.ones(num_bytes, np.uint8), np.empty(num_bytes, np.uint8)
    blobs = [bytes(min(chunk, num_bytes - at)) for at in range(0, num_bytes, chunk)]
    server = RawServer(blobs)
    client = RawClient(server.port, [len(b) for b in blobs])
    try:
        memcpy_s, socket_s = paired(lambda: np.copyto(dst, src), client.fetch, repeats)
    finally:
        client.close()
        server.close()
    return memcpy_s, socket_s


def _loaded(stats: Path) -> Loaded:
    """What a decode instance has loaded so far (its connector's stats file)."""
    try:
        counters = json.loads(stats.read_text())["connector"]
    except (OSError, ValueError, KeyError):
        return Loaded()
    return Loaded(counters.get("load_read_ns", 0) / 1e9, counters.get("load_chunk_read_ns", 0) / 1e9,
                  counters.get("load_scatter_ns", 0) / 1e9,
                  counters.get("load_verify_ns", 0) / 1e9,
                  sum(v for k, v in counters.items() if k.startswith("bytes_loaded.")))


def run_path(path: str, python: str, model: str, work: Path, groups: list[tuple[int, int]], max_tokens: int,
             max_len: int, log, redis_url: str | None = None,  # noqa: ANN001
             prefill_tp: int = 1, at: Placement = Placement()) -> dict[tuple[int, int], GroupResult]:
    """Start the path's instances, run every (prompt_tokens, concurrency) group, stop. prefill_tp 2: the prefill
    instance at tensor parallel size 2, a rank on each core (the decode instance shares core 1 with its rank 1)."""
    out: dict[tuple[int, int], GroupResult] = {}
    kv_bytes = 2 << 30
    pool, stats = pool_name(), work / f"decode-{path}.json"
    with contextlib.ExitStack() as stack:
        if path == "colocated":
            server = stack.enter_context(start_instance(python, model, work, path, "0-1", max_len=max_len,
                                                        kv_bytes=kv_bytes, at=at.prefill))
            server.wait_ready(900)
            url = f"http://{at.prefill.host}:{server.port}"
        else:
            stack.callback(ShmTier.destroy, pool)
            url_or_none = redis_url if path == "redis" else None
            controller = None
            if path == "p2p":
                server, thread, controller = start_controller(at.controller_host)
                stack.callback(thread.join, 30)
                stack.callback(setattr, server, "should_exit", True)
            prefill = stack.enter_context(start_instance(
                python, model, work, f"prefill-{path}", "0|1" if prefill_tp == 2 else "0", "kv_producer",
                pd_extra(pool, work / f"prefill-{path}.json", "4GiB", url_or_none, controller, "prefill",
                         at.prefill.host), max_len, kv_bytes, prefill_tp, at.prefill))
            decode = stack.enter_context(start_instance(
                python, model, work, f"decode-{path}", "1", "kv_consumer",
                pd_extra(pool, stats, "4GiB", url_or_none, controller, "decode", at.decode.host), max_len, kv_bytes,
                at=at.decode))
            prefill.wait_ready(900)
            decode.wait_ready(900)
            url = stack.enter_context(ProxyThread(prefill.base_url, decode.base_url, free_port())).url
        drive(url, prompts_of(64, 1, seed=999), 1, 2)  # warm-up
        for num_tokens, concurrency in groups:
            prompts = prompts_of(num_tokens, max(REQUESTS, concurrency), seed=num_tokens * 10 + concurrency)
            first = before = _loaded(stats)
            if concurrency == 1:  # one at a time: a transfer sample per request
                results, samples = [], []
                for prompt in prompts:
                    results += drive(url, [prompt], 1, max_tokens)
                    after = _loaded(stats)
                    samples.append(after.minus(before).read_s)
                    before = after
            else:
                results, samples = drive(url, prompts, concurrency, max_tokens), []
            per_request = _loaded(stats).minus(first).per(len(prompts))
            out[(num_tokens, concurrency)] = GroupResult(
                results, statistics.median(samples) if samples else per_request.read_s, samples, per_request)
            log(f"[bench pd] {path} {num_tokens} tokens x{concurrency}: ttft "
                f"{statistics.fmean(a.ttft_s for a in results):.2f} s")
    return out


def run(sizes: list[int], concurrencies: list[int], as_json: bool = False, max_tokens: int = 16,
        python: str | None = None, model: str | None = None, workdir: str | None = None,
        redis_url: str | None = None, prefill_tp: int = 1) -> list[dict[str, Any]]:
    from kvfabric.bench.vllm import find_python
    from kvfabric.engines.model import ensure_model

    if prefill_tp not in (1, 2):
        raise SystemExit("--prefill-tp: 1 or 2 (this bench gives each rank a core of two)")
    python = find_python(python)
    # SmolLM2's 3 KV heads split over no tensor rank count; Qwen2.5-Coder-0.5B's 2 do
    model = model or str(ensure_model() if prefill_tp == 1 else ensure_model("qwen2.5-coder-0.5b"))
    groups = [(n, c) for n in sizes for c in concurrencies]
    max_len = max(sizes) + max_tokens + 64

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    paths = [path for path in PATHS if path != "redis" or redis_url]
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-pd-", dir=workdir) as tmp:
        results = {path: run_path(path, python, model, Path(tmp), groups, max_tokens, max_len, log, redis_url,
                                  prefill_tp) for path in paths}
    rows = []
    for path in paths:
        for group in groups:
            got, base = results[path][group], results["colocated"][group]
            ttfts = [a.ttft_s for a in got.answers]
            is_pd = path != "colocated"
            ttft, transfer_s, num_bytes = statistics.fmean(ttfts), got.transfer_s, got.per_request.num_bytes
            memcpy_s, socket_s = copy_baselines(num_bytes) if num_bytes else (None, None)
            rows.append({"path": path, "prompt_tokens": group[0], "concurrency": group[1], "requests": len(ttfts),
                         "prefill_tp": prefill_tp if is_pd else 1, "decode_tp": 1,
                         "ttft_mean_s": ttft, "ttft_p99_s": percentile(ttfts, 99),
                         "ttft_vs_colocated": ttft / statistics.fmean(a.ttft_s for a in base.answers),
                         "e2e_mean_s": statistics.fmean(a.e2e_s for a in got.answers),
                         "transfer_s": transfer_s if is_pd else None,
                         "transfer_share": transfer_s / ttft if is_pd else None,
                         "transfer_samples": got.transfer_samples if is_pd else None,
                         "chunk_read_s": got.per_request.chunk_read_s if is_pd else None,
                         "scatter_s": got.per_request.scatter_s if is_pd else None,
                         "verify_s": got.per_request.verify_s if is_pd else None,
                         "bytes_per_request": num_bytes,
                         "kv_bytes_per_token": num_bytes / group[0] if is_pd else None,
                         "copies": COPIES.get(path), "memcpy_s": memcpy_s, "socket_s": socket_s,
                         "transfer_vs_memcpy": transfer_s / memcpy_s if memcpy_s else None,
                         "verify_vs_memcpy": got.per_request.verify_s / memcpy_s if memcpy_s and is_pd else None,
                         "socket_gbps": num_bytes / socket_s / 1e9 if socket_s else None,
                         "same_output": [a.text for a in got.answers] == [a.text for a in base.answers]
                         if is_pd else None})
    emit(rows, as_json, "bench pd: prefill/decode disaggregation (TTFT on the client, through pd-proxy)",
         ["path", "prefill_tp", "prompt_tokens", "concurrency", "ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "transfer_s",
          "scatter_s", "verify_s", "memcpy_s", "socket_s", "transfer_vs_memcpy", "copies", "same_output"])
    return rows
