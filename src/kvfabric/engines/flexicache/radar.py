"""Per-page key summaries that stay resident and bound every page's attention logit (Quest-style).

Contract: for a page with element-wise key maximum `kmax` and minimum `kmin` ``[D]``, and a query ``q [D]``,
``sum_d max(q_d * kmax_d, q_d * kmin_d)`` is an upper bound of ``q . k`` for every key k in the page. With GQA a
KV head serves G query heads; its page score is the largest bound over them. A summary is stored as
``[heads, 2D, pages]`` (kmax in rows 0..D-1, kmin in rows D..2D-1), so that `page_bounds` scores every page of
several heads with one batched matmul: [q+, q-] . [kmax; kmin] (q+ / q- the positive / negative parts of q).
`summarize` builds summaries from keys; `update_summary` folds one new key into its page's summary.
"""
from __future__ import annotations

import torch


def page_bounds(q: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
    """q [R, G, D], summary [R, 2D, n] -> float [R, n]: per page, the largest upper bound of q.k over G."""
    signed = torch.cat([q.clamp(min=0), q.clamp(max=0)], dim=-1)  # [R, G, 2D]
    return torch.bmm(signed, summary).amax(dim=1)


def update_summary(column: torch.Tensor, key: torch.Tensor, first: bool) -> None:
    """column [H, 2D]: one page's summary per head (in place); key [H, D]: the page's first key resets it."""
    dim = key.shape[-1]
    if first:
        column[:, :dim] = key
        column[:, dim:] = key
    else:
        column[:, :dim] = torch.maximum(column[:, :dim], key)
        column[:, dim:] = torch.minimum(column[:, dim:], key)


def summarize(keys: torch.Tensor, num_tokens: int, page_size: int) -> torch.Tensor:
    """keys [H, >= num_tokens, D] -> summary [H, 2D, pages] of the pages of the first num_tokens keys."""
    heads, _, dim = keys.shape
    num_pages = -(-num_tokens // page_size)
    padded = torch.empty(heads, num_pages * page_size, dim)
    padded[:, :num_tokens] = keys[:, :num_tokens]
    padded[:, num_tokens:] = keys[:, num_tokens - 1:num_tokens]  # repeat the last key: leaves min/max unchanged
    pages = padded.view(heads, num_pages, page_size, dim)
    return torch.cat([pages.amax(dim=2), pages.amin(dim=2)], dim=-1).transpose(1, 2)  # [H, 2D, pages]
