"""The TTFT model's figures, measured on this machine in the bench's own run (`kvfabric bench trace`).

- Tier read throughputs as `kvfabric bench tiers` measures them, on SmolLM2-135M chunks (5.9 MB): the cpu tier's
  retrieve, the disk tier's retrieve with the page cache dropped, the shm pool read from another process.
- The real model's prefill: SmolLM2-135M forward passes over 256 to 4096 tokens (the model's own context ends at
  8192), timed in CPU seconds per thread (see prefill_fit), fitted to t(n) = (n + n^2 / (2 h)) / r, the TTFT
  model's form (r: tokens/s at an empty context, h: the
  context length at which a token costs twice as much). Prompts longer than the measured ones are extrapolated
  along that fit (the Mooncake prompts reach 126k tokens; SmolLM2 itself could not take them).
`measure(quick)` returns the model and the raw figures; a part that cannot run here (no model files, no
/dev/shm) keeps the placeholder and says so in the figures.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from kvfabric.bench.trace_sim import TTFTModel

PREFILL_LENGTHS = (256, 512, 1024, 2048, 4096)


def tier_throughputs(quick: bool) -> dict[str, float]:
    """Bytes/s of retrieve from the cpu and disk tiers and of an shm read from another process."""
    from kvfabric.bench.tiers import LAYOUTS, bench_cpu, bench_disk
    from kvfabric.bench.tiers_shared import SIZES, bench_shm

    name, layout = "smollm2-135m", LAYOUTS["smollm2-135m"]
    num_chunks, repeats = (2, 3) if quick else (8, 5)
    rates: dict[str, float] = {}
    rows = bench_cpu(name, layout, num_chunks, repeats)
    with tempfile.TemporaryDirectory(prefix="kvfabric-trace-", dir=os.environ.get("KVFABRIC_BENCH_DIR")) as tmp:
        rows += bench_disk(name, layout, num_chunks, repeats, Path(tmp))
    try:
        rows += bench_shm({name: SIZES[name]}, repeats=repeats)
    except Exception:  # noqa: BLE001 - a host without a usable /dev/shm keeps the placeholder
        pass
    for row in rows:
        if row["op"] == "retrieve":
            rates[row["tier"]] = row["gbps"] * 1e9
    return rates


def prefill_fit(lengths=PREFILL_LENGTHS, repeats: int = 2) -> tuple[float, float, dict[int, float]]:
    """(tokens/s at an empty context, halving tokens, {length: seconds}) of the real model's prefill.

    Seconds are the process's CPU time over the forward pass divided by its torch threads: what the pass takes
    on an otherwise idle machine, with every core working on it. Wall time on a shared machine measures the
    neighbours (here, at a load of 15 on 2 cores, it came out 3-5x the idle time and not even monotonic)."""
    import torch

    from kvfabric.engines.runtime import load_for_inference, prefill

    model, _ = load_for_inference()
    num_threads = torch.get_num_threads()
    rng = np.random.default_rng(0)
    prefill(model, rng.integers(100, 10_000, 64).tolist(), 64)  # warm up the kernels
    seconds: dict[int, float] = {}
    for n in lengths:
        ids = rng.integers(100, 10_000, n).tolist()
        times = []
        for _ in range(repeats):
            start = time.process_time()
            prefill(model, ids, n)
            times.append((time.process_time() - start) / num_threads)
        seconds[n] = min(times)
    del model
    n = np.array(list(seconds), dtype=float)
    t = np.array(list(seconds.values()))
    (a, b), *_ = np.linalg.lstsq(np.stack([n, n * n], axis=1), t, rcond=None)  # t = a n + b n^2
    if b <= 0 or a <= 0:  # noise: fall back to the linear fit (no attention growth measured)
        a, b = float(n @ t / (n @ n)), 0.0
    halving = a / (2 * b) if b > 0 else float("inf")
    return 1.0 / a, halving, seconds


def measure(quick: bool = False, log=print) -> tuple[TTFTModel, dict]:
    base = TTFTModel()
    figures: dict = {}
    rates = tier_throughputs(quick)
    figures["tier_gbps"] = {tier: round(rate / 1e9, 3) for tier, rate in rates.items()}
    log(f"tier read throughputs (bench tiers, this run): {figures['tier_gbps']} GB/s")
    try:
        tokens_per_s, halving, seconds = prefill_fit((512, 2048) if quick else PREFILL_LENGTHS, 1 if quick else 2)
        figures["prefill_s"] = {n: round(s, 3) for n, s in seconds.items()}
        log(f"prefill of SmolLM2-135M (this run): {figures['prefill_s']} s -> {tokens_per_s:.0f} tokens/s at an "
            f"empty context, cost doubles at {halving:.0f} tokens")
    except Exception as exc:  # noqa: BLE001 - no model here: keep the placeholder and say so
        tokens_per_s, halving = base.prefill_tokens_per_s, base.prefill_halving_tokens
        figures["prefill_error"] = f"{type(exc).__name__}: {exc}"
        log(f"prefill not measured ({figures['prefill_error']}); placeholder {tokens_per_s} tokens/s")
    model = TTFTModel(base.bytes_per_token, rates.get("cpu", base.fast_bytes_per_s),
                      rates.get("disk", base.slow_bytes_per_s), rates.get("shm", base.shm_bytes_per_s),
                      tokens_per_s, min(halving, 1e9))
    figures["model"] = str(model)
    return model, figures
