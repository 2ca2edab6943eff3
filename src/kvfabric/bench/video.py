"""`kvfabric bench video`: the video codec's modes beside cachegen levels, int8 and raw, all measured in one run.

Quality and size on the codec benchmark's held-out text (kvfabric.bench.codec: the same documents, prefill and
teacher-forced evaluation): each document's KV stored in 256-token chunks through a codec and decoded back, then
the next 64 tokens run on top of it; top-1 agreement and mean KL against the uncompressed (fp16) cache. `exact`:
every decoded value equals the fp16 value bit for bit.

Speed (document 0's chunks, fp16 in and out as an engine stores and loads them; best of `repeats`): encode and
decode MB/s of fp16 KV with the codec's default threads, and decode on one thread (`dec_mbps_1t`: threads=1 and
torch on one thread; `dec_cpu_mbps_1t`: the same per CPU-second of that thread, which a busy machine disturbs
far less than wall time).

Peak decode memory (`peak_mem_mb`): a `context_tokens` context (8k by default, a real prefill) coded as ONE chunk
and decoded into a preallocated fp16 buffer in a fresh process, after a warm-up decode (kernels compiled, FFmpeg
loaded): the rise of the resident set's high-water mark (VmHWM, reset through /proc/self/clear_refs) during the
decode, which sees FFmpeg's allocations too, and tracemalloc's peak (numpy and Python; `peak_traced_mb`).
`peak_mem_share` is peak_mem_mb over the context's fp16 KV size.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfabric.bench.codec import CHUNK, compare, held_out_texts
from kvfabric.bench.common import emit, threads_note
from kvfabric.engines.runtime import load_for_inference, next_logprobs, prefill

KEY = bytes(32)


@dataclass(frozen=True, slots=True)
class Setting:
    codec: str  # raw | int8 | cachegen | video
    level: int
    backend: str = ""  # video only
    bits: int = 8

    @property
    def mode(self) -> str:
        if self.codec == "video":
            name = "lossless" if self.level == 0 else f"L{self.level}"
            return f"{name}/{self.backend}" + ("-10bit" if self.bits == 10 else "")
        if self.codec == "cachegen":
            return "lossless" if self.level == 0 else f"L{self.level}"
        return {"raw": "fp16", "int8": "per-channel"}[self.codec]

    def make(self, threads: int | None = None):  # noqa: ANN201
        """The codec; threads=None: its default."""
        if self.codec == "video":
            from kvfabric.codec.video import VideoCodec
            return VideoCodec(self.level, backend=self.backend, bits=self.bits, threads=threads or 1)
        if self.codec == "cachegen":
            from kvfabric.codec.cachegen import CacheGenCodec
            return CacheGenCodec(self.level, threads=threads)
        from kvfabric.codec.registry import entry
        return entry(self.codec).make(self.level)


def settings(quick: bool) -> list[Setting]:
    video = [Setting("video", 0, "utvideo")] + [Setting("video", lvl, "utvideo") for lvl in
                                                 ((5, 6, 7) if quick else (3, 5, 6, 7, 9))]
    video += [Setting("video", 6, "x264")] + ([] if quick else [Setting("video", 3, "x264", 10)])
    cachegen = [Setting("cachegen", lvl) for lvl in ((0, 6) if quick else (0, 3, 5, 6, 7, 9))]
    return video + cachegen + [Setting("int8", 0), Setting("raw", 0)]


def _speed(s: Setting, layout, chunks: list[torch.Tensor], repeats: int) -> dict:  # noqa: ANN001
    """enc / dec MB/s of fp16 KV with default threads, and dec on one thread (torch too)."""
    from kvfabric.codec.format import parse
    fp16 = sum(c.numel() * 2 for c in chunks)
    outs = [torch.empty(c.shape, dtype=torch.float16) for c in chunks]
    res = {}
    for label, threads in (("", None), ("_1t", 1)):
        codec = s.make(threads)
        blobs = [codec.encode(c, KEY, layout) for c in chunks]  # warm-up
        headers = [parse(b) for b in blobs]
        jobs = {"dec": lambda: [codec.decode(h, memoryview(b), layout, o) for h, b, o in zip(headers, blobs, outs)]}
        if not label:
            jobs["enc"] = lambda: [codec.encode(c, KEY, layout) for c in chunks]
        saved = torch.get_num_threads()
        torch.set_num_threads(threads or saved)
        try:
            for name, fn in jobs.items():
                fn()
                times = [_timed(fn) for _ in range(repeats)]
                res[f"{name}_mbps{label}"] = round(fp16 / min(w for w, _ in times) / 1e6, 1)
                if label:
                    res[f"{name}_cpu_mbps{label}"] = round(fp16 / min(c for _, c in times) / 1e6, 1)
        finally:
            torch.set_num_threads(saved)
    return res


def _timed(fn) -> tuple[float, float]:  # noqa: ANN001
    """(wall seconds, CPU seconds of this thread) of fn()."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def probe_memory(setting: dict, blob_path: str, warm_path: str) -> dict:
    """In a fresh process: peak extra memory of decoding the chunk in `blob_path` into a preallocated fp16 buffer,
    after a warm-up decode of `warm_path`. Returns {"rss_mb", "traced_mb"}."""
    from kvfabric.codec.format import parse
    from kvfabric.kv.layout import KVLayout
    s = Setting(**setting)
    codec = s.make()

    def read(path: str) -> tuple:
        blob = Path(path).read_bytes()
        header = parse(blob)
        L, _, H, T, D = header.shape
        return blob, header, KVLayout(L, H, D, "float16")
    blob, header, layout = read(warm_path)
    codec.decode(header, memoryview(blob), layout, torch.zeros(header.shape, dtype=torch.float16))
    blob, header, layout = read(blob_path)
    out = torch.zeros(header.shape, dtype=torch.float16)  # zero-filled: its pages are resident before we start
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base_kb = _status_kb("VmRSS")
    tracemalloc.start()
    codec.decode(header, memoryview(blob), layout, out)
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"rss_mb": round((_status_kb("VmHWM") - base_kb) / 1e3, 2), "traced_mb": round(traced / 1e6, 2)}


