"""PagedKV: decode KV paged per (layer, KV head) under a memory budget, as a transformers Cache.

Contract:
- `PagedKV(plan, num_layers, num_kv_heads, head_dim, max_tokens, slow_pool)` allocates its fast pool once, sized
  for the plan's budget at `max_tokens`, and (when the plan has TOPK heads) a slow pool with one slot per page.
- `ingest(buf, num_tokens, prompt_mass)` takes the prompt's KV from a dense buffer ``[L, 2, H, >= T, D]`` (a
  prefill's output) into the pages (pages.LayerPages.ingest); the dense buffer can be reused afterwards.
- Used as ``model(..., cache=paged, kv_attention=paged)``, one token per forward: each layer's `update` appends the
  token's K/V, then `attend` re-ranks / radar-checks that layer's TOPK heads with the step's query, moves the pages
  that change and computes exact attention over every head's resident pages (attention.paged_attention).
- After every step the fast pool's used blocks are checked against the plan's budget (BudgetError if over: a bug)
  and sampled for `stats()` (DecodeMemoryStats: resident bytes peak / mean, moves, bytes copied, time spent).
- `close()` releases the pools (the shm mapping too).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvfabric.engines.flexicache.attention import attend, attend_with_mass, gather
from kvfabric.engines.flexicache.pages import LayerPages, MoveCounts
from kvfabric.engines.flexicache.plan import BudgetError, HeadPlan, Role
from kvfabric.engines.flexicache.pools import FastPool, SlowPool, Transfers


@dataclass(frozen=True, slots=True)
class DecodeMemoryStats:
    method: str
    budget: float
    page_size: int
    steps: int
    num_full_heads: int
    num_paged_heads: int
    resident_bytes_peak: int  # K/V pages held in the fast pool (fp32), the worst step
    resident_bytes_mean: float
    resident_frac: float  # mean over steps of resident / full-KV blocks at that step
    full_kv_bytes: int  # the same KV dense, at the last step
    radar_bytes: int  # per-page min/max/mean keys of the TOPK heads, resident too (not in resident_bytes)
    fast_pool_bytes: int  # what was reserved up front
    promotions: int
    demotions: int
    dropped: int
    reranks: int
    radar_hits: int
    first_step_moves: int  # the first step fills every TOPK head's pages (ranked by its query): not per-step
    moves_per_step: float  # (promotions + demotions) per decode step after the first
    stable_promotions_per_step: float  # promotions into the split's stable heads, per step after the first
    bytes_moved_per_step: float  # copied between the pools per step after the first (promotions + filled pages)
    ingest_bytes: int  # the prompt's pages copied to the slow pool at the start
    transfer_s_per_step: float  # time in copies between the pools, per step after the first
    manage_s_per_step: float  # time in ranking, radar and moves (transfers included), per step after the first
    # CPU time of the decoding thread per step after the first (unlike the wall times above, what other work on the
    # machine does not inflate): radar = scoring every page + its hits' moves; rerank = the due heads' selection
    # and moves; stable_rerank = the part of rerank spent on the heads the split calls stable
    radar_s_per_step: float = 0.0
    rerank_s_per_step: float = 0.0
    stable_rerank_s_per_step: float = 0.0


class PagedLayer(CacheLayerMixin):
    """The transformers side of one layer: `update` appends the token to the layer's pages."""

    is_compileable = False
    is_sliding = False

    def __init__(self, pages: LayerPages) -> None:
        super().__init__()
        self.pages = pages
        self.is_initialized = True
        self.device = torch.device("cpu")

    def lazy_initialization(self, *args: object) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[-2] != 1:
            raise ValueError("paged decode KV takes one token per forward (the prompt comes in by ingest)")
        self.pages.append(key_states[0, :, 0], value_states[0, :, 0])  # [H, D]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.pages.num_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.pages.num_tokens

    def get_max_length(self) -> int:
        return -1


