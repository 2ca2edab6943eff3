"""Per-page key summaries that stay resident and bound every page's attention logit (Quest-style).

Contract: for a page with element-wise key minimum `kmin` and maximum `kmax` ``[D]``, and a query ``q [D]``,
``sum_d max(q_d * kmin_d, q_d * kmax_d)`` is an upper bound of ``q . k`` for every key k in the page. With GQA a KV
head serves G query heads; its page score is the largest bound over them. `page_bounds` computes that for all
pages of several heads at once with two matmuls: q+ . kmax + q- . kmin (q+ / q- the positive / negative parts).
`update_summary` folds one new key into its page's summary.
"""
from __future__ import annotations

import torch


def page_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q [R, G, D], kmin / kmax [R, n, D] -> float [R, n]: per page, the largest upper bound of q.k over G."""
    bound = torch.matmul(q.clamp(min=0), kmax.transpose(1, 2)) + torch.matmul(q.clamp(max=0), kmin.transpose(1, 2))
    return bound.amax(dim=1)  # [R, G, n] -> [R, n]


def update_summary(kmin: torch.Tensor, kmax: torch.Tensor, key: torch.Tensor, first: bool) -> None:
    """kmin / kmax [H, D] (one page per head, in place), key [H, D]: the page's first key resets the summary."""
    if first:
        kmin.copy_(key)
        kmax.copy_(key)
    else:
        torch.minimum(kmin, key, out=kmin)
        torch.maximum(kmax, key, out=kmax)


def summarize(keys: torch.Tensor, num_tokens: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [H, >= num_tokens, D] -> (kmin, kmax) [H, pages, D] of the pages of the first num_tokens keys."""
    heads, _, dim = keys.shape
    num_pages = -(-num_tokens // page_size)
    padded = torch.empty(heads, num_pages * page_size, dim)
    padded[:, :num_tokens] = keys[:, :num_tokens]
    padded[:, num_tokens:] = keys[:, num_tokens - 1:num_tokens]  # repeat the last key: leaves min/max unchanged
    pages = padded.view(heads, num_pages, page_size, dim)
    return pages.amin(dim=2), pages.amax(dim=2)
