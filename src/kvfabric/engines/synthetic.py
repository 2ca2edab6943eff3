"""The synthetic workload: a cache driven without a model, every chunk's KV a pure function of its key.

Contract (the node command, the soak benchmark and the reliability tests rely on it):
- Prompts come from a fixed tree: `num_bases` shared prefixes, each prompt a base prefix (1..`max_chunks`-1
  chunks) plus its own suffix; prompt ids are drawn Zipf-like, so some prefixes are hot.
- The KV of every chunk is a pure function of its chunk key (`chunk_kv`), so any process can check any chunk it
  retrieves, whoever stored it: a retrieved chunk that differs from `chunk_kv(key)` is a wrong output.
- `step(rng)` runs one operation: lookup + retrieve of the hit + store of the rest (most), or a delete.
  It returns a `StepResult` (op, tokens asked, tokens hit, chunks checked, chunks wrong).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvfabric.cache.engine import CacheEngine
from kvfabric.kv.layout import KVLayout

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
