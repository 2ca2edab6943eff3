"""One layer's paged decode KV: which pages of which KV head are resident, and every move between the pools.

Contract (`LayerPages`, one per layer, driven by PagedKV):
- `block [H, max_pages]`: the fast-pool block of each page, -1 when it is not resident. Pages are `page_size`
  tokens; the last one (the tail) fills during decode and is always resident.
- `ingest(k, v, prompt_mass)`: the prompt's KV ``[H, T, D]``: FULL heads all resident; TOPK heads copy every page to
  the slow pool (lossless) and keep the sink page and the `recent_pages` newest resident (the first step re-ranks);
  WINDOW heads keep the sink and newest pages; HEAVY heads the newest half of their cap and the heaviest tokens by
  `prompt_mass` ``[H, T]``; what WINDOW / HEAVY do not keep is dropped.
- `append(k, v)` writes one token ``[H, D]`` into the tail; opening a new page first evicts down to the plan's cap
  (TOPK: lowest last score; WINDOW: oldest after the sink; HEAVY: lightest outside the recent half), so resident
  blocks never exceed the budget. A TOPK page is copied to the slow pool once, when it is full.
- `select(q, step, scaling)`: rerank.select: TOPK heads score every page with the radar (radar.page_scores); a head due
  (step 0, then every `interval` steps, staggered) re-ranks: its resident set becomes the sink, the recent pages and
  the top pages by score; a head not due promotes only offloaded pages whose score beats its K-th resident page by
  `radar_margin` (at most `radar_promotions` a step, the best first), each in place of its lowest. Only pages whose
  residency changes move (`demote`, `promote`); evicted TOPK pages still have their slow copy, so eviction is
  freeing a block. Moves and the CPU time of radar and re-rank are counted in `counts`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfabric.engines.flexicache.plan import BudgetError, HeadPlan, Role
from kvfabric.engines.flexicache.pools import FastPool, SlowPool
from kvfabric.engines.flexicache.radar import ROWS, summarize, update_summary
from kvfabric.engines.flexicache.rerank import Schedule, select


@dataclass(slots=True)
class MoveCounts:
    """Mutable counters of one decode, shared by the layers."""
    promotions: int = 0
    demotions: int = 0  # TOPK pages freed from the fast pool (their slow copy stays)
    dropped: int = 0  # WINDOW / HEAVY pages evicted for good
    reranks: int = 0  # (head, step) re-ranks
    radar_hits: int = 0  # (head, step) promotions triggered by the radar between re-ranks
    stable_promotions: int = 0  # promotions into the heads the split calls stable (plan.stable)
    stable_reranks: int = 0  # (head, step) re-ranks of those heads
    radar_s: float = 0.0  # CPU time (this thread) scoring pages, detecting and moving radar hits
    rerank_s: float = 0.0  # CPU time in the due heads' re-rank: selection and moves
    stable_rerank_s: float = 0.0  # the part of rerank_s spent on the stable heads


class LayerPages:
    def __init__(self, layer: int, plan: HeadPlan, max_pages: int, head_dim: int, fast: FastPool,
                 slow: SlowPool | None, counts: MoveCounts, full_base: int = 0) -> None:
        roles = torch.from_numpy(plan.roles[layer].astype("int64"))
        num_heads = roles.numel()
        self.layer, self.plan, self.fast, self.slow, self.counts = layer, plan, fast, slow, counts
        self.page_size = plan.page_size
        self.rows = {role: (roles == role).nonzero().flatten() for role in Role}  # head ids by role
        self.block = torch.full((num_heads, max_pages), -1, dtype=torch.long)
        full = self.rows[Role.FULL]  # FULL head i owns blocks [full_base + i * max_pages, ... + max_pages)
        self.full_base, self.max_pages = full_base, max_pages
        self.full_blocks = full_base + torch.arange(full.numel())[:, None] * max_pages + torch.arange(max_pages)
        self.paged = (roles != Role.FULL).nonzero().flatten()  # every other head
        self.heavy_row = torch.full((num_heads,), -1, dtype=torch.long)  # head -> row of `mass`
        self.heavy_row[self.rows[Role.HEAVY]] = torch.arange(self.rows[Role.HEAVY].numel())
        self.num_tokens = 0
        topk = self.rows[Role.TOPK]
        self.intervals = torch.from_numpy(plan.intervals[layer].astype("int64"))[topk]
        self.phase = (layer * num_heads + topk) % self.intervals  # stagger re-ranks over steps
        self.stable = torch.from_numpy(plan.stable[layer])[topk]  # [R]: the heads the split calls stable
        self.rows_topk = topk
        self.schedule = Schedule(self.intervals, self.phase, self.stable)
        self.summary = torch.empty(topk.numel(), ROWS * head_dim, max_pages)  # radar of TOPK heads [R, 3D, pages]
        self.score = torch.zeros(topk.numel(), max_pages)  # last radar score of every page
        self.mass = torch.zeros(self.rows[Role.HEAVY].numel(), max_pages)  # HEAVY heads' accumulated attention
        self._pinned_mask = torch.zeros(0, dtype=torch.bool)
        self._query_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_pages(self) -> int:
        return -(-self.num_tokens // self.page_size)

    def cap(self, num_pages: int) -> int:
        cap = self.plan.cap(num_pages)
        if self.plan.num_paged and cap < min(num_pages, self.plan.min_cap()):
            raise BudgetError(f"kv budget {self.plan.budget:.3f} leaves {cap} pages per paged head at {num_pages} "
                              f"pages, fewer than the {self.plan.min_cap()} {self.plan.method} needs")
        return cap

    def _place(self, heads: torch.Tensor, pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Make (heads[i], pages[i]) resident with the contents k[i], v[i] ([n, P, D])."""
        blocks = self.fast.alloc(heads.numel())
        self.block[heads, pages] = blocks
        self.fast.k[blocks] = k
        self.fast.v[blocks] = v

    def _free(self, heads: torch.Tensor, pages: torch.Tensor) -> None:
        self.fast.free(self.block[heads, pages])
        self.block[heads, pages] = -1

    # ---- prompt ---------------------------------------------------------------------------------------------
    def ingest(self, k: torch.Tensor, v: torch.Tensor, prompt_mass: torch.Tensor | None = None) -> None:
        heads, num_tokens, dim = k.shape  # k / v [H, T, D]
        size = self.page_size
        num_pages = -(-num_tokens // size)
        cap = self.cap(num_pages)
        kp = torch.zeros(heads, num_pages * size, dim)
        vp = torch.zeros(heads, num_pages * size, dim)
        kp[:, :num_tokens], vp[:, :num_tokens] = k, v
        kp, vp = kp.view(heads, num_pages, size, dim), vp.view(heads, num_pages, size, dim)
        self.num_tokens = num_tokens
        every = torch.arange(num_pages)
        full = self.rows[Role.FULL]
        if full.numel():
            blocks = self.full_blocks[:, :num_pages]
            self.block[full, :num_pages] = blocks
            self.fast.k[blocks] = kp[full]
            self.fast.v[blocks] = vp[full]
            self.fast.claim(blocks.numel())
        keep: dict[int, torch.Tensor] = {}
        topk = self.rows[Role.TOPK]
        if topk.numel():
            grid_h, grid_p = topk.repeat_interleave(num_pages), every.repeat(topk.numel())
            self.slow.write(self.layer, grid_h, grid_p, kp[grid_h, grid_p], vp[grid_h, grid_p])
            self.summary[:, :, :num_pages] = summarize(k[topk], num_tokens, size)
            keep[Role.TOPK] = self.pinned(num_pages).nonzero().flatten()
        keep[Role.WINDOW] = torch.cat([every[:1], every[max(1, num_pages - cap + 1):]])
        for role in (Role.TOPK, Role.WINDOW):
            rows = self.rows[role]
            if rows.numel() and role in keep:
                grid_h, grid_p = rows.repeat_interleave(keep[role].numel()), keep[role].repeat(rows.numel())
                self._place(grid_h, grid_p, kp[grid_h, grid_p], vp[grid_h, grid_p])
        heavy = self.rows[Role.HEAVY]
        if heavy.numel():  # one-token pages: the newest cap // 2, then the heaviest of the rest
            recent = cap // 2
            self.mass[:, :num_tokens] = prompt_mass[heavy] if prompt_mass is not None else 0.0
            older = self.mass[:, :num_tokens - recent].clone()
            picks = torch.topk(older, cap - recent, dim=1).indices  # [R, cap - recent]
            pages = torch.cat([picks, every[num_tokens - recent:].expand(heavy.numel(), recent)], dim=1)
            grid_h = heavy.repeat_interleave(cap)
            self._place(grid_h, pages.flatten(), kp[grid_h, pages.flatten()], vp[grid_h, pages.flatten()])
        lossy = torch.cat([self.rows[Role.WINDOW], heavy])
        self.counts.dropped += int((self.block[lossy, :num_pages] < 0).sum())

    def full_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FULL heads' K and V in place: [F, num_tokens, D] views of their contiguous block ranges."""
        start, count = self.full_base, self.rows[Role.FULL].numel() * self.max_pages
        shape = (self.rows[Role.FULL].numel(), self.max_pages * self.page_size, -1)
        k = self.fast.k[start:start + count].view(shape)[:, :self.num_tokens]
        return k, self.fast.v[start:start + count].view(shape)[:, :self.num_tokens]

    def query_rows(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The query heads (G per KV head) of the FULL heads and of the others, in head order (cached)."""
        if self._query_rows is None:
            self._query_rows = tuple((heads[:, None] * group + torch.arange(group)).flatten()
                                     for heads in (self.rows[Role.FULL], self.paged))
        return self._query_rows

    def all_resident(self) -> bool:
        num_pages = self.num_pages
        if self.paged.numel() and self.plan.cap(num_pages) < num_pages:  # the budget alone says no (no scan)
            return False
        return bool((self.block[:, :num_pages] >= 0).all())

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's K and V gathered in position order: [H, num_tokens, D] (all pages must be resident)."""
        heads, dim = self.block.shape[0], self.fast.k.shape[-1]
        blocks = self.block[:, :self.num_pages].flatten()
        k = self.fast.k.index_select(0, blocks).view(heads, -1, dim)[:, :self.num_tokens]
        return k, self.fast.v.index_select(0, blocks).view(heads, -1, dim)[:, :self.num_tokens]

    def pinned(self, num_pages: int) -> torch.Tensor:
        """bool [num_pages]: the sink page and the recent_pages newest (resident in every TOPK head). Cached: it
        changes once per page."""
        if self._pinned_mask.numel() != num_pages:
            pinned = torch.zeros(num_pages, dtype=torch.bool)
            pinned[0] = True
            pinned[max(0, num_pages - self.plan.recent_pages):] = True
            self._pinned_mask = pinned
        return self._pinned_mask

    # ---- decode ---------------------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One new token's K / V [H, D] at position num_tokens."""
        page, slot = divmod(self.num_tokens, self.page_size)
        if slot == 0:
            self._open(page)
        blocks = self.block[:, page]
        self.fast.k[blocks, slot] = k
        self.fast.v[blocks, slot] = v
        self.num_tokens += 1
        topk = self.rows[Role.TOPK]
        if topk.numel():
            update_summary(self.summary[:, :, page], k[topk], slot)
            if slot == self.page_size - 1:  # full: its one copy to the slow pool
                tail = blocks[topk]
                self.slow.write(self.layer, topk, torch.full_like(topk, page), self.fast.k[tail], self.fast.v[tail])

    def _open(self, page: int) -> None:
        """Evict down to cap - 1 pages in every non-FULL head, then give every head a block for `page`."""
        num_pages = page + 1
        cap = self.cap(num_pages)
        pos = torch.arange(page)
        topk, window, heavy = self.rows[Role.TOPK], self.rows[Role.WINDOW], self.rows[Role.HEAVY]
        if topk.numel():
            evictable = ~self.pinned(num_pages)[:page] & (self.block[topk, :page] >= 0)
            self._evict(topk, evictable, self.score[:, :page], cap - 1)
        if window.numel():
            old = (pos >= 1) & (pos < num_pages - cap + 1)
            self._evict(window, old.expand(window.numel(), page) & (self.block[window, :page] >= 0), None, 0)
        if heavy.numel():
            evictable = (pos < num_pages - cap // 2).expand(heavy.numel(), page) & (self.block[heavy, :page] >= 0)
            self._evict(heavy, evictable, self.mass[:, :page], cap - 1)
        full = self.rows[Role.FULL]
        if full.numel():
            self.block[full, page] = self.full_blocks[:, page]
            self.fast.claim(full.numel())
        self.block[self.paged, page] = self.fast.alloc(self.paged.numel())

    def _evict(self, rows: torch.Tensor, evictable: torch.Tensor, score: torch.Tensor | None, keep: int) -> None:
        """Free evictable pages of `rows` until each holds at most `keep` pages; lowest `score` first (None: all
        evictable pages go)."""
        if score is None:
            chosen = evictable
        else:
            count = (self.block[rows] >= 0).sum(1)  # [R] resident pages now
            excess = (count - keep).clamp(min=0)
            if not bool(excess.any()):
                return
            ranked = torch.where(evictable, score, float("inf"))
            order = torch.topk(ranked, int(excess.max()), dim=1, largest=False).indices  # [R, e]
            take = torch.arange(order.shape[1])[None, :] < excess[:, None]
            chosen = torch.zeros_like(evictable).scatter_(1, order, take) & evictable
        r, p = chosen.nonzero(as_tuple=True)
        if r.numel():
            self._free(rows[r], p)
            if rows is self.rows[Role.TOPK]:  # the slow copy stays: a demotion
                self.counts.demotions += r.numel()
            else:
                self.counts.dropped += r.numel()

    def select(self, q: torch.Tensor, step: int, scaling: float) -> None:
        """q [H, G, D] (this step's queries by KV head): radar for every TOPK head, re-rank the due ones, move
        (rerank.select). Bounds are in logits (q.k * scaling), so `radar_margin` is in nats."""
        if self.rows_topk.numel():
            select(self, q, step, scaling)

    def demote(self, r: torch.Tensor, p: torch.Tensor) -> None:
        """Free the blocks of TOPK rows r (indices into rows[TOPK]), pages p: their slow copy stays."""
        self._free(self.rows_topk[r], p)
        self.counts.demotions += r.numel()

    def promote(self, r: torch.Tensor, p: torch.Tensor) -> None:
        """Copy pages p of TOPK rows r back from the slow pool into fresh blocks."""
        heads = self.rows_topk[r]
        blocks = self.fast.alloc(r.numel())
        self.block[heads, p] = blocks
        self.slow.read(self.layer, heads, p, self.fast, blocks)
        self.counts.promotions += r.numel()
        self.counts.stable_promotions += int(self.stable[r].sum())
