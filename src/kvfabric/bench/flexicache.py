"""`kvfabric bench flexicache`: head-aware decode KV memory against dense KV and four baselines, on the real model.

Prompts (held out from the head study): the demo document with a question the study did not use, and MuSiQue
10-passage prompts (`--data`, default ../shared/data/musique_s.json) from question 100 on; 4k-6k tokens each.
Per prompt: one prefill (explicit attention, which also records the prompt attention H2O starts from), then dense
KV decodes `steps` greedy tokens (end-of-sequence banned): the reference tokens and distributions, and its step
time. Every method then decodes the same tokens teacher-forced on paged KV (engines.flexicache.PagedKV), so every
step compares against the same reference: top-1 agreement (also `top1_clear`: on the steps where the reference's
best token leads by >= TIE_GAP, i.e. leaving out near-ties), KL(reference || method) (mean and p99 over all steps),
resident KV (peak bytes, mean fraction of dense KV), page moves and bytes copied between the pools per step, and
the step time as a ratio to dense KV's (median over median; a dense step on the same token runs every DENSE_EVERY-th
step of each method's decode, so both see the same machine load; `dense_drift` in the full row compares dense KV's
step time after all methods with before).
Methods at each budget: flexicache, quest (top-K pages of every head, re-ranked every step), streaming (sink +
recent window), h2o (heavy hitters + recent, one-token pages), shuffled (flexicache's split on random heads). At
30 % also flexicache with stable heads re-ranked every step (`flexicache@rerank1`) and with the heads kept whole
chosen by stability alone (`flexicache@stability`, the published criterion; the default orders them by retention,
engines/flexicache/heads.py), and quest ranking by flexicache's mid score instead of its bound (`quest@mid`: what
the score alone gives; `quest` is Quest as published). `radar_frac`: the radar's bytes over dense KV's, resident
besides the budget. `target_quality_met` wants every prompt at top-1 >= 0.99 and mean KL <= 0.01. The re-rank cost
compares the two cadences in CPU time per step (engine stats): `rerank16_over_rerank1_stable_rerank` the stable
heads' selection + moves (the target), `..._rerank` every due head's, `..._radar` the radar's (scoring every page + its promotions), `rerank16_over_rerank1` all page
management in wall time. `tpot_cpu_ratio` is `tpot_ratio` in CPU time; `by_prompt` each prompt's figures.
`--study` runs the head study instead (kvfabric.research.head_stability) and prints its figures. The baselines'
head plans come from kvfabric.research.flexicache_baselines.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from rich.console import Console

from kvfabric.bench.common import emit, emit_summary, save_figure, subplots, threads_note
from kvfabric.config import FlexiCacheConfig
from kvfabric.engines.flexicache import PagedKV, load_table
from kvfabric.engines.model import DEFAULT_MODEL
from kvfabric.engines.runtime import BufferCache, layout_for, load_for_inference
from kvfabric.research.attention_probe import AttentionProbe
from kvfabric.research.flexicache_baselines import make_plan
from kvfabric.research.head_stability import banned_ids, bench_prompts, report, run_study

BUDGETS = (0.1, 0.2, 0.3, 0.5)
DENSE_EVERY = 4  # a method's decode interleaves a timed dense step every this many steps (its TPOT baseline)
TIE_GAP = 0.05  # steps where dense KV's top two tokens are closer than this are near-ties (reported apart)
METHODS = ("flexicache", "quest", "streaming", "h2o", "shuffled")
COLUMNS = ["method", "budget", "resident_frac", "radar_frac", "top1", "top1_clear", "kl_mean", "kl_p99", "tpot_ratio",
           "resident_mb_peak", "moves_per_step", "moved_kb_per_step", "manage_ms_per_step", "num_full_heads"]


@dataclass(frozen=True, slots=True)
class Decode:
    logprobs: torch.Tensor  # [steps, vocab]
    tokens: list[int]
    step_s: float  # median
    dense_s: float = 0.0  # median of the dense KV steps interleaved with these (0: none)
    step_cpu_s: float = 0.0  # the same medians in CPU time of this thread (what a loaded machine does not inflate)
    dense_cpu_s: float = 0.0


@torch.inference_mode()
def prefill_with_mass(model: Any, ids: list[int], capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 KV [L, 2, H, capacity, D] of ids, prompt attention mass [L, H, len(ids)])."""
    buf = torch.zeros(layout_for(model.config).shape(capacity))
    probe = AttentionProbe(buf.shape[0], page_size=1, record_prompt=True)
    model(input_ids=torch.tensor([ids]), cache=BufferCache(buf, 0), use_cache=True, logits_to_keep=1,
          kv_attention=probe)
    return buf, torch.stack(probe.prompt_mass)


