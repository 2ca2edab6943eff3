"""FlexiCache's baselines as head plans (kvfabric.research.flexicache_baselines); tests/test_flexicache.py decodes
with every one of them through PagedKV."""
from __future__ import annotations

import numpy as np
import pytest

from kvfabric.config import FlexiCacheConfig
from kvfabric.engines.flexicache import BudgetError
from kvfabric.engines.flexicache import make_plan as runtime_plan
from kvfabric.engines.flexicache.plan import Role
from kvfabric.research.flexicache_baselines import BASELINES, make_plan
from tests.test_flexicache import table


def test_baseline_plans_as_documented():
    cfg = FlexiCacheConfig(max_full_share=0.9, rerank_interval=16, head_order="stability")
    quest = make_plan("quest", 0.3, 4, 3, cfg)
    assert (quest.roles == Role.TOPK).all() and not quest.stable.any() and quest.intervals.max() == 1
    assert (make_plan("streaming", 0.3, 4, 3, cfg).roles == Role.WINDOW).all()
    h2o = make_plan("h2o", 0.3, 4, 3, cfg)
    assert (h2o.roles == Role.HEAVY).all() and h2o.page_size == 1 and not h2o.is_lossless
    with pytest.raises(BudgetError):
        make_plan("quest", 0.0, 4, 3, cfg)


def test_shuffled_keeps_flexicaches_counts_on_random_heads():
    cfg = FlexiCacheConfig(max_full_share=0.9, rerank_interval=16, head_order="stability")
    heads = table(4, 3, unstable=[(0, 0), (1, 1), (3, 2)])
    for budget in (0.1, 0.5):
        plan = make_plan("flexicache", budget, 4, 3, cfg, heads)
        shuffled = make_plan("shuffled", budget, 4, 3, cfg, heads, seed=3)
        assert shuffled.num_full == plan.num_full and shuffled.method == "shuffled"
        assert (shuffled.intervals == 1).sum() == (plan.intervals[plan.roles == Role.TOPK] == 1).sum()
        assert (shuffled.stable == ((shuffled.roles == Role.TOPK) & (shuffled.intervals == 16))).all()
    assert not np.array_equal(make_plan("shuffled", 0.5, 4, 3, cfg, heads, seed=3).roles,
                              make_plan("flexicache", 0.5, 4, 3, cfg, heads).roles)
    with pytest.raises(ValueError):
        make_plan("shuffled", 0.3, 4, 3, cfg)  # no head table


@pytest.mark.parametrize("method", BASELINES)
def test_the_runtime_plans_no_baseline(method):
    with pytest.raises(ValueError, match="research.flexicache_baselines"):
        runtime_plan(method, 0.3, 4, 3, FlexiCacheConfig(), table(4, 3))
