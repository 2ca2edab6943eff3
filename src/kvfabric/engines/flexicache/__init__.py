"""FlexiCache: head-stability-aware decode KV memory for the reference engine.

Attention heads differ in how stable the pages they attend to are from one decode step to the next. Unstable
heads keep every page resident; stable heads keep only their top-K pages (K from the budget) in the fast pool, the
rest live in a slower pool (a real copy, never dropped), per-page min/max/mean keys stay resident as a radar that
promotes an offloaded page when its score beats the resident K-th page, and stable heads re-rank every N steps.

Modules (each states its contract): `heads` (the per-model head table, shipped in `tables/`), `plan` (roles and
budget per head: flexicache, full, and `head_plan`, the hook for other plans), `pools` (fast blocks, slow pages),
`radar` (page summaries: bounds and scores), `pages` (one layer's residency and moves), `rerank` (its per-step radar
and re-rank of the due heads), `attention` (exact attention over resident pages), `paged` (PagedKV: the
transformers Cache that ties them together, and its stats). Apart from the runtime, in kvfabric.research: the
head-stability study that measures the head table (`head_stability`, `kvfabric profile flexicache`), the attention
probe it records with, and the benchmark's baselines as head plans (`flexicache_baselines`: quest, streaming, h2o,
shuffled).

`paged_kv(model_config, model_id, config, max_tokens, ...)` builds a PagedKV for a HF decoder from a
FlexiCacheConfig; the engine then runs ``model(..., cache=kv, kv_attention=kv)`` one token at a time.
"""
from __future__ import annotations

from typing import Any

from kvfabric.config import FlexiCacheConfig
from kvfabric.engines.flexicache.heads import HeadTable, HeadTableError, load_table
from kvfabric.engines.flexicache.paged import DecodeMemoryStats, PagedKV
from kvfabric.engines.flexicache.plan import METHODS, BudgetError, HeadPlan, head_plan, make_plan
from kvfabric.engines.runtime import layout_for

__all__ = ["METHODS", "BudgetError", "DecodeMemoryStats", "FlexiCacheConfig", "HeadPlan", "HeadTable",
           "HeadTableError", "PagedKV", "head_plan", "load_table", "make_plan", "paged_kv"]


def paged_kv(model_config: Any, model_id: str, config: FlexiCacheConfig, max_tokens: int, *,
             budget: float | None = None, method: str = "flexicache", table: HeadTable | None = None) -> PagedKV:
    """A PagedKV for a HF decoder config: `budget` (default config.kv_budget), the model's shipped head table
    (or config.head_table, or `table`) for flexicache; `method` one of plan.METHODS."""
    layout = layout_for(model_config)
    if table is None and method == "flexicache":
        table = load_table(model_id, layout.num_layers, layout.num_kv_heads, config.head_table)
    plan = make_plan(method, config.kv_budget if budget is None else budget, layout.num_layers,
                     layout.num_kv_heads, config, table)
    return PagedKV(plan, layout.num_layers, layout.num_kv_heads, layout.head_dim, max_tokens, config.slow_pool)