@torch.inference_mode()
def decode(model: Any, cache: Any, start: int, first: int, steps: int, feed: list[int] | None = None,
           banned: list[int] = (), dense: torch.Tensor | None = None, **hooks: Any) -> Decode:
    """`steps` one-token forwards from position `start`: greedy (banned ids never picked) or fed `feed`.
    With `dense` (the prompt's dense KV buffer, holding the reference's tokens too), every DENSE_EVERY-th step
    also runs the same token on dense KV, timed apart: the TPOT baseline under the same machine load."""
    logprobs, tokens, times, dense_times, cpu, dense_cpu = [], [], [], [], [], []
    token = first
    for step in range(steps):
        position = torch.tensor([[start + step]])
        if dense is not None and step % DENSE_EVERY == 0:
            side = BufferCache(dense, start + step)  # writes the same K/V the reference wrote there
            t0, c0 = time.perf_counter(), time.thread_time()
            model(input_ids=torch.tensor([[token]]), position_ids=position, cache=side, use_cache=True,
                  logits_to_keep=1)
            dense_times.append(time.perf_counter() - t0)
            dense_cpu.append(time.thread_time() - c0)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = model(input_ids=torch.tensor([[token]]), position_ids=position, cache=cache,
                    use_cache=True, logits_to_keep=1, **hooks)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        logits = out.logits[0, -1].float()
        logprobs.append(torch.log_softmax(logits, -1))
        if feed is None:
            logits[banned] = float("-inf")
            token = int(torch.argmax(logits))
        else:
            token = feed[step]
        tokens.append(token)
    return Decode(torch.stack(logprobs), tokens, statistics.median(times),
                  statistics.median(dense_times) if dense_times else 0.0, statistics.median(cpu),
                  statistics.median(dense_cpu) if dense_cpu else 0.0)


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per step: top-1 agreement (bool) and KL(ref || got)."""
    kl = (ref.exp() * (ref - got)).sum(-1).clamp(min=0)
    return (ref.argmax(-1) == got.argmax(-1)).numpy(), kl.numpy()


def clear_steps(ref: torch.Tensor) -> np.ndarray:
    """bool [steps]: the reference's best token leads the second by at least TIE_GAP in probability."""
    top2 = ref.exp().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1] >= TIE_GAP).numpy()


def run_method(model: Any, buf: torch.Tensor, n: int, mass: torch.Tensor, first: int, ref: Decode, plan: Any,
               slow_pool: str) -> tuple[Decode, Any]:
    layout = layout_for(model.config)
    kv = PagedKV(plan, layout.num_layers, layout.num_kv_heads, layout.head_dim, n + len(ref.tokens) + 1, slow_pool)
    try:
        kv.ingest(buf, n, mass)
        got = decode(model, kv, n, first, len(ref.tokens), feed=ref.tokens, dense=buf, kv_attention=kv)
        return got, kv.stats()
    finally:
        kv.close()


@dataclass(frozen=True, slots=True)
class PromptResult:
    """One (method, budget) on one prompt."""
    prompt: str
    top1: np.ndarray  # bool [steps]
    kl: np.ndarray  # [steps]
    clear: np.ndarray  # bool [steps]: not a near-tie
    tpot_ratio: float  # median step / median interleaved dense step, wall
    tpot_cpu_ratio: float  # the same in CPU time of the decoding thread
    stats: Any  # DecodeMemoryStats


