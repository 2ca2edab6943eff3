"""Per-page key summaries that stay resident and score every page for a query: the radar.

Contract: a page's summary holds its element-wise key maximum `kmax`, minimum `kmin` and mean `kmean` ``[D]``,
stored as ``[heads, 3D, pages]`` (kmax rows 0..D-1, kmin D..2D-1, kmean 2D..3D-1), so that one batched matmul
scores every page of several heads. For a query ``q [D]``:
- `page_bounds`: ``sum_d max(q_d * kmax_d, q_d * kmin_d)``, an upper bound of ``q . k`` for every key k in the
  page (Quest's bound); with GQA a KV head serves G query heads and its page bound is the largest over them.
- `page_scores(q, summary, "mid")`, what paged heads rank by: per query head the midpoint of the bound and the
  centroid logit ``q . kmean``, then logsumexp over the G heads. Why: the bound alone over-ranks a page with one
  key far out in q's direction, while its attention mass comes from all of its keys; the centroid logit tracks that
  mass and the bound keeps one sharp key from being missed (on SmolLM2 the midpoint came closer to dense KV than the
  bound or the centroid alone: `bench flexicache`'s quest and quest@mid rows, docs/design/measurements.md; logsumexp
  because a page's mass is summed over the group, not maxed). ``"bound"`` ranks by the bound alone (Quest as
  published).
`summarize` builds summaries from keys; `update_summary` folds one new key into its page's summary.
"""
from __future__ import annotations

import torch

ROWS = 3  # summary rows per key dimension: kmax, kmin, kmean
SCORES = ("mid", "bound")


def page_bounds(q: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
    """q [R, G, D], summary [R, 3D, n] -> float [R, n]: per page, the largest upper bound of q.k over G."""
    dim = q.shape[-1]
    signed = torch.cat([q.clamp(min=0), q.clamp(max=0)], dim=-1)  # [R, G, 2D]
    return torch.bmm(signed, summary[:, :2 * dim]).amax(dim=1)


def page_scores(q: torch.Tensor, summary: torch.Tensor, score: str = "mid") -> torch.Tensor:
    """q [R, G, D], summary [R, 3D, n] -> float [R, n]: what a paged head ranks its pages by (module doc)."""
    if score == "bound":
        return page_bounds(q, summary)
    half = 0.5 * q
    signed = torch.cat([half.clamp(min=0), half.clamp(max=0), half], dim=-1)  # [R, G, 3D]: (bound + centroid) / 2
    return torch.bmm(signed, summary).logsumexp(dim=1)


def update_summary(column: torch.Tensor, key: torch.Tensor, slot: int) -> None:
    """column [H, 3D]: one page's summary per head (in place); key [H, D]: the page's key at `slot` (0 resets)."""
    dim = key.shape[-1]
    if slot == 0:
        column[:, :dim] = key
        column[:, dim:2 * dim] = key
        column[:, 2 * dim:] = key
    else:
        column[:, :dim] = torch.maximum(column[:, :dim], key)
        column[:, dim:2 * dim] = torch.minimum(column[:, dim:2 * dim], key)
        column[:, 2 * dim:] += (key - column[:, 2 * dim:]) / (slot + 1)  # running mean of slot + 1 keys


def summarize(keys: torch.Tensor, num_tokens: int, page_size: int) -> torch.Tensor:
    """keys [H, >= num_tokens, D] -> summary [H, 3D, pages] of the pages of the first num_tokens keys."""
    heads, _, dim = keys.shape
    num_pages = -(-num_tokens // page_size)
    padded = torch.empty(heads, num_pages * page_size, dim)
    padded[:, :num_tokens] = keys[:, :num_tokens]
    padded[:, num_tokens:] = keys[:, num_tokens - 1:num_tokens]  # repeat the last key: leaves min/max unchanged
    pages = padded.view(heads, num_pages, page_size, dim)
    counts = torch.full((num_pages, 1), float(page_size))
    counts[-1] = num_tokens - (num_pages - 1) * page_size  # the tail page's real keys
    extra = (num_pages * page_size - num_tokens) * keys[:, num_tokens - 1]  # [H, D]: the repeats in the tail's sum
    total = pages.sum(dim=2)
    total[:, -1] -= extra
    return torch.cat([pages.amax(dim=2), pages.amin(dim=2), total / counts], dim=-1).transpose(1, 2)
