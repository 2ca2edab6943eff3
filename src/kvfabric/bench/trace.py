"""`kvfabric bench trace`: cache policies and placement replayed over request traces (Mooncake) through the real
tiers, against LRU (today's behaviour) and Belady's offline optimum measured in the same run.

Set-ups: (a) one tier at 1, 3, 10 and 30 % of the trace's distinct blocks: the cpu tier with every eviction
policy (and some admission policies), the shm pool (its own LRU), Belady; (b) two tiers: the cpu tier at those
capacities over a disk tier 10x larger, write-through (today) or exclusive (demote on evict), promotion on the
k-th slow hit, LRU everywhere with write-through as the baseline, Belady on both tiers as the bound.

Where each row comes from (`source`): "replay" rows run the real CacheEngine, TierStack, tiers, files and shared
memory (trace_replay.py; blocks scaled to 124-byte chunks); "sim" rows (`--bounds`: oracle-informed policies;
`--sim`: everything) come from the bookkeeping-only simulator (trace_sim.py), the fast path. `ns_per_access`
is always the simulator's: the policy's bookkeeping alone (PolicyIndex + policy, process time over the first
MEASURE_REQUESTS requests), beside LRU's (`ns_vs_lru`); `replay_us_per_access` is the whole real path per block.

TTFT per request is modelled from figures measured in the same run (trace_measure.py: the tiers' read
throughputs as `bench tiers` measures them, the real model's prefill rate fitted over context lengths); the
summary says which. Metrics: prefix hit ratio (prefix hit tokens / prompt tokens: lookups stop at the first
missing block), block hit ratio (issue 16's table), the share of the LRU -> Belady gap closed (prefix metric),
TTFT mean and p99, and per tier: prefix hit tokens, block hits, bytes moved into it, evictions, refusals.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from kvfabric.bench.common import emit, emit_summary
from kvfabric.bench.trace_data import TRACE_FILES, Trace, load_trace
from kvfabric.bench.trace_oracles import OracleAlive, OraclePopularity
from kvfabric.bench.trace_replay import ReplayResult, ReplaySetup, TierSpec, replay, trace_keys
from kvfabric.bench.trace_sim import (
    IndexFactory,
    SimResult,
    TierConfig,
    TraceRun,
    TTFTModel,
    request_metas,
    simulate_one_tier,
    simulate_two_tiers,
)
from kvfabric.config import Config, PlacementConfig
from kvfabric.research.belady import Belady, BeladyFuture
from kvfabric.tiers.policies import PolicyIndex, make_admission, make_eviction

CAPACITIES = (0.01, 0.03, 0.1, 0.3)
ONE_TIER = ("lru", "lfu", "s3fifo", "arc", "heat", "lru+second", "lru+tinylfu", "heat+second", "shm")
ORACLES = {"oracle-alive": OracleAlive, "oracle-popularity": OraclePopularity}
EXCLUSIVE = PlacementConfig(mode="exclusive")
# Two tiers: label -> (cpu tier's policy, disk tier's policy, placement); "lru" = today's behaviour.
TWO_TIER = {"lru": ("lru", "lru", PlacementConfig()),
            "lru/exclusive": ("lru", "lru", EXCLUSIVE),
            "heat/write-through": ("heat", "heat", PlacementConfig()),
            "heat+lru/exclusive": ("heat", "lru", EXCLUSIVE),
            "lru+s3fifo/exclusive": ("lru", "s3fifo", EXCLUSIVE),
            "lru/exclusive/k2": ("lru", "lru", PlacementConfig(mode="exclusive", promote_after=2)),
            "belady": ("belady", "belady", EXCLUSIVE)}
MEASURE_REQUESTS = 3000
# The shm pool's allocator sorts its whole index by access time for every put that evicts (tiers/shm/allocator.py):
# replays of a larger pool take hours, so shm rows stop at this many blocks.
SHM_MAX_BLOCKS = 8192
TARGET_GAP_CLOSED = 0.5
TARGET_TTFT_VS_LRU = 0.75
# Table columns (short names, so a table fits a terminal) -> JSON field.
COLUMNS = {1: {"cap": "capacity_frac", "policy": "policy", "src": "source", "prefix": "prefix_hit_ratio",
               "block": "block_hit_ratio", "gap": "gap_closed", "ttft_s": "ttft_mean_s", "ns": "ns_per_access",
               "us/blk": "replay_us_per_access"},
           2: {"cap": "capacity_frac", "policy": "policy", "src": "source", "prefix": "prefix_hit_ratio",
               "slow": "slow_hit_ratio", "ttft_s": "ttft_mean_s", "p99_s": "ttft_p99_s", "ttft/lru": "ttft_vs_lru",
               "moved_mb": "moved_mb", "ns": "ns_per_access"}}


def _spec(text: str) -> str:
    """"lru+always" -> "lru": the admission part only when it is not the default."""
    eviction, _, admission = text.partition("+")
    return eviction if admission in ("", "always") else f"{eviction}+{admission}"


def default_setups() -> tuple[str, tuple[str, str, PlacementConfig]]:
    """The shipped configuration (config defaults): the one-tier policy, and the two-tier set-up."""
    config = Config()
    cpu = _spec(f"{config.cpu.eviction}+{config.cpu.admission}")
    return cpu, (cpu, _spec(f"{config.disk.eviction}+{config.disk.admission}"), config.placement)


# ---- the simulator (fast path: policy overhead, oracle bounds, --sim) ---------------------------------------
def _factory(text: str, future: BeladyFuture | None) -> IndexFactory:
    eviction, _, admission = text.partition("+")
    if eviction == "belady" or eviction in ORACLES:
        policy_class = Belady if eviction == "belady" else ORACLES[eviction]
        return lambda capacity: PolicyIndex(capacity, policy_class(capacity, future))
    make_eviction(eviction, 1)  # fail early on a bad name
    admission = "" if admission in ("", "always") else admission
    return lambda capacity: PolicyIndex(capacity, make_eviction(eviction, capacity),
                                        make_admission(admission, capacity) if admission else None)


def simulate(trace: Trace, label: str, tiers: int, capacity_frac: float, model: TTFTModel, metas,
             two_tier: tuple[str, str, PlacementConfig] | None = None) -> SimResult:
    """One simulator run: `label` is a one-tier policy spec, or names `two_tier` (default: TWO_TIER[label])."""
    fast, slow, placement = (label, label, None) if tiers == 1 else (two_tier or TWO_TIER[label])
    is_offline = any(text.partition("+")[0] in ("belady", *ORACLES) for text in (fast, slow))
    future = BeladyFuture(request.hash_ids for request in trace.requests) if is_offline else None
    clock = None if future is None else (lambda i: setattr(future, "now", i))
    if tiers == 1:
        return simulate_one_tier(trace, _factory(fast, future), capacity_frac, label, model, metas, clock)
    return simulate_two_tiers(trace, _factory(fast, future), _factory(slow, future), capacity_frac, label,
                              TierConfig(placement.mode, placement.promote_after), model, metas, on_request=clock)


# ---- rows --------------------------------------------------------------------------------------------------
def result_row(res: TraceRun, lru: TraceRun, belady: TraceRun,
               ns: float | None, lru_ns: float | None) -> dict:
    gap = belady.prefix_hit_ratio - lru.prefix_hit_ratio
    is_replay = isinstance(res, ReplayResult)
    row = {"trace": res.trace, "policy": res.policy, "tiers": res.tiers, "capacity_frac": res.capacity_frac,
           "capacity_blocks": res.capacity_blocks, "source": "replay" if is_replay else "sim",
           "prefix_hit_ratio": round(res.prefix_hit_ratio, 4), "block_hit_ratio": round(res.block_hit_ratio, 4),
           "belady_prefix_hit_ratio": round(belady.prefix_hit_ratio, 4),
           "gap_closed": round((res.prefix_hit_ratio - lru.prefix_hit_ratio) / gap, 3) if gap > 0 else None,
           "slow_hit_ratio": round(res.slow_hit_tokens / res.prompt_tokens, 4) if res.tiers == 2 else None,
           "ttft_mean_s": round(res.ttft_mean_s, 4), "ttft_p99_s": round(res.ttft_p99_s, 3),
           "ttft_vs_lru": round(res.ttft_mean_s / lru.ttft_mean_s, 3),
           "ns_per_access": None if ns is None else round(ns),
           "ns_vs_lru": None if ns is None or not lru_ns else round(ns / lru_ns, 2),
           "evicted": list(res.num_evicted), "refused": list(res.num_refused)}
    if is_replay:
        row.update(tier_names=list(res.tier_names), hit_tokens=list(res.hit_tokens),
                   block_hits=list(res.tier_block_hits), bytes_moved=list(res.bytes_moved),
                   moved_mb=round(sum(res.bytes_moved) / 1e6, 2), replay_us_per_access=round(res.us_per_access, 1))
    else:
        row.update(blocks_moved=res.blocks_moved)
    return row


def _overhead_ns(trace: Trace, tiers: int, label: str, capacity_frac: float, model: TTFTModel,
                 two_tier: tuple[str, str, PlacementConfig] | None = None) -> float | None:
    """The policy's bookkeeping per block access (simulator, first MEASURE_REQUESTS requests); None for shm."""
    if label == "shm":
        return None
    head = Trace(trace.name, trace.requests[:MEASURE_REQUESTS], trace.num_distinct_blocks,
                 sum(len(r.hash_ids) for r in trace.requests[:MEASURE_REQUESTS]), trace.block_tokens)
    return simulate(head, label, tiers, capacity_frac, model, request_metas(head, model), two_tier).ns_per_access


