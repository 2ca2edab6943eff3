"""TTFT vs context length, cache miss vs cache hit, on the real model (`kvfabric demo --plot FILE.png`).

For each context length the first tokens of the demo document are prefilled without the cache (miss), then
stored, then asked again with a short question after them (hit: only the question is computed). The cache is
a cpu-only engine of its own, so the plot leaves the user's disk cache untouched.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402

from kvfabric.config import Config  # noqa: E402

LENGTHS = (256, 512, 1024, 2048, 3072)


def ttft_vs_context(path: str, console: Console, lengths: tuple[int, ...] = LENGTHS) -> list[dict]:
    from kvfabric.demo import document
    from kvfabric.engines.hf import HFEngine
    rows = []
    with HFEngine(config=Config(tiers=("cpu",))) as engine:
        doc = engine.tokenizer(document(), add_special_tokens=False)["input_ids"]
        question = engine.tokenizer("\nQuestion: what is this text about?\nAnswer:", add_special_tokens=False)["input_ids"]
        for length in lengths:
            if length > len(doc):
                break
            ids = doc[:length] + question
            miss = engine.generate(ids, max_new_tokens=1, use_cache=False)
            engine.generate(doc[:length], max_new_tokens=1)  # stores the context's chunks
            hit = engine.generate(ids, max_new_tokens=1)
            rows.append({"context_tokens": length, "miss_s": miss.ttft_s, "hit_s": hit.ttft_s,
                         "hit_tokens": hit.hit_tokens})
            console.print(f"context {length:>5}: miss {miss.ttft_s:6.2f} s, hit {hit.ttft_s:5.2f} s "
                          f"({hit.hit_tokens} tokens reused)")
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["context_tokens"] for r in rows]
    ax.plot(xs, [r["miss_s"] for r in rows], "o-", label="cache miss (full prefill)")
    ax.plot(xs, [r["hit_s"] for r in rows], "o-", label="kvfabric hit (load + question)")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("SmolLM2-135M on CPU: TTFT vs context")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    console.print(f"plot written to {path}")
    return rows
