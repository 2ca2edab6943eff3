"""Which KV heads are paged, how, and how many pages each may keep resident under a budget.

Contract: `make_plan(method, budget, num_layers, num_heads, config, table)` -> HeadPlan, a per-(layer, head)
role and re-rank interval:
- `full`: every head FULL (dense KV: the reference);
- `flexicache`: as many heads as the table calls unstable are FULL while they fit in `max_full_share` of the
  budget, taken in the table's `full_order(config.head_order)`; unstable heads not kept whole are TOPK re-ranked
  every step; the stable ones (`stable`, whatever the interval) are TOPK re-ranked every `rerank_interval` steps,
  the radar checking them between.
The plan is the hook the benchmark's baselines use: `head_plan(method, budget, config, roles, intervals, stable)`
makes a HeadPlan from any roles, and kvfabric.research.flexicache_baselines builds quest, streaming, h2o and the
shuffled control with it (PagedKV runs any plan). The roles: FULL (every page resident), TOPK (ranked pages
resident, the rest in the slow pool), WINDOW (sink + newest pages) and HEAVY (one-token pages: the newest and the
heaviest accumulated attention); the last two are what streaming and h2o stand for, and no runtime plan uses them.
Budget: at `num_pages` pages per head the plan may hold `budget_blocks(n) = floor(budget * L * H * n)` blocks;
FULL heads hold all n, every other head at most `cap(n)` (the rest shared evenly). Only FULL/TOPK keep a slow
copy (lossless); WINDOW and HEAVY drop what they evict (the baselines they stand for do).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from kvfabric.config import FlexiCacheConfig
from kvfabric.engines.flexicache.heads import HeadTable

METHODS = ("full", "flexicache")


class Role(IntEnum):
    FULL = 0
    TOPK = 1
    WINDOW = 2
    HEAVY = 3


class BudgetError(ValueError):
    pass


@dataclass(frozen=True, slots=True, eq=False)
class HeadPlan:
    method: str
    budget: float
    page_size: int
    recent_pages: int
    radar_margin: float
    radar_promotions: int
    radar_score: str  # radar.page_scores: "mid" or "bound"
    roles: np.ndarray  # int8 [L, H] of Role
    intervals: np.ndarray  # int32 [L, H]: TOPK heads re-rank every this many steps
    stable: np.ndarray  # bool [L, H]: TOPK heads the split calls stable (re-ranked every rerank_interval steps)
    num_full: int = field(init=False)
    num_paged: int = field(init=False)
    has_topk: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_full", int((self.roles == Role.FULL).sum()))
        object.__setattr__(self, "num_paged", self.roles.size - self.num_full)
        object.__setattr__(self, "has_topk", bool((self.roles == Role.TOPK).any()))  # checked every step

    @property
    def is_lossless(self) -> bool:
        return not np.isin(self.roles, (Role.WINDOW, Role.HEAVY)).any()

    def budget_blocks(self, num_pages: int) -> int:
        return math.floor(self.budget * self.roles.size * num_pages + 1e-9)

    def cap(self, num_pages: int) -> int:
        """Resident pages allowed to each non-FULL head at `num_pages` pages per head."""
        if self.num_paged == 0:
            return num_pages
        spare = self.budget_blocks(num_pages) - self.num_full * num_pages
        return min(num_pages, spare // self.num_paged)

    def min_cap(self) -> int:
        """Fewest pages a non-FULL head can work with: sink + recent + one ranked page (TOPK), or two."""
        return self.recent_pages + 2 if self.has_topk else 2


def check_budget(budget: float) -> None:
    if not 0.0 < budget <= 1.0:
        raise BudgetError(f"kv budget {budget}: expected a fraction in (0, 1]")


def head_plan(method: str, budget: float, config: FlexiCacheConfig, roles: np.ndarray, intervals: np.ndarray,
              stable: np.ndarray, page_size: int | None = None) -> HeadPlan:
    """A HeadPlan of these roles (int8 [L, H] of Role), re-rank intervals and stable split, the rest from `config`
    (`page_size` None: config.page_size)."""
    check_budget(budget)
    return HeadPlan(method=method, budget=budget, page_size=config.page_size if page_size is None else page_size,
                    recent_pages=config.recent_pages, radar_margin=config.radar_margin,
                    radar_promotions=config.radar_promotions, radar_score=config.radar_score, roles=roles,
                    intervals=intervals, stable=stable)


def make_plan(method: str, budget: float, num_layers: int, num_heads: int, config: FlexiCacheConfig,
              table: HeadTable | None = None) -> HeadPlan:
    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {', '.join(METHODS)} (the benchmark's baselines are "
                         "kvfabric.research.flexicache_baselines)")
    check_budget(budget)
    shape = (num_layers, num_heads)
    roles = np.full(shape, Role.TOPK, np.int8)
    stable = np.zeros(shape, bool)
    intervals = np.ones(shape, np.int32)
    if method == "full":
        roles[:] = Role.FULL
        budget = 1.0
    else:
        if table is None:
            raise ValueError(f"method {method} needs a head table")
        unstable = table.unstable().reshape(-1)
        num_full = min(int(unstable.sum()), math.floor(config.max_full_share * budget * roles.size + 1e-9))
        full = table.full_order(config.head_order)[:num_full]  # flat head ids
        every_step = np.flatnonzero(unstable & ~np.isin(np.arange(roles.size), full))  # unstable, not whole
        flat_roles, flat_intervals = roles.reshape(-1), intervals.reshape(-1)
        flat_intervals[:] = config.rerank_interval
        flat_roles[full] = Role.FULL
        flat_intervals[every_step] = 1
        stable = roles == Role.TOPK
        stable.reshape(-1)[every_step] = False
    return head_plan(method, budget, config, roles, intervals, stable)