def _memory(s: Setting, layout, kv_long: torch.Tensor, kv_warm: torch.Tensor) -> dict:  # noqa: ANN001
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-video-") as tmp:
        codec = s.make()
        paths = []
        for name, kv in (("long", kv_long), ("warm", kv_warm)):
            path = Path(tmp) / name
            path.write_bytes(codec.encode(kv, KEY, layout))
            paths.append(str(path))
        code = ("import json, sys; from kvfabric.bench.video import probe_memory; "
                "print(json.dumps(probe_memory(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])))")
        arg = json.dumps({"codec": s.codec, "level": s.level, "backend": s.backend, "bits": s.bits})
        done = subprocess.run([sys.executable, "-c", code, arg, *paths], capture_output=True, text=True, check=False,
                              env=dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE")))
        if done.returncode:
            raise RuntimeError(f"memory probe of {s.mode} failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def run(as_json: bool = False, num_docs: int = 8, ctx_tokens: int = 2048, next_tokens: int = 64,
        context_tokens: int = 8192, repeats: int = 3, quick: bool = False) -> list[dict]:
    from kvfabric.codec.format import parse
    from kvfabric.engines.hf import layout_for
    if quick:
        num_docs, ctx_tokens, context_tokens, repeats = min(num_docs, 2), min(ctx_tokens, 1024), \
            min(context_tokens, 2048), 1
    model, tok = load_for_inference()
    layout = layout_for(model.config, "float16")
    docs, held_out = held_out_texts(tok, num_docs, ctx_tokens + next_tokens)
    cands = settings(quick)
    stats = {s: {"kl": [], "top1": [], "bytes": 0, "fp16": 0, "exact": True} for s in cands}
    speed_chunks: list[torch.Tensor] = []
    for d, ids in enumerate(docs):
        buf = prefill(model, ids[:ctx_tokens], ctx_tokens)
        ref_kv = buf.half().float()  # the uncompressed cache: what the raw codec stores
        ref = next_logprobs(model, ref_kv, ids, ctx_tokens)
        if d == 0:
            speed_chunks = [buf[:, :, :, s:s + CHUNK].half() for s in range(0, ctx_tokens, CHUNK)]
        for s in cands:
            codec, st = s.make(), stats[s]
            out = torch.empty_like(buf)
            for a in range(0, ctx_tokens, CHUNK):
                blob = codec.encode(buf[:, :, :, a:a + CHUNK], KEY, layout)
                codec.decode(parse(blob, KEY), memoryview(blob), layout, out[:, :, :, a:a + CHUNK])
                st["bytes"] += len(blob)
                st["fp16"] += out[:, :, :, a:a + CHUNK].numel() * 2
            st["exact"] &= torch.equal(out, ref_kv)
            kl, top1 = compare(ref, next_logprobs(model, out, ids, ctx_tokens))
            st["kl"].append(kl)
            st["top1"].append(top1)
    # the memory context: held-out text after the quality documents, one real prefill
    (long_ids,), _ = held_out_texts(tok, 1, context_tokens, first=100 + 40 * num_docs)
    kv_long = prefill(model, long_ids, context_tokens).half()
    del model
    kv_bytes = kv_long.numel() * 2
    rows = []
    for s in cands:
        st = stats[s]
        kl, top1 = torch.cat(st["kl"]), torch.cat(st["top1"])
        mem = _memory(s, layout, kv_long, kv_long[:, :, :, :CHUNK])
        peak = max(mem["rss_mb"], mem["traced_mb"])
        row = {"codec": s.codec, "mode": s.mode, "level": s.level, "backend": s.backend or None,
               "bits": s.bits if s.codec == "video" and s.level else None,
               "ratio": round(st["fp16"] / st["bytes"], 3), "top1": round(float(top1.mean()), 4),
               "kl_mean": round(float(kl.mean()), 5), "kl_p99": round(float(kl.quantile(0.99)), 4),
               "exact": bool(st["exact"]), **_speed(s, layout, speed_chunks, repeats),
               "peak_mem_mb": round(peak, 2), "peak_traced_mb": mem["traced_mb"], "peak_rss_mb": mem["rss_mb"],
               "peak_mem_share": round(peak * 1e6 / kv_bytes, 4), "context_tokens": context_tokens,
               "kv_mb": round(kv_bytes / 1e6, 1), "quality_tokens": ctx_tokens, "docs": len(docs),
               "positions": int(kl.numel()), "held_out": held_out}
        if s.codec == "video":
            codec = s.make()
            row["hwaccel"] = codec.hardware_decoder() or "cpu"
        rows.append(row)
    emit(rows, as_json, f"video codec vs cachegen / int8 on SmolLM2-135M: {len(docs)} docs x {ctx_tokens} tokens, "
         f"next {next_tokens} teacher-forced; peak decode memory of a {context_tokens}-token context "
         f"({kv_bytes / 1e6:.0f} MB fp16) as one chunk ({threads_note()})",
         ["codec", "mode", "ratio", "top1", "kl_mean", "exact", "enc_mbps", "dec_mbps", "dec_mbps_1t",
          "dec_cpu_mbps_1t", "peak_mem_mb", "peak_mem_share"])
    return rows
