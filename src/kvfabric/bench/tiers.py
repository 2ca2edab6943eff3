"""`kvfabric bench tiers`: store/retrieve throughput of each tier beside a raw baseline of the same bytes.

Per layout (SmolLM2-135M: 30 x 3 x 64 fp16, 256 tokens = 5.9 MB a chunk; Llama-8B-like: 32 x 8 x 128 fp16,
33.6 MB a chunk) it runs the real user path, CacheEngine.store / retrieve over a one-tier stack, and:
- cpu: baseline = numpy copy of the same bytes into a preallocated buffer;
- disk: baseline = plain file write + fsync, and read into a preallocated buffer, with the page cache of those
  files dropped before each read on both sides (posix_fadvise DONTNEED); the tier also writes with fsync here;
- lookup: a 32k-token prompt (list of ints) fully cached in the cpu tier, keys computed each call;
- with `--redis-url` / `--mooncake`, the shared tiers' rows (bench.tiers_shared, bench.tiers_mooncake).
`gbps` is GB/s (10^9 bytes per second).
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvfabric.bench.common import drop_page_cache, emit, paired, threads_note, timed
from kvfabric.cache.engine import CacheEngine
from kvfabric.config import Config, CpuTierConfig, DiskTierConfig
from kvfabric.kv.layout import KVLayout
from kvfabric.tiers.cpu import CpuTier

LAYOUTS = {"smollm2-135m": KVLayout(30, 3, 64, "float16"), "llama-8b": KVLayout(32, 8, 128, "float16")}
CHUNK = 256


def _row(tier: str, op: str, layout: str, num_bytes: int, seconds: float, base_seconds: float, baseline: str) -> dict:
    gbps, base = num_bytes / seconds / 1e9, num_bytes / base_seconds / 1e9
    return {"tier": tier, "op": op, "layout": layout, "mb": round(num_bytes / 1e6, 1), "gbps": round(gbps, 3),
            "baseline_gbps": round(base, 3), "ratio": float(f"{gbps / base:.3g}"), "baseline": baseline}


def bench_cpu(name: str, layout: KVLayout, num_chunks: int, repeats: int) -> list[dict]:
    tokens = list(range(num_chunks * CHUNK))
    kv = torch.randn(layout.shape(len(tokens))).to(layout.torch_dtype)
    out = torch.empty_like(kv)
    num_bytes = kv.numel() * kv.element_size()
    cfg = Config(chunk_size=CHUNK, tiers=("cpu",), cpu=CpuTierConfig(capacity=num_bytes * 4))
    engine = CacheEngine(cfg, layout, "bench")
    src, dst = kv.view(torch.int16).numpy(), np.empty(kv.shape, dtype=np.int16)

    def copy() -> None:
        np.copyto(dst, src)

    store_s, copy1_s = paired(lambda: engine.store(tokens, kv), copy, repeats,
                              setup_ours=lambda: engine.clear_tier("cpu"))
    retrieve_s, copy2_s = paired(lambda: engine.retrieve(tokens, out=out), copy, repeats)
    assert torch.equal(out, kv), "cpu tier returned different bytes"
    engine.close()
    return [_row("cpu", "store", name, num_bytes, store_s, copy1_s, "numpy copy into a preallocated buffer"),
            _row("cpu", "retrieve", name, num_bytes, retrieve_s, copy2_s, "numpy copy into a preallocated buffer")]


def bench_disk(name: str, layout: KVLayout, num_chunks: int, repeats: int, root: Path) -> list[dict]:
    tokens = list(range(num_chunks * CHUNK))
    kv = torch.randn(layout.shape(len(tokens))).to(layout.torch_dtype)
    out = torch.empty_like(kv)
    num_bytes = kv.numel() * kv.element_size()
    cfg = Config(chunk_size=CHUNK, tiers=("disk",),
                 disk=DiskTierConfig(path=str(root / "tier"), capacity=num_bytes * 4, fsync=True))
    engine = CacheEngine(cfg, layout, "bench")

    def store() -> None:
        engine.store(tokens, kv)
        engine.flush()

    def drop_chunk_files() -> None:
        drop_page_cache(list((root / "tier").rglob("*.kvc")))

    chunk_bytes = num_bytes // num_chunks
    raw = [memoryview(bytes(os.urandom(chunk_bytes))) for _ in range(num_chunks)]
    raw_paths = [root / "raw" / f"{i}.bin" for i in range(num_chunks)]
    raw_paths[0].parent.mkdir(parents=True, exist_ok=True)
    buf = bytearray(chunk_bytes)

    def raw_write() -> None:
        for path, data in zip(raw_paths, raw):
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

    def raw_read() -> None:
        for path in raw_paths:
            with open(path, "rb") as f:
                f.readinto(buf)

    store_s, write_s = paired(store, raw_write, repeats, setup_ours=lambda: engine.clear_tier("disk"))
    retrieve_s, read_s = paired(lambda: engine.retrieve(tokens, out=out), raw_read, repeats,
                                setup_ours=drop_chunk_files, setup_base=lambda: drop_page_cache(raw_paths))
    assert torch.equal(out, kv), "disk tier returned different bytes"
    engine.close()
    return [_row("disk", "store", name, num_bytes, store_s, write_s, "file write+fsync, same bytes"),
            _row("disk", "retrieve", name, num_bytes, retrieve_s, read_s, "file read, page cache dropped")]


def bench_lookup(num_tokens: int = 32768, repeats: int = 50) -> dict:
    layout = LAYOUTS["smollm2-135m"]
    tokens = list(range(num_tokens))
    cpu = CpuTier(Config().cpu.capacity)
    engine = CacheEngine(Config(chunk_size=CHUNK, tiers=("cpu",)), layout, "bench", tiers=[cpu])
    for key in engine.keys(tokens):  # mark all chunks present without 190 MB of data: lookup reads no data
        cpu.put(key, b"")
    assert engine.lookup(tokens) == num_tokens
    seconds = timed(lambda: engine.lookup(tokens), repeats)
    hash_s = timed(lambda: engine.keys(tokens), repeats)
    engine.close()
    return {"tier": "cpu", "op": "lookup", "layout": f"{num_tokens} tokens", "ms": round(seconds * 1e3, 3),
            "hash_ms": round(hash_s * 1e3, 3), "target_ms": 1.0, "ok": seconds < 1e-3}


def run(as_json: bool = False, repeats: int = 5, quick: bool = False, redis_url: str | None = None,
        mooncake: bool = False, seal: bool = False, shm_root: str = "/dev/shm") -> list[dict]:
    torch.set_num_threads(os.cpu_count() or 1)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-", dir=os.environ.get("KVFABRIC_BENCH_DIR")) as tmp:
        for name, layout in LAYOUTS.items():
            num_chunks = (4 if quick else 16) if name == "smollm2-135m" else (2 if quick else 6)
            rows += bench_cpu(name, layout, num_chunks, repeats)
            rows += bench_disk(name, layout, num_chunks, repeats, Path(tmp) / name)
    try:
        from kvfabric.bench.tiers_shared import bench_redis, bench_shm
        rows += bench_shm(repeats=max(repeats, 21), root=shm_root)  # one chunk of 0.1-3 ms a sample: more samples are cheap
        if redis_url:
            rows += bench_redis(redis_url, repeats=repeats, seal=seal)
    except ImportError:
        pass
    if mooncake:  # a private master and storage process on loopback (kvfabric.bench.tiers_mooncake)
        from kvfabric.bench.tiers_mooncake import bench_mooncake
        rows += bench_mooncake(repeats=max(repeats, 15))
    emit(rows, as_json, f"kvfabric bench tiers ({threads_note()}, {time.strftime('%H:%M:%S')})",
         ["tier", "op", "layout", "mb", "gbps", "baseline_gbps", "ratio", "baseline"])
    lookup = bench_lookup()
    emit([lookup], as_json, "lookup of a fully cached prompt", ["tier", "op", "layout", "ms", "hash_ms", "target_ms"])
    return rows + [lookup]
