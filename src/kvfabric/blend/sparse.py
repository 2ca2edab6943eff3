"""Causal attention for queries at scattered positions, planned once per query set and run in a few large calls.

Contract
--------
* :func:`plan` takes the sorted key slots of the queries (``positions - key_start``; query ``i`` sees key slots
  ``[0, p_i]``) and splits the queries into a few consecutive blocks. Block ``[a, b)`` attends to the key slots
  ``[0, p_a)`` that all its queries see in full (one unmasked call of torch's CPU flash kernel) and to the window
  ``[p_a, p_{b-1}]`` under a causal-by-position mask (one masked call); the two partial softmaxes are merged by their
  log-sum-exp. A plan holds the blocks and their masks, so the layers that share a query set (every layer between
  two check layers of the blender) reuse it.
* :func:`attend` runs a plan: q ``[1, Hq, s, D]``, keys/values ``[1, Hkv, n, D]`` -> ``[1, s, Hq, D]`` (token-major,
  what the output projection takes); equal to a dense masked softmax up to fp32 rounding.

Why this shape: a query block of the flash kernel pays per (query, key) pair and per call. Small blocks pay little
for masked pairs they do not need but many calls (each a parallel region of the thread pool: microseconds on an idle
machine, milliseconds on a loaded one); one block per query set pays for every masked pair up to the last query. The
plan picks the blocks by dynamic programming over ``cost = call_cost * calls + query-key pairs computed``. The query
heads that share a KV head are stacked query-major (row ``i * group + h``), so a block is one contiguous run of rows
and each key is read once per KV head (GQA).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # also returns the log-sum-exp of each row
CALL_COST = 50_000  # query-key pairs one kernel call's fixed cost is worth (a parallel region under load; see
# docs/design/measurements.md)
UNIT = 8  # queries: block boundaries fall on multiples of this (the DP is quadratic in the number of units)


@dataclass(frozen=True, slots=True)
class Block:
    start: int  # first query (index into the sorted queries)
    stop: int
    prefix: int  # key slots [0, prefix) are seen by every query of the block: unmasked
    end: int  # window [prefix, end) is masked causally by position
    mask: torch.Tensor  # [1, 1, group * (stop - start), end - prefix] additive (0 or -inf), rows query-major


@dataclass(frozen=True, slots=True)
class Plan:
    num_queries: int
    group: int  # query heads per KV head
    blocks: tuple[Block, ...]


def choose_blocks(slots: np.ndarray, call_cost: float = CALL_COST, unit: int = UNIT) -> list[tuple[int, int]]:
    """Consecutive query blocks [a, b) minimising sum over blocks of (calls * call_cost + (b - a) * (slots[b-1] + 1)):
    a block computes every pair up to its last query's key. slots: sorted int array [s]."""
    s = len(slots)
    cuts = np.array(list(range(0, s, unit)) + [s])
    starts = cuts[:-1]
    calls = np.where(slots[starts] > 0, 2.0, 1.0) * call_cost  # no prefix call when the block starts at slot 0
    best = np.zeros(len(cuts))
    prev = np.zeros(len(cuts), dtype=np.int64)
    for j in range(1, len(cuts)):
        cost = best[:j] + calls[:j] + (cuts[j] - starts[:j]) * float(slots[cuts[j] - 1] + 1)
        prev[j] = int(np.argmin(cost))
        best[j] = cost[prev[j]]
    blocks = []
    j = len(cuts) - 1
    while j > 0:
        blocks.append((int(cuts[prev[j]]), int(cuts[j])))
        j = int(prev[j])
    return blocks[::-1]


def plan(slots: torch.Tensor, group: int, dtype: torch.dtype = torch.float32, call_cost: float = CALL_COST) -> Plan:
    """The plan for queries at key slots ``slots`` [s] (sorted, distinct, >= 0), ``group`` query heads per KV head."""
    pos = slots.to(torch.int64)
    if pos.numel() == 0:
        raise ValueError("no queries")
    if bool((pos[1:] <= pos[:-1]).any()) or int(pos[0]) < 0:
        raise ValueError("query slots must be increasing and >= 0")
    blocks = []
    for a, b in choose_blocks(pos.numpy(), call_cost):
        prefix, end = int(pos[a]), int(pos[b - 1]) + 1
        hidden = torch.arange(prefix, end).view(1, -1) > pos[a:b].view(-1, 1)  # [m, window]
        mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))
        blocks.append(Block(a, b, prefix, end, mask.repeat_interleave(group, dim=0).view(1, 1, group * (b - a), -1)))
    return Plan(int(pos.numel()), group, tuple(blocks))


def attend(p: Plan, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, Hq, s, D], keys/values [1, Hkv, n, D] -> [1, s, Hq, D]; see the module doc."""
    _, num_q_heads, s, dim = q.shape
    num_kv_heads, g = keys.shape[1], p.group
    if s != p.num_queries or num_q_heads != num_kv_heads * g:
        raise ValueError(f"plan for {p.num_queries} queries x {g} heads per KV head, got q {tuple(q.shape)}")
    rows = q.reshape(1, num_kv_heads, g, s, dim).transpose(2, 3).reshape(1, num_kv_heads, s * g, dim)  # one copy
    win_out, win_lse, pre_out, pre_lse = [], [], [], []
    for blk in p.blocks:
        qb = rows[:, :, blk.start * g:blk.stop * g]
        out, lse = _flash(qb, keys[:, :, blk.prefix:blk.end], values[:, :, blk.prefix:blk.end],
                          attn_mask=blk.mask, scale=scale)
        win_out.append(out)
        win_lse.append(lse)
        if blk.prefix:
            out, lse = _flash(qb, keys[:, :, :blk.prefix], values[:, :, :blk.prefix], scale=scale)
        else:  # nothing before the window: weight 0 in the merge
            out, lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
        pre_out.append(out)
        pre_lse.append(lse)
    # merge: softmax over both parts = weighted mean of the two partial outputs, weights from their log-sum-exps:
    # w_window = e^lw / (e^lw + e^lp) = sigmoid(lw - lp); one lerp instead of rescaling both parts
    weight = torch.sigmoid(torch.cat(win_lse, 2) - torch.cat(pre_lse, 2)).unsqueeze(-1)  # [1, Hkv, s * g, 1]
    out = torch.lerp(torch.cat(pre_out, 2), torch.cat(win_out, 2), weight)  # [1, Hkv, s * g, D]
    return out.view(1, num_kv_heads, s, g, dim).transpose(1, 2).reshape(1, s, num_q_heads, dim)