def _setup(label: str, tiers: int, two_tier: tuple[str, str, PlacementConfig] | None = None) -> ReplaySetup:
    if tiers == 1:
        return ReplaySetup(label, (TierSpec("shm"),) if label == "shm" else (TierSpec("cpu", label),))
    fast, slow, placement = two_tier or TWO_TIER[label]
    return ReplaySetup(label, (TierSpec("cpu", fast), TierSpec("disk", slow)), placement)


def trace_rows(trace: Trace, tiers: int, capacities, labels, model: TTFTModel, root: Path, is_sim: bool,
               bounds: bool, log=print) -> list[dict]:
    metas = request_metas(trace, model)
    keys = None if is_sim else trace_keys(trace)
    one_default, two_default = default_setups()
    default = (one_default, None) if tiers == 1 else ("default", two_default)
    rows = []
    for frac in capacities:
        start = time.perf_counter()
        runs = {}
        for label in dict.fromkeys(["lru", "belady", *labels, default[0]]):
            two = default[1] if label == "default" else None
            if label == "shm" and (is_sim or frac * trace.num_distinct_blocks > SHM_MAX_BLOCKS):
                continue
            if two is not None and two == TWO_TIER["lru"]:
                runs[label] = replace(runs["lru"], policy="default")  # the shipped set-up is today's
                continue
            if is_sim:
                runs[label] = simulate(trace, label, tiers, frac, model, metas, two)
            else:
                runs[label] = replay(trace, _setup(label, tiers, two), frac, model, root, keys)
        lru_ns = _overhead_ns(trace, tiers, "lru", frac, model)
        made = {}
        for label, res in runs.items():
            two = default[1] if label == "default" else None
            ns = _overhead_ns(trace, tiers, label, frac, model, two) if label != "lru" else lru_ns
            made[label] = result_row(res, runs["lru"], runs["belady"], ns, lru_ns)
        if tiers == 1:
            made["default"] = {**made[default[0]], "policy": "default", "same_as": default[0]}
        else:
            fast, slow, placement = default[1]
            made["default"]["same_as"] = f"cpu {fast}, disk {slow}, {placement.mode}, promote after {placement.promote_after}"
        rows += made.values()
        if bounds and tiers == 1:
            for label in ORACLES:
                res = simulate(trace, label, 1, frac, model, metas)
                rows.append(result_row(res, runs["lru"], runs["belady"], None, lru_ns))
        log(f"{trace.name}: {tiers} tier(s) at {frac:.0%} in {time.perf_counter() - start:.0f} s")
    return rows