def _aggregate(method: str, budget: float, results: list[PromptResult]) -> dict:
    top1, kl = np.concatenate([r.top1 for r in results]), np.concatenate([r.kl for r in results])
    clear = np.concatenate([r.clear for r in results])
    stats = [r.stats for r in results]

    def mean(name: str, scale: float = 1.0) -> float:
        return scale * float(np.mean([getattr(s, name) for s in stats]))
    return {
        "method": method, "budget": budget, "resident_frac": mean("resident_frac"),
        "top1": float(top1.mean()), "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
        "top1_clear": float(top1[clear].mean()), "tie_steps": float(1.0 - clear.mean()),
        "tpot_ratio": float(np.mean([r.tpot_ratio for r in results])),
        "tpot_cpu_ratio": float(np.mean([r.tpot_cpu_ratio for r in results])),
        "resident_bytes_peak": max(s.resident_bytes_peak for s in stats),
        "resident_mb_peak": max(s.resident_bytes_peak for s in stats) / 2**20,
        "full_kv_bytes": max(s.full_kv_bytes for s in stats), "radar_bytes": max(s.radar_bytes for s in stats),
        "radar_frac": float(np.mean([s.radar_bytes / s.full_kv_bytes for s in stats])),  # resident besides the pages
        "moves_per_step": mean("moves_per_step"), "stable_promotions_per_step": mean("stable_promotions_per_step"),
        "bytes_moved_per_step": mean("bytes_moved_per_step"), "moved_kb_per_step": mean("bytes_moved_per_step", 1 / 1024),
        "manage_ms_per_step": mean("manage_s_per_step", 1000), "transfer_ms_per_step": mean("transfer_s_per_step", 1000),
        "radar_ms_per_step": mean("radar_s_per_step", 1000), "rerank_ms_per_step": mean("rerank_s_per_step", 1000),
        "stable_rerank_ms_per_step": mean("stable_rerank_s_per_step", 1000),
        "first_step_moves": mean("first_step_moves"),
        "num_full_heads": stats[0].num_full_heads, "prompts": len(results), "steps": int(top1.size),
        "by_prompt": {r.prompt: {"top1": float(r.top1.mean()), "wrong_steps": int((~r.top1).sum()),
                                 "wrong_clear_steps": int((~r.top1 & r.clear).sum()), "kl_mean": float(r.kl.mean()),
                                 "tpot_ratio": r.tpot_ratio, "tpot_cpu_ratio": r.tpot_cpu_ratio} for r in results},
    }


