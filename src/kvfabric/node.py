"""`kvfabric node`: a long-running cache instance (a server-style process), and the synthetic workload it (and the
soak benchmark) can drive.

A node is a CacheEngine over the configured tiers with no model: with tier "peer" it joins the cluster (serves
its chunks to peers, reports to the controller), with `metrics.port` it serves /metrics, with `kv_events` it
publishes KV events. `--load OPS` runs a `Workload` on it, so that dashboards and `kvfabric stats` have
something to show.

`Workload` (the contract the soak benchmark relies on):
- Prompts come from a fixed tree: `num_bases` shared prefixes, each prompt a base prefix (1..`max_chunks`-1
  chunks) plus its own suffix; prompt ids are drawn Zipf-like, so some prefixes are hot.
- The KV of every chunk is a pure function of its chunk key (`chunk_kv`), so any process can check any chunk it
  retrieves, whoever stored it: a retrieved chunk that differs from `chunk_kv(key)` is a wrong output.
- `step(rng)` runs one operation: lookup + retrieve of the hit + store of the rest (most), or a delete.
  It returns a `StepResult` (op, tokens asked, tokens hit, chunks checked, chunks wrong).
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvfabric.builder import build_engine
from kvfabric.config import Config
from kvfabric.engine import CacheEngine
from kvfabric.layout import KVLayout

SMALL_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16")  # 16 KiB per 32-token chunk
MODEL_ID = "kvfabric-synthetic"


def chunk_kv(key: bytes, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    """The KV [L, 2, H, T, D] that the workload stores under `key`: seeded by the key, so it can be re-derived."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    values = rng.standard_normal(layout.shape(num_tokens), dtype=np.float32)
    return torch.from_numpy(values).to(layout.torch_dtype)


@dataclass(frozen=True, slots=True)
class StepResult:
    op: str  # "request" | "delete"
    num_tokens: int
    num_hit: int  # tokens the lookup found
    num_loaded: int  # tokens the retrieve returned
    num_checked: int  # chunks compared with chunk_kv
    num_wrong: int  # chunks whose bytes differed


class Workload:
    def __init__(self, engine: CacheEngine, *, num_prompts: int = 2000, num_bases: int = 50, max_chunks: int = 8,
                 delete_share: float = 0.02, seed: int = 0) -> None:
        self.engine = engine
        self.layout = engine.layout
        self.chunk_size = engine.chunk_size
        self.num_prompts = num_prompts
        self.max_chunks = max_chunks
        self.delete_share = delete_share
        rng = np.random.default_rng(seed)
        cs = self.chunk_size
        self._bases = rng.integers(0, 50_000, (num_bases, max_chunks * cs), dtype=np.int64)
        self._seed = seed
        weights = 1.0 / np.arange(1, num_prompts + 1) ** 0.8  # Zipf-like popularity
        self._weights = weights / weights.sum()

    def prompt(self, i: int) -> list[int]:
        rng = np.random.default_rng((self._seed, i))
        cs = self.chunk_size
        base = self._bases[i % len(self._bases)]
        num_shared = int(rng.integers(1, self.max_chunks)) * cs
        num_own = int(rng.integers(1, self.max_chunks - num_shared // cs + 1)) * cs
        own = rng.integers(0, 50_000, num_own, dtype=np.int64)
        return np.concatenate([base[:num_shared], own]).tolist()

    def kv_for(self, tokens: list[int], start: int) -> torch.Tensor:
        """KV [L, 2, H, len - start, D] of tokens[start:] (chunk-aligned), chunk by chunk from chunk_kv."""
        keys = self.engine.keys(tokens)
        cs = self.chunk_size
        parts = [chunk_kv(keys[i], self.layout, cs) for i in range(start // cs, len(tokens) // cs)]
        return torch.cat(parts, dim=3)

    def check(self, tokens: list[int], kv: torch.Tensor) -> tuple[int, int]:
        """(chunks checked, chunks wrong) of a retrieved prefix kv [L, 2, H, m, D]."""
        keys = self.engine.keys(tokens)
        cs = self.chunk_size
        num = kv.shape[3] // cs
        wrong = sum(not torch.equal(kv[:, :, :, i * cs:(i + 1) * cs, :], chunk_kv(keys[i], self.layout, cs))
                    for i in range(num))
        return num, wrong

    def step(self, rng: np.random.Generator) -> StepResult:
        i = int(rng.choice(self.num_prompts, p=self._weights))
        tokens = self.prompt(i)
        if rng.random() < self.delete_share:
            self.engine.delete(tokens)
            return StepResult("delete", len(tokens), 0, 0, 0, 0)
        hit = self.engine.lookup(tokens)
        kv = self.engine.retrieve(tokens[:hit]) if hit else None
        loaded = kv.shape[3] if kv is not None else 0
        checked, wrong = self.check(tokens, kv) if kv is not None else (0, 0)
        if loaded < len(tokens):
            self.engine.store(tokens, self.kv_for(tokens, loaded), start=loaded)
        return StepResult("request", len(tokens), hit, loaded, checked, wrong)


def run_node(config: Config, *, load_ops: float = 0.0, duration_s: float = 0.0, seed: int = 0,
             layout: KVLayout = SMALL_LAYOUT, on_ready=print) -> dict:
    """Serve until SIGINT / SIGTERM (or `duration_s`); with `load_ops` > 0 run the workload at about that many
    operations per second. Returns the workload's totals."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    totals = {"ops": 0, "wrong": 0, "checked": 0}
    with build_engine(config, layout, MODEL_ID) as engine:
        parts = [f"kvfabric node: tiers {','.join(config.tiers)}"]
        if engine.metrics_endpoint is not None:
            parts.append(f"metrics {engine.metrics_endpoint.url}")
        if engine.node is not None:
            parts.append(f"p2p 127.0.0.1:{engine.node.server.port} instance {engine.node.instance_id}")
        on_ready("; ".join(parts))
        workload = Workload(engine, seed=seed) if load_ops > 0 else None
        rng = np.random.default_rng(seed)
        deadline = time.monotonic() + duration_s if duration_s > 0 else float("inf")
        while not stop.is_set() and time.monotonic() < deadline:
            if workload is None:
                stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            started = time.monotonic()
            result = workload.step(rng)
            totals["ops"] += 1
            totals["wrong"] += result.num_wrong
            totals["checked"] += result.num_checked
            stop.wait(max(0.0, 1.0 / load_ops - (time.monotonic() - started)))
    return totals