def summarize(rows: list[dict]) -> dict:
    best: dict[str, dict] = {}
    for row in rows:
        if row["policy"] in ("lru", "belady", "default") or row["policy"].startswith("oracle"):
            continue
        key = f"{row['trace']}.{row['tiers']}tier.{row['capacity_frac']:g}"
        old = best.get(key)
        if old is None or (row["prefix_hit_ratio"] > old["prefix_hit_ratio"] if row["tiers"] == 1
                           else row["ttft_mean_s"] < old["ttft_mean_s"]):
            best[key] = row
    out = {}
    for key, row in best.items():
        if row["tiers"] == 1:
            met = row["gap_closed"] is not None and row["gap_closed"] >= TARGET_GAP_CLOSED
            closed = "n/a" if row["gap_closed"] is None else f"{row['gap_closed']:.0%}"
            out[key] = (f"{row['policy']} {row['prefix_hit_ratio']:.3f} (lru -> belady gap closed {closed}, belady "
                        f"{row['belady_prefix_hit_ratio']:.3f})" + (" target met" if met else " target 50 %: not met"))
        else:
            met = row["ttft_vs_lru"] <= TARGET_TTFT_VS_LRU
            out[key] = f"{row['policy']} ttft {row['ttft_vs_lru']:.2f} x lru write-through" + \
                (" target met" if met else f" target {TARGET_TTFT_VS_LRU}: not met")
    return out


