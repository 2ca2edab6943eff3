"""Exact attention of one decode query over each KV head's resident pages (no approximation inside a page).

Contract:
- `gather(block, k_pool, v_pool, num_tokens)`: `block [R, n]` is the block id of page p of head row r (-1: not
  resident). Returns `Resident`: every row's resident pages in position order, gathered into K / V ``[R, Tk, D]``
  (Tk = the most pages any row holds x P), the page id of each slot ``[R, Tk / P]`` and `mask` ``[R, Tk]`` of the
  tokens that exist (rows with fewer pages are padded; tokens past num_tokens in the tail page are out). When every
  row holds the same pages count the tail is last in each row and K / V are cut to the real tokens: no mask.
- `attend(q, res, scaling)`: q ``[R * G, D]`` (query heads of row r are r * G ... r * G + G - 1) -> ``[R * G, D]``,
  softmax(q k^T * scaling) v over exactly each row's own resident tokens, with torch's sdpa and native GQA: the
  same call and kernel as dense decode, so over all pages in order it gives dense KV's result bit for bit.
- `attend_with_mass(q, res, scaling)` -> (out, mass ``[R, Tk / P]``: the attention probability each resident page
  received, summed over its G query heads), computed explicitly (what H2O accumulates).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Resident:
    k: torch.Tensor  # [R, Tk, D]
    v: torch.Tensor  # [R, Tk, D]
    pages: torch.Tensor  # [R, Tk / P] page id per slot (n for padding)
    mask: torch.Tensor | None  # bool [R, Tk], None when every token is real
    page_size: int


def gather(block: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, num_tokens: int) -> Resident:
    rows, num_pages = block.shape
    page_size, dim = k_pool.shape[1], k_pool.shape[2]
    present = block >= 0
    counts = present.sum(1)
    width = int(counts.max())
    even = bool((counts == width).all())
    if even:  # the common step: every row holds as many pages; nonzero lists them row by row, ascending
        pages = present.nonzero()[:, 1].view(rows, width)
        blocks = block.gather(1, pages)
    else:
        order = torch.where(present, torch.arange(num_pages), num_pages)  # absent pages sort last
        pages = torch.sort(order, dim=1).values[:, :width]  # [R, width]: resident page ids ascending, then padding
        blocks = block.gather(1, pages.clamp(max=num_pages - 1)).clamp(min=0)  # padding reads block 0, masked
    flat = blocks.flatten()  # index_select: several times faster than advanced indexing for this gather
    k = k_pool.index_select(0, flat).view(rows, width * page_size, dim)
    v = v_pool.index_select(0, flat).view(rows, width * page_size, dim)
    if even:  # the tail page is the last slot of every row: cut it to its tokens
        tokens = width * page_size - ((num_pages * page_size) - num_tokens)
        return Resident(k[:, :tokens], v[:, :tokens], pages, None, page_size)
    token_pos = pages[:, :, None] * page_size + torch.arange(page_size)  # [R, width, P]
    mask = ((pages < num_pages)[:, :, None] & (token_pos < num_tokens)).view(rows, width * page_size)
    return Resident(k, v, pages, mask, page_size)


def attend(q: torch.Tensor, res: Resident, scaling: float) -> torch.Tensor:
    rows = res.k.shape[0]
    group = q.shape[0] // rows
    mask = None if res.mask is None else res.mask.repeat_interleave(group, 0)[None, :, None, :]  # [1, Hq, 1, Tk]
    out = F.scaled_dot_product_attention(q[None, :, None], res.k[None], res.v[None], attn_mask=mask,
                                         dropout_p=0.0, scale=scaling, is_causal=False, enable_gqa=True)
    return out[0, :, 0]  # [R * G, D]


def attend_with_mass(q: torch.Tensor, res: Resident, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, tokens, dim = res.k.shape
    group = q.shape[0] // rows
    scores = torch.matmul(q.view(rows, group, dim), res.k.transpose(1, 2)) * scaling  # [R, G, Tk]
    if res.mask is not None:
        scores.masked_fill_(~res.mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, res.v).view(rows * group, dim)
    width = res.pages.shape[1]
    token_mass = torch.zeros(rows, width * res.page_size)
    token_mass[:, :tokens] = probs.sum(1)  # [R, Tk] summed over the group
    return out, token_mass.view(rows, width, res.page_size).sum(-1)
