"""The engine process of `kvfabric bench interference` (python -m kvfabric.bench.interference_engine MODE JSON_ARGS).

Modes (each prints one JSON object on its last line):
- `decode`: pinned to its core with one torch thread, the reference model decodes request A (TPOT per step) while
  a fetch loop brings request B's prompt KV back to back from the sender (setup `inproc`: received and decoded
  by kvfabric.stream's Receiver on threads of this process; `server`: `kvfabric server` receives and decodes it
  into its pool (FETCH_STREAM), then `retrieve` copies it into B's buffer; `none`: no fetch). When B's KV is in,
  the main thread runs B's first token between two steps of A: TTFT = fetch start to that token. TPOT samples
  are A's steps alone; kvfabric's CPU time in this process = process CPU minus the main thread's.
- `share`: an HFEngine in `mode: server` generates once; prints its hit tokens (a second process sees the first
  one's stores).
- `copy`: retrieve through the server (pool slot -> this process's buffer) vs a plain copy of the same bytes.
"""
from __future__ import annotations

import json
import os
import queue
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kvfabric.config import Config
from kvfabric.engines.runtime import BufferCache, layout_for, load_for_inference

MODEL_ID = "smollm2-135m-instruct"


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)


class Fetcher:
    """Brings B's prompt KV into `buf` [L, 2, H, >= n, D] (fp32) once per `fetch()`; returns the tokens loaded."""

    def __init__(self, setup: str, args: dict[str, Any], layout, ids: list[int], buf: torch.Tensor) -> None:  # noqa: ANN001
        self.setup, self.port, self.ids, self.buf = setup, args["sender_port"], ids, buf
        if setup == "inproc":
            from kvfabric.stream import Receiver
            self.rx = Receiver(layout, MODEL_ID, buf, None)
        else:
            from kvfabric.cache.remote import RemoteCache
            self.cache = RemoteCache(Config.from_dict(args["config"]), layout, MODEL_ID, name="bench-engine")

    def fetch(self) -> int:
        if self.setup == "inproc":
            with socket.create_connection(("127.0.0.1", self.port)) as conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.rx.receive(conn)  # without a model, a chunk it cannot decode raises: returning = all in
            return len(self.ids)
        got = self.cache.fetch_stream("127.0.0.1", self.port, timeout_s=300)
        if got is None:
            return 0
        return self.cache.retrieve(self.ids, out=self.buf).shape[3]

    def close(self) -> None:
        (self.rx if self.setup == "inproc" else self.cache).close()


class FetchError(RuntimeError):
    """A set-up's fetch never happened (or brought less than B's whole prompt): its row would be invalid."""


class FetchLoop:
    """Runs `fetch` (-> tokens loaded into B's buffer) back to back on a thread of its own, under inference mode
    (it is per thread, and B's buffer is an inference tensor). The main thread `poll`s between A's steps: when a
    fetch is in, it runs B's first token and takes the TTFT (fetch start to that token); B's buffer is busy until
    then, so the next fetch waits for it. Any fetch that fails or loads less than `num_tokens` raises FetchError
    in the main thread: a row whose fetch never happened is never reported."""

    def __init__(self, fetch: Callable[[], int], num_tokens: int) -> None:
        self.fetch, self.num_tokens = fetch, num_tokens
        self.ready: queue.Queue[tuple[float, int] | BaseException] = queue.Queue()
        self.consumed, self.stop = threading.Event(), threading.Event()
        self.ttfts: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _fetch(self) -> int:
        with torch.inference_mode():
            num = self.fetch()
        if num < self.num_tokens:
            raise FetchError(f"a fetch loaded {num} of B's {self.num_tokens} tokens")
        return num

    def warm(self) -> int:
        return self._fetch()

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                self.ready.put((started, self._fetch()))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
                self.ready.put(exc)
                return
            self.consumed.wait()
            self.consumed.clear()

    def poll(self, first_token: Callable[[], None], timeout: float | None = None) -> None:
        try:
            got = self.ready.get(timeout=timeout) if timeout else self.ready.get_nowait()
        except queue.Empty:
            return
        if isinstance(got, BaseException):
            self.stop.set()
            raise FetchError(f"the fetch failed: {got!r}") from got
        first_token()
        self.ttfts.append(time.perf_counter() - got[0])
        self.consumed.set()

    def finish(self, first_token: Callable[[], None], timeout: float = 600.0) -> list[float]:
        """Stops the loop (a fetch slower than A's whole decode still counts) and returns the TTFTs."""
        if not self.ttfts:
            self.poll(first_token, timeout)
        self.stop.set()
        self.consumed.set()
        self.thread.join(timeout)
        if not self.ttfts:
            raise FetchError(f"no fetch finished within {timeout:.0f} s after A's decode")
        return self.ttfts


