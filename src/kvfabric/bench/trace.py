"""`kvfabric bench trace`: cache policies replayed over request traces (Mooncake), against LRU and Belady.

Set-ups: (a) one tier at 1, 3, 10 and 30 % of the trace's distinct blocks, every eviction policy (and some
admission policies), LRU (today's behaviour) and Belady's offline optimum as baselines; (b) two tiers: a fast
tier at those capacities over a slow tier 10x larger, with write-through (today's TierStack) or exclusive
placement (demote on evict), promotion on the k-th slow hit. `--bounds` adds oracle-informed policies
(trace_oracles.py) that show what knowing part of the future is worth.

Metrics per (trace, policy, tiers, capacity): prefix hit ratio (prefix hit tokens / prompt tokens: lookups stop
at the first missing block), block hit ratio (the metric of issue 16's table), the share of the LRU -> Belady
gap closed on the prefix metric, modelled TTFT (mean, p99) and the policy bookkeeping cost (ns per access,
process CPU time, beside LRU's in the same run).

Phase 1 replays through the pure simulator (trace_sim.py) with the real `PolicyIndex` and policies.
TODO(phase 2, issue 16): replay through the real TierStack (cpu + shm + disk tiers, blocks scaled to a small
byte size), report bytes moved per tier, and measure the TTFT model's throughputs and prefill rate in the same
run instead of taking them as options.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvfabric.bench.common import emit, emit_summary
from kvfabric.bench.trace_data import TRACE_FILES, Trace, load_trace
from kvfabric.bench.trace_oracles import OracleAlive, OraclePopularity
from kvfabric.bench.trace_sim import (IndexFactory, SimResult, TierConfig, TTFTModel, request_metas,
                                      simulate_one_tier, simulate_two_tiers)
from kvfabric.tiers.policies import (DEFAULT_EVICTION, Belady, BeladyFuture, PolicyIndex, make_admission,
                                     make_eviction)

CAPACITIES = (0.01, 0.03, 0.1, 0.3)
ONE_TIER = ("lru", "lfu", "s3fifo", "arc", "heat", "lru+second", "lru+tinylfu", "heat+second")
ORACLES = {"oracle-alive": OracleAlive, "oracle-popularity": OraclePopularity}
# Two tiers: label -> (fast tier's policy, slow tier's policy, placement); "a+b" = a over b, "lru" = today.
TWO_TIER = {"lru": ("lru", "lru", TierConfig("write-through", 1)),
            "lru/exclusive": ("lru", "lru", TierConfig("exclusive", 1)),
            "heat/write-through": ("heat", "heat", TierConfig("write-through", 1)),
            "heat/exclusive": ("heat", "heat", TierConfig("exclusive", 1)),
            "heat/exclusive/k2": ("heat", "heat", TierConfig("exclusive", 2)),
            "heat+lru/exclusive": ("heat", "lru", TierConfig("exclusive", 1)),
            "belady": ("belady", "belady", TierConfig("exclusive", 1))}
DEFAULT_ONE_TIER = DEFAULT_EVICTION  # what `default` means: the shipped configuration
DEFAULT_TWO_TIER = "heat+lru/exclusive"  # best modelled TTFT over both traces (bench trace, phase 1)
TARGET_GAP_CLOSED = 0.5
# Table columns (short names, so a table fits a terminal) -> JSON field.
COLUMNS = {1: {"cap": "capacity_frac", "policy": "policy", "prefix": "prefix_hit_ratio", "block": "block_hit_ratio",
               "gap": "gap_closed", "ttft_s": "ttft_mean_s", "ns": "ns_per_access", "ns/lru": "ns_vs_lru"},
           2: {"cap": "capacity_frac", "policy": "policy", "prefix": "prefix_hit_ratio", "slow": "slow_hit_ratio",
               "ttft_s": "ttft_mean_s", "p99_s": "ttft_p99_s", "ttft/lru": "ttft_vs_lru", "ns": "ns_per_access"}}


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """"EVICTION[+ADMISSION]", e.g. "lru", "heat+second"; or "belady" / an oracle (they read the future)."""

    eviction: str
    admission: str = "always"

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        eviction, _, admission = text.partition("+")
        return cls(eviction, admission or "always")

    def factory(self, future: BeladyFuture | None) -> IndexFactory:
        if self.eviction == "belady" or self.eviction in ORACLES:
            if future is None:
                raise ValueError(f"{self.eviction} needs the trace's future")
            policy_class = Belady if self.eviction == "belady" else ORACLES[self.eviction]
            return lambda capacity: PolicyIndex(capacity, policy_class(capacity, future))
        make_eviction(self.eviction, 1)  # fail early on a bad name
        admission = None if self.admission == "always" else self.admission
        return lambda capacity: PolicyIndex(capacity, make_eviction(self.eviction, capacity),
                                            make_admission(admission, capacity) if admission else None)


def _future(trace: Trace) -> BeladyFuture:
    return BeladyFuture(request.hash_ids for request in trace.requests)


def simulate(trace: Trace, label: str, tiers: int, capacity_frac: float, model: TTFTModel, metas) -> SimResult:
    """One run: `label` is a one-tier policy spec, or a key of TWO_TIER."""
    fast_text, slow_text, config = (label, label, None) if tiers == 1 else TWO_TIER[label]
    fast, slow = PolicySpec.parse(fast_text), PolicySpec.parse(slow_text)
    is_offline = any(spec.eviction == "belady" or spec.eviction in ORACLES for spec in (fast, slow))
    future = _future(trace) if is_offline else None
    clock = None if future is None else (lambda i: setattr(future, "now", i))
    if tiers == 1:
        return simulate_one_tier(trace, fast.factory(future), capacity_frac, label, model, metas, clock)
    return simulate_two_tiers(trace, fast.factory(future), slow.factory(future), capacity_frac, label, config,
                              model, metas, on_request=clock)


def result_row(res: SimResult, lru: SimResult, belady: SimResult) -> dict:
    gap = belady.prefix_hit_ratio - lru.prefix_hit_ratio
    row = {"trace": res.trace, "policy": res.policy, "tiers": res.tiers, "capacity_frac": res.capacity_frac,
           "capacity_blocks": res.capacity_blocks, "prefix_hit_ratio": round(res.prefix_hit_ratio, 4),
           "block_hit_ratio": round(res.block_hit_ratio, 4),
           "gap_closed": round((res.prefix_hit_ratio - lru.prefix_hit_ratio) / gap, 3) if gap > 0 else None,
           "slow_hit_ratio": round(res.slow_hit_tokens / res.prompt_tokens, 4) if res.tiers == 2 else None,
           "blocks_moved": res.blocks_moved, "evicted": list(res.num_evicted), "refused": list(res.num_refused),
           "ttft_mean_s": round(res.ttft_mean_s, 4), "ttft_p99_s": round(res.ttft_p99_s, 3),
           "ttft_vs_lru": round(res.ttft_mean_s / lru.ttft_mean_s, 3),
           "ns_per_access": round(res.ns_per_access), "ns_vs_lru": round(res.ns_per_access / lru.ns_per_access, 2)}
    if res.tiers == 2:
        fast, slow, config = TWO_TIER[res.policy]
        row.update(fast_policy=fast, slow_policy=slow, placement=config.mode, promote_after=config.promote_after)
    return row


def trace_rows(trace: Trace, tiers: int, capacities, labels, model: TTFTModel, log=print) -> list[dict]:
    metas = request_metas(trace, model)
    default = DEFAULT_ONE_TIER if tiers == 1 else DEFAULT_TWO_TIER
    rows = []
    for frac in capacities:
        start = time.perf_counter()
        results = {label: simulate(trace, label, tiers, frac, model, metas)
                   for label in dict.fromkeys(["lru", "belady", *labels, default])}
        for label, res in results.items():
            rows.append(result_row(res, results["lru"], results["belady"]))
        rows.append({**result_row(results[default], results["lru"], results["belady"]), "policy": "default",
                     "same_as": default})
        log(f"{trace.name}: {tiers} tier(s) at {frac:.0%} in {time.perf_counter() - start:.0f} s")
    return rows


def lru_index_today_ns(trace: Trace, capacity_frac: float = 0.03, num_accesses: int = 20000) -> float:
    """ns per access of today's `tiers.base.LRUIndex` (its `add` copies the key list: O(n) per store)."""
    from kvfabric.tiers.base import LRUIndex
    index = LRUIndex(max(1, int(capacity_frac * trace.num_distinct_blocks)))
    keys = [block for request in trace.requests for block in request.hash_ids][:num_accesses]
    start = time.process_time()
    for key in keys:
        if not index.touch(key):
            index.add(key, 1)
    return 1e9 * (time.process_time() - start) / len(keys)


