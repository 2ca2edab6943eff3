"""One layer's per-step page selection for its TOPK heads: the radar (every head, every step), then the re-rank
(only the heads due). Called through `LayerPages.select` before the layer attends.

Contract (`select(pages, q, step, scaling)`, q ``[H, G, D]`` this step's queries by KV head):
- radar: every TOPK head's pages are scored with this step's query (radar.page_scores, in logits: q is scaled
  first), the scores kept in `pages.score` (what eviction ranks by). A head not due promotes up to
  `radar_promotions` offloaded pages, the best first, each whose score beats the K-th (lowest) resident page's by
  `radar_margin` and the resident page it replaces (the j-th best offloaded against the j-th lowest resident).
- re-rank: the heads due (step 0: every head; then `Schedule`) keep the sink, the recent pages and the top pages by
  score. Only pages whose residency changes move (pages.demote / pages.promote).
- `Schedule(intervals, phase, stable)`: the due heads of each step, precomputed per group (the heads the split
  calls stable, and the others) as index tensors, so a group with no head due costs a step nothing and a due group
  selects over its due heads only.
- time: CPU time of the calling thread (a shared machine's other work does not count) in `pages.counts`:
  `radar_s` (scoring, hit detection, the radar's promotions), `rerank_s` (selection and moves of the due heads),
  `stable_rerank_s` (the part of rerank_s spent on the stable group).
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from kvfabric.engines.flexicache.radar import page_scores

if TYPE_CHECKING:
    from kvfabric.engines.flexicache.pages import LayerPages

NEG, POS = float("-inf"), float("inf")


class Schedule:
    """Which TOPK rows re-rank at each step: (stable?, rows [d]) per group, cycling with the groups' period."""

    def __init__(self, intervals: torch.Tensor, phase: torch.Tensor, stable: torch.Tensor) -> None:
        rows = torch.arange(intervals.numel())
        self.groups: list[tuple[bool, torch.Tensor, list[torch.Tensor]]] = []  # (stable, all rows, due per slot)
        self.period = 1
        for is_stable in (False, True):
            members = rows[stable == is_stable]
            if members.numel():
                period = math.lcm(*intervals[members].tolist())
                due = [members[(phase[members] + s) % intervals[members] == 0] for s in range(period)]
                self.groups.append((is_stable, members, due))
                self.period = math.lcm(self.period, period)
        # [period, R]: rows due at step % period (step 0: all)
        self.due_mask = torch.zeros(self.period, rows.numel(), dtype=torch.bool)
        for _, _, due in self.groups:
            for s in range(self.period):
                self.due_mask[s, due[s % len(due)]] = True
        self.every_step = bool(self.due_mask.all())  # no head ever waits for the radar (quest, interval 1)

    def due(self, step: int) -> list[tuple[bool, torch.Tensor]]:
        """(stable?, rows due) of each group with a head due at `step`."""
        if step == 0:
            return [(s, members) for s, members, _ in self.groups]
        return [(s, due[step % len(due)]) for s, _, due in self.groups if due[step % len(due)].numel()]


def select(pages: LayerPages, q: torch.Tensor, step: int, scaling: float) -> None:
    topk = pages.rows_topk
    clock, counts, plan = time.thread_time, pages.counts, pages.plan
    start = clock()
    num_pages = pages.num_pages
    scores = page_scores(q[topk] * scaling, pages.summary[:, :, :num_pages], plan.radar_score)  # [R, n] logits
    pages.score[:, :num_pages] = scores
    resident = pages.block[topk, :num_pages] >= 0  # [R, n]
    pinned = pages.pinned(num_pages)  # [n]
    schedule = pages.schedule
    if step and not schedule.every_step:  # radar: heads not due this step
        wait = ~schedule.due_mask[step % schedule.period]  # [R]
        many = min(plan.radar_promotions, num_pages)
        low = torch.topk(scores.masked_fill(~resident | pinned, POS), many, dim=1, largest=False)  # [R, m] asc.
        best = torch.topk(scores.masked_fill(resident | pinned, NEG), many, dim=1)  # [R, m] offloaded, desc.
        hit = (best.values > low.values[:, :1] + plan.radar_margin) & (best.values > low.values) & wait[:, None]
        if bool(hit.any()):
            r, j = hit.nonzero(as_tuple=True)
            pages.demote(r, low.indices[r, j])
            pages.promote(r, best.indices[r, j])
            counts.radar_hits += int(hit.any(1).sum())  # hit rows wait: the due rows' residency holds
    now = clock()
    counts.radar_s += now - start
    due = schedule.due(step)
    if not due:
        return
    num_pinned = int(pinned.sum())
    num_sel = min(pages.cap(num_pages), num_pages) - num_pinned
    for stable, rows in due:
        want = pinned.expand(rows.numel(), num_pages).clone()  # [d, n]: pinned pages stay
        if num_sel > 0:
            idx = torch.topk(scores[rows].masked_fill(pinned, NEG), num_sel, dim=1).indices
            want.scatter_(1, idx, True)
        res = resident[rows]
        r, p = (res & ~want).nonzero(as_tuple=True)
        if r.numel():
            pages.demote(rows[r], p)
        r, p = (want & ~res).nonzero(as_tuple=True)
        if r.numel():
            pages.promote(rows[r], p)
        end = clock()
        counts.reranks += rows.numel()
        counts.rerank_s += end - now
        if stable:
            counts.stable_reranks += rows.numel()
            counts.stable_rerank_s += end - now
        now = end