def run(as_json: bool = False, plot: str | None = None, data: str | None = None, steps: int = 256,
        budgets: tuple[float, ...] = BUDGETS, methods: tuple[str, ...] = METHODS, num_musique: int = 2,
        variants: bool = True, model_name: str = DEFAULT_MODEL, config: FlexiCacheConfig | None = None,
        only: tuple[str, ...] = (), log: Any = None) -> list[dict]:
    """`only`: run just the prompts of these names (e.g. one per process); empty = all."""
    config = config or FlexiCacheConfig()
    console = Console(stderr=True, emoji=False, highlight=False)
    say = log or (lambda msg: console.print(f"[dim]{msg}[/]"))
    load = os.getloadavg()  # at the start and (in the summary) at the end: timing figures need it
    model, tok = load_for_inference(model_name)
    layout = layout_for(model.config)
    table = load_table(model_name, layout.num_layers, layout.num_kv_heads, config.head_table)
    banned = banned_ids(model, tok)
    runs: dict[tuple[str, float], list] = {}
    published = replace(config, radar_score="bound")  # Quest ranks by its bound alone
    prompts = [p for p in bench_prompts(tok, data, num_musique) if not only or p.name in only]
    if not prompts:
        raise ValueError(f"no bench prompt named {', '.join(only)}")
    for prompt in prompts:
        n = len(prompt.ids) - 1  # the prefill stops one short: step 0 feeds the last prompt token
        t0 = time.perf_counter()
        buf, mass = prefill_with_mass(model, prompt.ids[:n], n + steps + 1)
        say(f"{prompt.name}: {n + 1} tokens, prefill {time.perf_counter() - t0:.0f} s")
        ref = decode(model, BufferCache(buf, n), n, prompt.ids[-1], steps, banned=banned)
        cases = [(m, b, published if m == "quest" else config) for b in budgets for m in methods]
        if variants and "flexicache" in methods and 0.3 in budgets:  # re-rank cost; the published head order
            cases += [("flexicache@rerank1", 0.3, replace(config, rerank_interval=1)),
                      ("flexicache@stability", 0.3, replace(config, head_order="stability"))]
        if variants and "quest" in methods and 0.3 in budgets:  # Quest ranking by flexicache's score
            cases += [("quest@mid", 0.3, config)]
        done = []
        for name, budget, cfg in cases:
            plan = make_plan(name.split("@")[0], budget, layout.num_layers, layout.num_kv_heads, cfg, table)
            got, stats = run_method(model, buf, n, mass, prompt.ids[-1], ref, plan, config.slow_pool)
            top1, kl = compare(ref.logprobs, got.logprobs)
            done.append((name, budget, top1, kl, got, stats))
            say(f"  {name:>18} @ {budget:.0%}: top1 {top1.mean():.3f} kl {kl.mean():.4f} "
                f"resident {stats.resident_frac:.3f} step {got.step_s * 1000:.0f} ms (dense {got.dense_s * 1000:.0f})")
        again = decode(model, BufferCache(buf, n), n, prompt.ids[-1], steps, feed=ref.tokens)
        say(f"  dense step {ref.step_s * 1000:.0f} / {again.step_s * 1000:.0f} ms (before / after)")
        clear = clear_steps(ref.logprobs)
        for name, budget, top1, kl, got, stats in done:
            runs.setdefault((name, budget), []).append(PromptResult(
                prompt.name, top1, kl, clear, got.step_s / got.dense_s, got.step_cpu_s / got.dense_cpu_s, stats))
        runs.setdefault(("full", 1.0), []).append((np.ones(steps, bool), np.zeros(steps), again.step_s / ref.step_s,
                                                   None))
        del buf, mass
    rows = [_full_row(runs.pop(("full", 1.0)), layout, steps)] + [_aggregate(m, b, r) for (m, b), r in runs.items()]
    emit(rows, as_json, f"FlexiCache vs baselines, {steps} teacher-forced steps ({threads_note()})", COLUMNS)
    emit_summary({**summary(rows, table), "load_average": [round(x, 2) for x in (*load, *os.getloadavg())]}, as_json,
                 "FlexiCache targets")
    if plot:
        write_plot(rows, plot)
    return rows


def _full_row(results: list, layout: Any, steps: int) -> dict:
    return {"method": "full", "budget": 1.0, "resident_frac": 1.0, "top1": 1.0, "top1_clear": 1.0, "kl_mean": 0.0,
            "kl_p99": 0.0, "tpot_ratio": 1.0, "dense_drift": float(np.mean([r[2] for r in results])),  # after / before
            "moves_per_step": 0.0, "bytes_moved_per_step": 0.0, "prompts": len(results), "steps": steps * len(results)}