class PagedKV(Cache):
    def __init__(self, plan: HeadPlan, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int,
                 slow_pool: str = "memory") -> None:
        self.plan = plan
        self.num_kv_heads = num_kv_heads
        max_pages = -(-max_tokens // plan.page_size)
        full_per_layer = (plan.roles == Role.FULL).sum(1) * max_pages  # [L] reserved blocks of FULL heads
        self.fast = FastPool(plan.budget_blocks(max_pages), plan.page_size, head_dim, int(full_per_layer.sum()))
        bases = [0, *full_per_layer.cumsum().tolist()]
        has_topk = bool((plan.roles == Role.TOPK).any())
        self.slow = SlowPool(num_layers, num_kv_heads, max_pages, plan.page_size, head_dim, slow_pool) \
            if has_topk else None
        self.counts = MoveCounts()
        self.pages = [LayerPages(i, plan, max_pages, head_dim, self.fast, self.slow, self.counts, int(bases[i]))
                      for i in range(num_layers)]
        super().__init__(layers=[PagedLayer(p) for p in self.pages])
        self.step = 0
        self._radar_bytes = sum(p.summary.numel() * p.summary.element_size() for p in self.pages)
        self._resident: list[int] = []  # used blocks after each step
        self._full: list[int] = []  # full-KV blocks at each step
        self._manage_s = 0.0
        self._marks: list[tuple[MoveCounts, Transfers, float]] = []  # after ingest, after the first step

    @property
    def num_tokens(self) -> int:
        return self.pages[0].num_tokens

    def ingest(self, buf: torch.Tensor, num_tokens: int, prompt_mass: torch.Tensor | None = None) -> None:
        """buf [L, 2, H, >= num_tokens, D]; prompt_mass [L, H, num_tokens] (HEAVY heads only)."""
        for i, pages in enumerate(self.pages):
            pages.ingest(buf[i, 0, :, :num_tokens], buf[i, 1, :, :num_tokens],
                         None if prompt_mass is None else prompt_mass[i])
        self._check_budget()
        self._mark()

    def _mark(self) -> None:
        transfers = self.slow.transfers if self.slow is not None else Transfers()
        self._marks.append((dataclasses.replace(self.counts), dataclasses.replace(transfers), self._manage_s))

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """query [1, Hq, 1, D] -> [1, 1, Hq, D]; key / value (this token's, already appended) are not used."""
        if query.shape[2] != 1:
            raise ValueError("paged decode KV attends one query at a time")
        layer = module.layer_idx
        pages = self.pages[layer]
        q = query[0, :, 0]  # [Hq, D]
        group = q.shape[0] // self.num_kv_heads
        start = time.perf_counter()
        pages.select(q.view(self.num_kv_heads, group, q.shape[-1]), self.step, scaling)
        self._manage_s += time.perf_counter() - start
        full, paged = pages.rows[Role.FULL], pages.paged
        if pages.all_resident():  # every page of every head: one dense call, as dense KV makes it (bit for bit)
            k, v = pages.full_kv() if not paged.numel() else pages.dense_kv()
            return self._done(layer, sdpa_attention_forward(module, query, k[None], v[None], None,
                                                            scaling=scaling)[0])
        out = torch.empty(q.shape)  # [Hq, D]
        q_full, q_paged = pages.query_rows(group)
        if full.numel():
            k, v = pages.full_kv()
            out[q_full] = sdpa_attention_forward(module, query[:, q_full], k[None], v[None], None,
                                                 scaling=scaling)[0][0, 0]
        res = gather(pages.block[paged, :pages.num_pages], self.fast.k, self.fast.v, pages.num_tokens)
        if pages.rows[Role.HEAVY].numel():  # H2O: every resident token's attention accumulates
            heavy = pages.heavy_row[paged]
            out[q_paged], mass = attend_with_mass(q[q_paged], res, scaling)
            on = (heavy >= 0)[:, None] & (res.pages < pages.num_pages)  # [R, width]
            rows = heavy[:, None].expand_as(res.pages)
            pages.mass.index_put_((rows[on], res.pages[on]), mass[on], accumulate=True)
        else:
            out[q_paged] = attend(q[q_paged], res, scaling)
        return self._done(layer, out.view(1, 1, *out.shape))

    def _done(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        if layer == len(self.pages) - 1:
            self._end_step()
        return out

    def _end_step(self) -> None:
        self._check_budget()
        self.step += 1
        if self.step == 1:
            self._mark()

    def _check_budget(self) -> None:
        num_pages = self.pages[0].num_pages
        used, allowed = self.fast.used, self.plan.budget_blocks(num_pages)
        if used > allowed:
            raise BudgetError(f"{used} resident blocks > budget {allowed} at {num_pages} pages: a paging bug")
        self._resident.append(used)
        self._full.append(len(self.pages) * self.num_kv_heads * num_pages)

    def stats(self) -> DecodeMemoryStats:
        """Figures of the decode so far (after at least one step)."""
        if self.step < 1:
            raise RuntimeError("no decode step yet")
        block_bytes = self.fast.block_bytes
        decode, full = self._resident[1:], self._full[1:]  # samples after each step (the first is the prompt)
        (c0, t0, m0), (c1, t1, m1) = self._marks
        c, t = self.counts, self.slow.transfers if self.slow is not None else Transfers()
        later = max(1, self.step - 1)
        return DecodeMemoryStats(
            method=self.plan.method, budget=self.plan.budget, page_size=self.plan.page_size, steps=self.step,
            num_full_heads=self.plan.num_full, num_paged_heads=self.plan.num_paged,
            resident_bytes_peak=max(self._resident) * block_bytes,
            resident_bytes_mean=sum(decode) / len(decode) * block_bytes,
            resident_frac=sum(u / f for u, f in zip(decode, full)) / len(decode),
            full_kv_bytes=full[-1] * block_bytes, radar_bytes=self._radar_bytes,
            fast_pool_bytes=self.fast.num_blocks * block_bytes, promotions=c.promotions, demotions=c.demotions,
            dropped=c.dropped, reranks=c.reranks, radar_hits=c.radar_hits,
            first_step_moves=c1.promotions + c1.demotions - c0.promotions - c0.demotions,
            moves_per_step=(c.promotions + c.demotions - c1.promotions - c1.demotions) / later,
            stable_promotions_per_step=(c.stable_promotions - c1.stable_promotions) / later,
            bytes_moved_per_step=(t.to_fast_bytes + t.to_slow_bytes - t1.to_fast_bytes - t1.to_slow_bytes) / later,
            ingest_bytes=t0.to_fast_bytes + t0.to_slow_bytes, transfer_s_per_step=(t.seconds - t1.seconds) / later,
            manage_s_per_step=(self._manage_s - m1) / later, radar_s_per_step=(c.radar_s - c1.radar_s) / later,
            rerank_s_per_step=(c.rerank_s - c1.rerank_s) / later,
            stable_rerank_s_per_step=(c.stable_rerank_s - c1.stable_rerank_s) / later)

    def close(self) -> None:
        if self.slow is not None:
            self.slow.close()
        self.fast = FastPool(0, self.plan.page_size, 1)
