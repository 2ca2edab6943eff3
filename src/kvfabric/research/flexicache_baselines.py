"""FlexiCache's baselines and control as head plans, for `kvfabric bench flexicache` and the tests.

Contract: `make_plan(method, budget, num_layers, num_heads, config, table, seed)` -> HeadPlan for every method of
`METHODS`: the runtime's own (`full`, `flexicache`: engines.flexicache.plan.make_plan) and the `BASELINES`, built
here through the runtime's hook, engines.flexicache.plan.head_plan (PagedKV runs any plan):
- `quest`: every head TOPK, re-ranked every step;
- `streaming`: every head WINDOW: the sink page and the newest pages; the rest is dropped;
- `h2o`: every head HEAVY with one-token pages: the newest half of its cap and the heaviest accumulated attention
  (the prompt's attention mass comes from kvfabric.research.attention_probe);
- `shuffled`: flexicache's counts (FULL heads, every-step heads) on randomly chosen heads (seeded): the control.
"""
from __future__ import annotations

import numpy as np

from kvfabric.config import FlexiCacheConfig
from kvfabric.engines.flexicache.heads import HeadTable
from kvfabric.engines.flexicache.plan import METHODS as RUNTIME_METHODS
from kvfabric.engines.flexicache.plan import HeadPlan, Role, head_plan
from kvfabric.engines.flexicache.plan import make_plan as runtime_plan

BASELINES = ("quest", "streaming", "h2o", "shuffled")
METHODS = RUNTIME_METHODS + BASELINES
ROLES = {"quest": Role.TOPK, "streaming": Role.WINDOW, "h2o": Role.HEAVY}


def make_plan(method: str, budget: float, num_layers: int, num_heads: int, config: FlexiCacheConfig,
              table: HeadTable | None = None, seed: int = 0) -> HeadPlan:
    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {', '.join(METHODS)}")
    if method in RUNTIME_METHODS:
        return runtime_plan(method, budget, num_layers, num_heads, config, table)
    if method == "shuffled":
        return shuffled(runtime_plan("flexicache", budget, num_layers, num_heads, config, table), config, seed)
    shape = (num_layers, num_heads)
    return head_plan(method, budget, config, np.full(shape, ROLES[method], np.int8), np.ones(shape, np.int32),
                     np.zeros(shape, bool), page_size=1 if method == "h2o" else None)


def shuffled(plan: HeadPlan, config: FlexiCacheConfig, seed: int) -> HeadPlan:
    """A flexicache plan's counts (heads kept whole, unstable heads re-ranked every step) on random heads."""
    size = plan.roles.size
    num_every_step = int(((plan.roles == Role.TOPK) & ~plan.stable).sum())
    order = np.random.default_rng(seed).permutation(size)
    full, every_step = order[:plan.num_full], order[plan.num_full:plan.num_full + num_every_step]
    roles = np.full(plan.roles.shape, Role.TOPK, np.int8)
    intervals = np.full(plan.roles.shape, config.rerank_interval, np.int32)
    roles.reshape(-1)[full] = Role.FULL
    intervals.reshape(-1)[every_step] = 1
    stable = roles == Role.TOPK
    stable.reshape(-1)[every_step] = False
    return head_plan("shuffled", plan.budget, config, roles, intervals, stable)