@torch.inference_mode()
def decode(args: dict[str, Any]) -> dict[str, Any]:
    _pin(args.get("cpu"))
    model, _ = load_for_inference(num_threads=1)
    layout = layout_for(model.config, "float16")
    a_ids, b_ids, steps, warm = args["a_ids"], args["b_ids"], args["steps"], 8
    buf_a = torch.zeros(layout.shape(len(a_ids) + steps + warm + 1))
    buf_b = torch.zeros(layout.shape(len(b_ids) + 1))
    cache_a = BufferCache(buf_a, 0)

    def step(token: int, pos: int, cache: BufferCache) -> int:
        out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[pos]]), cache=cache,
                    use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    out = model(input_ids=torch.tensor([a_ids]), cache=cache_a, use_cache=True, logits_to_keep=1)
    token, pos = int(out.logits[0, -1].argmax()), len(a_ids)
    for _ in range(warm):  # kernels and allocator warm
        token, pos = step(token, pos, cache_a), pos + 1
    fetcher = Fetcher(args["setup"], args, layout, b_ids, buf_b) if args["setup"] != "none" else None
    loop = FetchLoop(fetcher.fetch, len(b_ids)) if fetcher is not None else None
    warm_tokens = loop.warm() if loop is not None else None  # untimed: the codec's first use compiles it (both sides)
    samples = []
    cpu0, main0, load0 = time.process_time(), time.thread_time(), os.getloadavg()[0]

    def first_token_of_b() -> None:  # B's first token, between two steps of A (not in A's TPOT samples)
        step(b_ids[-1], len(b_ids) - 1, BufferCache(buf_b, len(b_ids) - 1))

    if loop is not None:
        loop.start()
    for _ in range(steps):
        if loop is not None:
            loop.poll(first_token_of_b)
        t = time.perf_counter()
        token, pos = step(token, pos, cache_a), pos + 1
        samples.append(time.perf_counter() - t)
    kvfabric_cpu = (time.process_time() - cpu0) - (time.thread_time() - main0)
    ttfts = loop.finish(first_token_of_b) if loop is not None else []
    if fetcher is not None:
        fetcher.close()
    samples.sort()
    return {"setup": args["setup"], "link_mbps": args["link_mbps"], "tpot_mean_s": statistics.fmean(samples),
            "tpot_p99_s": samples[min(len(samples) - 1, int(0.99 * len(samples)))],
            "ttft_s": statistics.median(ttfts) if ttfts else None, "num_fetches": len(ttfts),
            "b_tokens": len(b_ids), "warm_fetch_tokens": warm_tokens,
            "kvfabric_cpu_ms_per_step": 1000 * kvfabric_cpu / steps, "steps": steps,
            "load_avg": round((load0 + os.getloadavg()[0]) / 2, 2)}


def share(args: dict[str, Any]) -> dict[str, Any]:
    from kvfabric.engines.hf import HFEngine
    _pin(args.get("cpu"))
    with HFEngine(config=Config.from_dict(args["config"]), num_threads=1) as engine:
        result = engine.generate(args["ids"], max_new_tokens=1)
        engine.cache.flush()
    return {"hit_tokens": result.hit_tokens, "prompt_tokens": result.prompt_tokens, "ttft_s": result.ttft_s,
            "stored_chunks": result.stored_chunks}


def copy(args: dict[str, Any]) -> dict[str, Any]:
    from kvfabric.cache.remote import RemoteCache
    from kvfabric.kv.layout import KVLayout
    _pin(args.get("cpu"))
    layout = KVLayout(30, 3, 64, "float16")  # SmolLM2-135M's KV
    num_tokens = args["tokens"]
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(layout.shape(num_tokens), generator=gen).to(torch.float16)
    ids = torch.randint(0, 49_000, (num_tokens,), generator=gen).tolist()
    out, dst = torch.empty_like(kv), torch.empty_like(kv)
    with RemoteCache(Config.from_dict(args["config"]), layout, MODEL_ID, name="bench-copy") as cache:
        cache.store(ids, kv)
        cache.flush()
        via_server, plain = [], []
        for i in range(2 * args["repeats"] + 2):  # alternating; the first pair warms pages and slots
            t = time.perf_counter()
            if i % 2:
                dst.copy_(kv)
            else:
                got = cache.retrieve(ids, out=out).shape[3]
            (plain if i % 2 else via_server).append(time.perf_counter() - t)
        exact = got == num_tokens and bool(torch.equal(out, kv))
    retrieve_s, memcpy_s = statistics.median(via_server[1:]), statistics.median(plain[1:])
    return {"bytes": kv.numel() * 2, "retrieve_s": retrieve_s, "memcpy_s": memcpy_s,
            "retrieve_vs_memcpy": memcpy_s / retrieve_s, "exact": exact}


if __name__ == "__main__":
    mode, params = sys.argv[1], json.loads(sys.argv[2])
    result = {"decode": decode, "share": share, "copy": copy}[mode](params)
    print(json.dumps(result), flush=True)
