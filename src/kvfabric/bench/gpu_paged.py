"""`python -m kvfabric.bench.gpu_paged`: the GPU check of vLLM's GPU layouts (scripts/device/gpu_paged_copy.sh).

For each vLLM 0.32 KVCacheLayout, with K|V content (FLASH_ATTN, FLASHINFER NHD / HND, TRITON_ATTN: Llama-8B-like,
32 layers x 8 KV heads x 128) and with MLA latents (the MLA backends: DeepSeek-V3-like, one 576-wide latent per
token and layer, 32 layers here), a KV cache on the device in that layout (bf16, blocks of 16 tokens) holding a
prompt of 4k / 8k tokens: saved through `PagedMover` (the connector's worker-side data path: side stream, pinned
staging) into the cpu and disk tiers, loaded back into other blocks from process memory and, by a fresh engine,
from disk. Rows (JSON with --json): `gbps` of the save / loads against `baseline_gbps`, a pinned D2H / H2D `copy_`
of the same bytes in one piece, `ratio_vs_pinned_copy` (time / baseline time: the targets are <= 1.5),
`exact` (the loaded blocks hold the saved values, every layer), and for saves `default_stream_blocked_ms`: how long
work queued on the engine's stream after the saves waited (0: the saves ran beside it).
`--device cpu` runs the same code with CpuCopyStream (the tests use it; the timings there mean nothing).
Needs torch, numpy, xxhash, blake3, pyyaml and prometheus-client; not vLLM.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kvfabric import CacheEngine, Config, KVLayout
from kvfabric.config import CpuTierConfig, DiskTierConfig
from kvfabric.connectors.copy_stream import make_copy_stream
from kvfabric.connectors.paged_mover import PagedMover
from kvfabric.connectors.paged_views import (
    LAYOUTS,
    Content,
    DeviceLayer,
    PagedSpec,
    content_of,
    layer_views,
    layout_order,
)

BLOCK, CHUNK = 16, 256


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_seconds(num_bytes: int, device: torch.device, to_host: bool, repeats: int = 5) -> float:
    """Median time of one pinned copy of num_bytes between the device and the host."""
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def _tokens(views: list[torch.Tensor], name: str, layout: KVLayout, block_ids: list[int],
            num_tokens: int) -> torch.Tensor:
    out = torch.empty(layout.shape(num_tokens), dtype=views[0].dtype, device=views[0].device)
    for index, view in enumerate(views):
        DeviceLayer.of(view, name, content_of(layout)).gather(block_ids, 0, num_tokens, out[index])
    return out


def _blocked_ms(device: torch.device, enqueue) -> float | None:
    """Enqueue the saves behind a busy engine stream, then one more kernel there: how long that kernel waited
    beyond the busy work (ms), None on a CPU device."""
    if device.type != "cuda":
        enqueue()
        return None
    busy_done, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(20_000_000)  # ~10 ms of engine work the saves must follow (after_compute)
    busy_done.record()
    enqueue()
    torch.empty(1, device=device).add_(1)
    after.record()
    after.synchronize()
    return busy_done.elapsed_time(after)


def run_layout(name: str, num_tokens: int, device: torch.device, root: Path, num_layers: int = 32,
               content: Content = "kv") -> list[dict]:
    num_heads, head_dim = (1, 576) if content == "latent" else (8, 128)
    num_blocks = 2 * (-(-num_tokens // BLOCK)) + 4
    spec = PagedSpec(name, content, num_layers, num_blocks, num_heads, BLOCK, head_dim, torch.bfloat16)
    views = layer_views(torch.empty(spec.num_bytes, dtype=torch.uint8, device=device), spec)
    generator = torch.Generator(device=device).manual_seed(0)
    for view in views:
        view.copy_(torch.randn(view.shape, generator=generator, device=device))
    half = num_blocks // 2
    src_ids, dst_ids = list(range(1, half)), list(range(half, num_blocks))
    layout = KVLayout(num_layers, num_heads, head_dim, "bfloat16", is_latent=content == "latent")
    num_bytes = layout.num_bytes(num_tokens)
    config = Config(chunk_size=CHUNK, tiers=("cpu", "disk"), cpu=CpuTierConfig(capacity=4 * num_bytes),
                    disk=DiskTierConfig(path=str(root / content / name / str(num_tokens)), capacity=4 * num_bytes),
                    save_partial_chunk=True)
    spans = [(i, min(num_tokens, i + CHUNK)) for i in range(0, num_tokens, CHUNK)]
    stream = make_copy_stream(device, pinned_bytes=2 * num_bytes)
    rows = []
    expect = _tokens(views, name, layout, src_ids, num_tokens)
    with CacheEngine(config, layout, "gpu-check") as engine:
        mover = PagedMover(engine, views, name, stream)
        keys = engine.keys(list(range(num_tokens)))
        jobs: list = []
        _sync(device)
        started = time.perf_counter()
        blocked = _blocked_ms(device, lambda: jobs.extend(mover.save(k, src_ids, a, b) for k, (a, b) in zip(keys, spans)))
        stored = [job.finish() for job in jobs]
        save_s = time.perf_counter() - started
        engine.flush()
        rows.append(_row(name, content, num_tokens, "save", num_bytes, save_s, _copy_seconds(num_bytes, device, True),
                         all(stored), blocked))
        rows.append(_load_row(mover, keys, spans, dst_ids, views, expect, "load_cpu", num_bytes, device))
    with CacheEngine(Config(chunk_size=CHUNK, tiers=("disk",), disk=config.disk, save_partial_chunk=True),
                     layout, "gpu-check") as fresh:
        rows.append(_load_row(PagedMover(fresh, views, name, stream), keys, spans, dst_ids, views, expect,
                              "load_disk", num_bytes, device))
    return rows


def _load_row(mover: PagedMover, keys, spans, dst_ids, views, expect, op: str, num_bytes: int,
              device: torch.device) -> dict:
    for view in views:  # the destination blocks start as garbage
        view[dst_ids[0]:dst_ids[-1] + 1].zero_()
    _sync(device)
    started = time.perf_counter()
    jobs = [mover.load(key, dst_ids, a, b, first=a, chunk_tokens=b - a) for key, (a, b) in zip(keys, spans)]
    for job in jobs:
        if job is not None:
            job.finish()
    seconds = time.perf_counter() - started
    loaded = _tokens(views, mover.layout, mover.engine.layout, dst_ids, expect.shape[3])
    exact = all(job is not None for job in jobs) and torch.equal(loaded, expect)
    return _row(mover.layout, mover.layers[0].content, expect.shape[3], op, num_bytes, seconds,
                _copy_seconds(num_bytes, device, False), exact, None)


def _row(layout: str, content: str, num_tokens: int, op: str, num_bytes: int, seconds: float, base_seconds: float,
         exact: bool, blocked_ms: float | None) -> dict:
    return {"layout": layout, "content": content, "tokens": num_tokens, "op": op, "mb": round(num_bytes / 1e6, 1),
            "gbps": round(num_bytes / seconds / 1e9, 3), "baseline_gbps": round(num_bytes / base_seconds / 1e9, 3),
            "ratio_vs_pinned_copy": round(seconds / base_seconds, 3), "exact": exact,
            "default_stream_blocked_ms": None if blocked_ms is None else round(blocked_ms, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", default="4096,8192", help="prompt sizes in tokens")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--contents", default="kv,latent", help="kv (K|V backends), latent (MLA backends)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    try:  # a mistyped device or layout: one line (argparse's), not a traceback
        device = torch.device(args.device)
        for name in args.layouts.split(","):
            layout_order(name)
        if set(args.contents.split(",")) - {"kv", "latent"}:
            raise ValueError(f"--contents: kv and/or latent, got {args.contents!r}")
    except (RuntimeError, ValueError) as exc:
        parser.error(str(exc).splitlines()[0])
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvfabric-gpu-") as tmp:
        for content in args.contents.split(","):
            for name in args.layouts.split(","):
                for size in map(int, args.sizes.split(",")):
                    rows += run_layout(name, size, device, Path(tmp), num_layers=args.layers, content=content)
    if args.json:
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        try:  # rich may be missing on a bare GPU machine: a plain table then
            from kvfabric.bench.common import emit
            emit(rows, False, f"kvfabric GPU paged copies ({device})", list(rows[0]))
        except ImportError:
            for row in rows:
                print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return 0 if all(row["exact"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
