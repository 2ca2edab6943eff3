"""bench.flexicache's scoring and target judgement on constructed rows (the bench itself runs the real model)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfabric.bench.flexicache import clear_steps, compare, summary
from kvfabric.engines.flexicache import HeadTable


def logprobs(rows: list[list[float]]) -> torch.Tensor:
    return torch.log(torch.tensor(rows, dtype=torch.float32))


def test_compare_scores_agreement_and_kl_against_the_reference():
    ref = logprobs([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]])
    same, kl = compare(ref, ref.clone())
    assert same.tolist() == [True, True] and np.allclose(kl, 0.0, atol=1e-7)
    got = logprobs([[0.7, 0.2, 0.1], [0.3, 0.5, 0.2]])  # step 1: the best token changes
    top1, kl = compare(ref, got)
    expected = 0.5 * np.log(0.5 / 0.3) + 0.3 * np.log(0.3 / 0.5)
    assert top1.tolist() == [True, False] and kl[0] == pytest.approx(0, abs=1e-7)
    assert kl[1] == pytest.approx(expected, rel=1e-4)


def test_near_ties_are_told_apart():
    ref = logprobs([[0.50, 0.48, 0.02], [0.6, 0.3, 0.1]])
    assert clear_steps(ref).tolist() == [False, True]


def row(method: str, budget: float, top1: float, kl: float, **extra: float) -> dict:
    prompts = extra.pop("prompts", {"a": (top1, kl)})
    return {"method": method, "budget": budget, "top1": top1, "kl_mean": kl, "tpot_ratio": 1.1, "radar_frac": 0.09,
            "by_prompt": {name: {"top1": t, "kl_mean": k} for name, (t, k) in prompts.items()},
            "bytes_moved_per_step": 1e6, "manage_ms_per_step": extra.pop("manage", 10.0),
            "moved_kb_per_step": 100.0, "stable_promotions_per_step": extra.pop("stable", 50.0),
            "stable_rerank_ms_per_step": extra.pop("stable_rerank", 8.0), "rerank_ms_per_step": 9.0,
            "radar_ms_per_step": extra.pop("radar", 3.0), **extra}


def test_summary_judges_each_target_from_the_rows():
    heads = HeadTable("m", np.array([[0.1, 0.9]], np.float32), threshold=0.5)
    rows = [row("flexicache", 0.3, 0.995, 0.004, manage=4.0, stable=5.0, stable_rerank=2.0, radar=9.0),
            row("quest", 0.3, 0.99, 0.006),
            row("shuffled", 0.3, 0.98, 0.012), row("flexicache@rerank1", 0.3, 0.995, 0.004, manage=10.0),
            row("quest@mid", 0.3, 0.999, 0.001)]  # a variant, not a baseline: reported, not judged against
    out = summary(rows, heads)
    assert out["unstable_heads"] == 1 and out["target_quality_met"] and out["beats_every_baseline_at_30"]
    assert not out["beats_quest_mid_at_30"] and out["quest_mid_kl_mean_at_30"] == 0.001
    assert out["radar_frac_at_30"] == 0.09 and out["min_prompt_top1_at_30"] == 0.995
    assert out["shuffled_kl_over_flexicache"] == pytest.approx(3.0)
    assert out["rerank16_over_rerank1"] == pytest.approx(0.4) and out["target_rerank_cost_met"]
    assert out["rerank16_over_rerank1_stable_rerank"] == pytest.approx(0.25)  # the target: stable heads' CPU time
    assert out["rerank16_over_rerank1_radar_and_rerank"] == pytest.approx(18 / 12)
    assert out["rerank16_over_rerank1_stable_moves"] == pytest.approx(0.1)
    assert out["target_tpot_met"]
    rows[1] = row("quest", 0.3, 0.999, 0.003)  # a baseline with lower KL: flexicache no longer beats it
    rows[0] = row("flexicache", 0.3, 0.98, 0.004, manage=6.0, stable_rerank=5.0)
    out = summary(rows, heads)
    assert not out["beats_every_baseline_at_30"] and not out["target_quality_met"]
    assert not out["target_rerank_cost_met"]
    rows[0] = row("flexicache", 0.3, 0.995, 0.004, prompts={"a": (1.0, 0.002), "b": (0.986, 0.006)})
    out = summary(rows, heads)  # met over both prompts' steps, not on prompt b: not met
    assert not out["target_quality_met"] and out["min_prompt_top1_at_30"] == 0.986
