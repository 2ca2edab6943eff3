"""Replay of a request trace through the real tiers: a CacheEngine over real cpu / shm / disk tiers (real chunk
files, a real shared-memory pool) with their policies and the stack's placement, as an inference engine uses it.

Blocks are scaled down so that a full replay runs in minutes: one block of the trace = one token (its hash id)
= one chunk of a tiny layout (`BLOB_BYTES`, 168 bytes with the header and head table); the engine's prefix-chained
keys then name exactly the trace's prefix blocks, and token counts come from the trace (512 a block, less for a prompt's
last one). Capacities are in blobs of that size.

Per request, as HFEngine.generate uses the engine: which tiers hold each block (block hits; nothing touched),
`lookup`, `retrieve` of the hit prefix (pins, hits, promotions), `store` of the rest (admission, eviction,
demotion), then `flush`, so that no write is still queued when the next request looks up (a deterministic
replay). The tier serving each chunk is the first one that held it (retrieve pins the prompt's chunks, so
nothing it reads is evicted under it); the stack's hit counters must agree (checked). TTFT per request:
TTFTModel.ttft_by_tier over the tokens each tier served.
"""
from __future__ import annotations

import math
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfabric.bench.trace_data import Trace
from kvfabric.bench.trace_sim import TraceRun, TTFTModel, p99
from kvfabric.cache.engine import CacheEngine
from kvfabric.codec.raw import blob_bytes
from kvfabric.config import Config, PlacementConfig
from kvfabric.kv.hashing import KeySpace
from kvfabric.kv.layout import KVLayout
from kvfabric.research.belady import Belady, BeladyFuture
from kvfabric.tiers.base import Tier

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")  # 32 bytes a token
BLOB_BYTES = blob_bytes(LAYOUT, 1)
MODEL_ID = "trace-replay"


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier of a set-up: `name` cpu | shm | disk; `policy` "EVICTION[+ADMISSION]" or "belady" (cpu and
    disk; shm always evicts by its own LRU)."""
    name: str
    policy: str = "lru"


@dataclass(frozen=True, slots=True)
class ReplaySetup:
    label: str
    tiers: tuple[TierSpec, ...]
    placement: PlacementConfig = PlacementConfig()
    slow_mult: int = 10  # every tier after the first holds slow_mult x the first's capacity


@dataclass(frozen=True, slots=True)
class ReplayResult(TraceRun):
    tier_names: tuple[str, ...] = ()
    hit_tokens: tuple[int, ...] = ()  # prefix hit tokens each tier served
    tier_block_hits: tuple[int, ...] = ()  # blocks each tier held when their request came (fastest holder)
    bytes_moved: tuple[int, ...] = ()  # bytes promoted or demoted into each tier
    us_per_access: float = 0.0  # process time of the whole replay (engine, stack, tiers, files) per block access

    @property
    def slow_hit_tokens(self) -> int:
        return sum(self.hit_tokens[1:])


def trace_keys(trace: Trace) -> list[list[bytes]]:
    """Each request's chunk keys, as the replay's engine computes them (one token per block)."""
    space = KeySpace.of(MODEL_ID, LAYOUT, 1)
    return [space.keys(list(request.hash_ids)) for request in trace.requests]


class _Tiers:
    """The real tiers of one replay; `close` also removes their files and shared memory."""

    def __init__(self, setup: ReplaySetup, capacity_blocks: int, root: Path, future: BeladyFuture | None) -> None:
        self.made: list[Tier] = []
        self._dirs: list[Path] = []
        self._pools: list[str] = []
        for level, spec in enumerate(setup.tiers):
            blocks = capacity_blocks * (1 if level == 0 else setup.slow_mult)
            self.made.append(self._make(spec, blocks * BLOB_BYTES, blocks, root, future))

    def _make(self, spec: TierSpec, capacity: int, blocks: int, root: Path, future: BeladyFuture | None) -> Tier:
        eviction, _, admission = spec.policy.partition("+")
        policy = Belady(capacity, future) if eviction == "belady" else eviction
        if spec.name == "cpu":
            from kvfabric.tiers.cpu import CpuTier
            return CpuTier(capacity, eviction=policy, admission=admission or "always")
        if spec.name == "disk":
            from kvfabric.tiers.disk import DiskTier
            path = root / f"disk-{uuid.uuid4().hex[:8]}"
            self._dirs.append(path)
            return DiskTier(path, capacity, eviction=policy, admission=admission or "always")
        if spec.name == "shm":
            from kvfabric.tiers.shm import ShmTier
            name = f"replay-{uuid.uuid4().hex[:8]}"
            self._pools.append(name)
            return ShmTier(name, capacity, num_slots=1 << max(10, math.ceil(math.log2(2 * blocks))))
        raise ValueError(f"no replay tier {spec.name!r} (cpu, shm, disk)")

    def close(self) -> None:
        from kvfabric.tiers.shm import ShmTier
        for path in self._dirs:
            shutil.rmtree(path, ignore_errors=True)
        for name in self._pools:
            ShmTier.destroy(name)


def _evicted_refused(tier: Tier) -> tuple[int, int]:
    if tier.is_policy_driven:
        stats = tier.index_stats()
        return stats.num_evicted, stats.num_refused
    counters = tier.counters  # the shm pool counts its own
    return counters["evicted"], counters["put.no_room"] + counters["put.rejected"]


def replay(trace: Trace, setup: ReplaySetup, capacity_frac: float, model: TTFTModel, root: Path,
           keys: list[list[bytes]], on_end: Callable[[CacheEngine, list[Tier]], None] | None = None) -> ReplayResult:
    """One replay; `on_end(engine, tiers)` runs after the last request, before anything is closed (tests)."""
    capacity_blocks = max(1, int(capacity_frac * trace.num_distinct_blocks))
    is_offline = any(spec.policy.startswith("belady") for spec in setup.tiers)
    future = BeladyFuture(keys) if is_offline else None
    tiers = _Tiers(setup, capacity_blocks, root, future)
    names = tuple(spec.name for spec in setup.tiers)
    config = Config(chunk_size=1, codec="raw", tiers=names, placement=setup.placement, write_queue_chunks=4096)
    engine = CacheEngine(config, LAYOUT, MODEL_ID, tiers=tiers.made)
    counters = engine.stack.counters
    zeros = torch.zeros(LAYOUT.shape(max(len(r.hash_ids) for r in trace.requests)), dtype=torch.float16)
    hit_tokens = [0] * len(names)
    tier_blocks = [0] * len(names)
    prefix_tokens = block_hits = 0
    ttfts: list[float] = []
    started = time.process_time()
    try:
        for r, request in enumerate(trace.requests):
            if future is not None:
                future.now = r
            ids, request_keys = list(request.hash_ids), keys[r]
            held = [tier.contains_many(request_keys) for tier in tiers.made]
            holder = [next((t for t in range(len(names)) if held[t][i]), -1) for i in range(len(ids))]
            block_hits += sum(h >= 0 for h in holder)
            for h in holder:
                if h >= 0:
                    tier_blocks[h] += 1
            num_hit = engine.lookup(ids)
            before = [counters[f"hit.{name}"] for name in names]
            num_got = engine.retrieve(ids[:num_hit]).shape[3] if num_hit else 0
            served = [0] * len(names)
            for i in range(num_got):
                served[holder[i]] += request.block_tokens(i, trace.block_tokens)
            counted = [counters[f"hit.{name}"] - b for name, b in zip(names, before)]
            if counted != [sum(1 for i in range(num_got) if holder[i] == t) for t in range(len(names))]:
                raise AssertionError(f"request {r}: the stack served {counted} chunks per tier, "
                                     f"held {holder[:num_got]}")
            for t, tokens in enumerate(served):
                hit_tokens[t] += tokens
            prefix_tokens += sum(served)
            if num_got < len(ids):
                engine.store(ids, zeros[:, :, :, :len(ids) - num_got], start=num_got)
                engine.flush()
            ttfts.append(model.ttft_by_tier(request.input_length, dict(zip(names, served))))
        elapsed = time.process_time() - started
        if on_end is not None:
            on_end(engine, tiers.made)
        moved = tuple(counters[f"bytes_promoted.{n}"] + counters[f"bytes_demoted.{n}"] for n in names)
        evicted_refused = [_evicted_refused(tier) for tier in tiers.made]
    finally:
        engine.close()
        tiers.close()
    return ReplayResult(trace.name, setup.label, len(names), capacity_frac, capacity_blocks, len(trace.requests),
                        sum(r.input_length for r in trace.requests), prefix_tokens, trace.num_accesses, block_hits,
                        tuple(e for e, _ in evicted_refused), tuple(f for _, f in evicted_refused),
                        sum(ttfts) / len(ttfts), p99(ttfts), names, tuple(hit_tokens), tuple(tier_blocks), moved,
                        1e6 * elapsed / trace.num_accesses)