def summary(rows: list[dict], table: Any) -> dict:
    by = {(r["method"], r["budget"]): r for r in rows}
    out: dict[str, Any] = {"summary": "flexicache", "unstable_heads": int(table.unstable().sum())}
    flexi = by.get(("flexicache", 0.3))
    if flexi is None:
        return out
    rivals = [r for (m, b), r in by.items() if b == 0.3 and m in METHODS and m != "flexicache"]  # the baselines
    out.update({"top1_at_30": flexi["top1"], "kl_mean_at_30": flexi["kl_mean"],
                "target_quality_met": all(p["top1"] >= 0.99 and p["kl_mean"] <= 0.01  # on every prompt
                                          for p in flexi["by_prompt"].values()),
                "beats_every_baseline_at_30": all(flexi["kl_mean"] < r["kl_mean"] and flexi["top1"] >= r["top1"]
                                                  for r in rivals),
                "min_prompt_top1_at_30": min(p["top1"] for p in flexi["by_prompt"].values()),
                "radar_frac_at_30": flexi["radar_frac"],
                "tpot_ratio_at_30": flexi["tpot_ratio"], "target_tpot_met": flexi["tpot_ratio"] <= 1.2,
                "tpot_cpu_ratio_at_30": flexi.get("tpot_cpu_ratio"),
                "bytes_moved_per_step_at_30": flexi["bytes_moved_per_step"]})
    mid = by.get(("quest@mid", 0.3))
    if mid is not None:  # how much of the gain over quest is the score, how much the split and the cadence
        out.update({"quest_mid_top1_at_30": mid["top1"], "quest_mid_kl_mean_at_30": mid["kl_mean"],
                    "beats_quest_mid_at_30": flexi["kl_mean"] < mid["kl_mean"] and flexi["top1"] >= mid["top1"]})
    shuffled = by.get(("shuffled", 0.3))
    if shuffled is not None:
        out["shuffled_kl_over_flexicache"] = shuffled["kl_mean"] / max(flexi["kl_mean"], 1e-12)
    published = by.get(("flexicache@stability", 0.3))
    if published is not None:
        out.update({"stability_order_top1_at_30": published["top1"],
                    "stability_order_kl_mean_at_30": published["kl_mean"]})
    every = by.get(("flexicache@rerank1", 0.3))
    if every is not None:
        pair = {"manage_ms": "manage_ms_per_step", "moved_kb": "moved_kb_per_step",  # wall time, bytes
                "rerank_ms": "rerank_ms_per_step", "stable_rerank_ms": "stable_rerank_ms_per_step",  # CPU time
                "radar_ms": "radar_ms_per_step", "stable_moves": "stable_promotions_per_step"}
        for part, key in pair.items():
            a, b = flexi.get(key, 0.0), every.get(key, 0.0)
            out.update({f"rerank16_{part}": a, f"rerank1_{part}": b,
                        f"rerank16_over_rerank1_{part.removesuffix('_ms')}": a / max(b, 1e-9)})
        out["rerank16_over_rerank1"] = out.pop("rerank16_over_rerank1_manage")  # the name it had
        out["rerank16_over_rerank1_radar_and_rerank"] = ((out["rerank16_radar_ms"] + out["rerank16_rerank_ms"]) /
                                                         max(out["rerank1_radar_ms"] + out["rerank1_rerank_ms"], 1e-9))
        out.update({"rerank1_top1": every["top1"], "rerank1_kl_mean": every["kl_mean"],
                    "target_rerank_cost_met": out["rerank16_over_rerank1_stable_rerank"] < 0.5})  # stable heads'
    return out


def write_plot(rows: list[dict], path: str) -> None:
    fig, (ax1, ax2) = subplots(1, 2, figsize=(11, 4.2))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["resident_frac"], r["top1"], r["kl_mean"]) for r in rows if r["method"] == method)
        style = "*" if method == "full" else "o-"
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=method)
        if method != "full":
            ax2.plot([p[0] for p in pts], [max(p[2], 1e-6) for p in pts], style, label=method)
    ax1.set(xlabel="resident KV / dense KV", ylabel="top-1 agreement with dense KV", title="agreement")
    ax2.set(xlabel="resident KV / dense KV", ylabel="mean KL(dense || method)", yscale="log", title="KL")
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    save_figure(fig, path, 120)


def study(as_json: bool = False, data: str | None = None, steps: int = 256, threshold: float | None = None,
          model_name: str = DEFAULT_MODEL) -> dict:
    """Run the head study on the profiler's prompts and print its figures (the shipped table is not touched)."""
    from kvfabric.research.head_stability import DEFAULT_THRESHOLD
    console = Console(stderr=True, emoji=False, highlight=False)
    result = run_study(model_name, data, steps=steps, progress=lambda m: console.print(f"[dim]{m}[/]"))
    figures = report(result.table(DEFAULT_THRESHOLD if threshold is None else threshold))
    emit_summary(figures, as_json, "FlexiCache head study")
    return figures