def summarize(rows: list[dict]) -> dict:
    summary = {}
    for row in rows:
        if row["policy"] in ("lru", "belady", "default") or row["policy"].startswith("oracle"):
            continue
        key = f"{row['trace']}.{row['tiers']}tier.{row['capacity_frac']:g}"
        best = summary.get(key)
        if best is None or (row["prefix_hit_ratio"] > best["prefix_hit_ratio"] if row["tiers"] == 1
                            else row["ttft_mean_s"] < best["ttft_mean_s"]):
            summary[key] = row
    out = {}
    for key, row in summary.items():
        if row["tiers"] == 1:
            met = row["gap_closed"] is not None and row["gap_closed"] >= TARGET_GAP_CLOSED
            out[key] = f"{row['policy']} {row['prefix_hit_ratio']:.3f} closes {row['gap_closed']:.0%} of the gap" + \
                (" (target met)" if met else " (target 50 %: not met)")
        else:
            out[key] = f"{row['policy']} ttft {row['ttft_vs_lru']:.2f} x lru write-through" + \
                (" (target met)" if row["ttft_vs_lru"] <= 0.75 else " (target 0.75: not met)")
    return out


def run(traces=tuple(TRACE_FILES), capacities=CAPACITIES, policies=ONE_TIER, tiers=(1, 2), as_json=False,
        plot=None, limit=None, bounds=False, model: TTFTModel = TTFTModel()) -> list[dict]:
    from rich.console import Console
    console = Console(stderr=True)
    rows, notes = [], {}
    for name in traces:
        trace = load_trace(name, limit)
        notes[f"{trace.name}.lru_index_today_ns"] = round(lru_index_today_ns(trace))
        for num_tiers in tiers:
            labels = list(policies) + (list(ORACLES) if bounds else []) if num_tiers == 1 else list(TWO_TIER)
            rows += trace_rows(trace, num_tiers, capacities, labels, model, log=console.print)
    if as_json:
        emit(rows, True, "", [])
    else:
        for name in dict.fromkeys(row["trace"] for row in rows):
            for num_tiers in tiers:
                columns = COLUMNS[num_tiers]
                shown = [{short: row.get(field) for short, field in columns.items()} for row in rows
                         if row["trace"] == name and row["tiers"] == num_tiers]
                emit(shown, False, f"{name} trace, {num_tiers} tier(s) (simulated; TTFT modelled)", list(columns))
    emit_summary({**summarize(rows), **notes, "ttft_model": str(model)}, as_json, "best online policies")
    if plot:
        from kvfabric.bench.trace_plot import plot_rows
        plot_rows(rows, plot)
        console.print(f"plot written to {plot}")
    return rows