def run(traces=tuple(TRACE_FILES), capacities=CAPACITIES, policies=ONE_TIER, tiers=(1, 2), as_json=False,
        plot=None, limit=None, bounds=False, model: TTFTModel | None = None, is_sim: bool = False,
        replay_dir: str | None = None, quick: bool = False) -> list[dict]:
    from rich.console import Console
    console = Console(stderr=True)
    figures: dict = {}
    if model is None:
        from kvfabric.bench.trace_measure import measure
        model, figures = measure(quick, log=console.print)
    rows: list[dict] = []
    root_dir = replay_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    with tempfile.TemporaryDirectory(prefix="kvfabric-replay-", dir=root_dir) as root:
        for name in traces:
            trace = load_trace(name, limit)
            for num_tiers in tiers:
                labels = list(policies) if num_tiers == 1 else list(TWO_TIER)
                rows += trace_rows(trace, num_tiers, capacities, labels, model, Path(root), is_sim, bounds,
                                   log=console.print)
    if as_json:
        emit(rows, True, "", [])
    else:
        for name in dict.fromkeys(row["trace"] for row in rows):
            for num_tiers in tiers:
                columns = COLUMNS[num_tiers]
                shown = [{short: row.get(field) for short, field in columns.items()} for row in rows
                         if row["trace"] == name and row["tiers"] == num_tiers]
                emit(shown, False, f"{name} trace, {num_tiers} tier(s) (TTFT modelled)", list(columns))
    emit_summary({**summarize(rows), "ttft_model": str(model), **{f"measured.{k}": str(v) for k, v in figures.items()}},
                 as_json, "best online policies")
    if plot:
        from kvfabric.bench.trace_plot import plot_rows
        plot_rows(rows, plot)
        console.print(f"plot written to {plot}")
    return rows

