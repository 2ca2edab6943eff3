"""A fast pure simulator of cache tiers over a request trace (bookkeeping only, no data), and the TTFT model.

Per request, as kvfabric serves it: look up the prompt's blocks in order and stop at the first block that no
tier holds (the prefix hit); serve the hit blocks (touching them where they are served from; a hit below the
fast tier is promoted on its k-th hit); recompute the rest and store every recomputed block. One tier: the
fast tier alone. Two tiers: the fast tier over a slow (disk) tier, either write-through (every store goes to
both, today's TierStack) or exclusive (stores go to the fast tier, its victims are demoted to the slow tier, a
promoted block leaves the slow tier). Blocks have unit size: capacities are counted in blocks.

Metrics: prefix hit tokens / prompt tokens (what a prefix cache can use) and block hits / block accesses (the
metric of the table in issue 16). The TTFT model turns each request's hits and misses into seconds.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfabric.bench.trace_data import Trace
from kvfabric.tiers.policies import AccessMeta, PolicyIndex


@dataclass(frozen=True, slots=True)
class TTFTModel:
    """Modelled time to first token of one request: bytes loaded from each tier at that tier's throughput,
    plus the prefill of the missing tokens at a rate that falls with the context (attention).

    TODO(phase 2, issue 16): measure all of these in the same run: `bench tiers` throughputs of the real cpu and
    disk tiers, and the real model's prefill rate at several context lengths (fit `prefill_tokens_per_s` and
    `prefill_halving_tokens`). The defaults are placeholders of the right order for SmolLM2-135M on this CPU.
    """

    bytes_per_token: int = 23040  # SmolLM2-135M fp16 KV: 30 layers x (K, V) x 3 kv heads x 64 dims x 2 bytes
    fast_bytes_per_s: float = 5e9
    slow_bytes_per_s: float = 1e9
    prefill_tokens_per_s: float = 2000.0  # at an empty context
    prefill_halving_tokens: float = 8192.0  # the per-token cost doubles at this context length

    def prefill_s(self, start: int, end: int) -> float:
        """Prefill of tokens [start, end): per-token cost (1 + context / halving) / rate, integrated."""
        if end <= start:
            return 0.0
        quadratic = (end * end - start * start) / (2.0 * self.prefill_halving_tokens)
        return ((end - start) + quadratic) / self.prefill_tokens_per_s

    def ttft_s(self, prompt_tokens: int, fast_tokens: int, slow_tokens: int) -> float:
        hit = fast_tokens + slow_tokens
        load = self.bytes_per_token * (fast_tokens / self.fast_bytes_per_s + slow_tokens / self.slow_bytes_per_s)
        # At least the last token is computed even when the whole prompt hits.
        return load + self.prefill_s(min(hit, prompt_tokens - 1), prompt_tokens)


@dataclass(frozen=True, slots=True)
class TierConfig:
    """How two tiers cooperate. `mode`: "write-through" (today) or "exclusive" (demote on evict);
    `promote_after`: a block served from the slow tier moves up on its k-th slow hit."""

    mode: str = "write-through"
    promote_after: int = 1


@dataclass(frozen=True, slots=True)
class SimResult:
    trace: str
    policy: str
    tiers: int
    capacity_frac: float
    capacity_blocks: int
    num_requests: int
    prompt_tokens: int
    prefix_hit_tokens: int
    slow_hit_tokens: int  # of the prefix hit tokens, those served by the slow tier
    num_accesses: int
    block_hits: int
    blocks_moved: int  # promotions + demotions between the tiers
    num_evicted: tuple[int, ...]  # per tier
    num_refused: tuple[int, ...]  # admissions refused, per tier
    ttft_mean_s: float
    ttft_p99_s: float
    ns_per_access: float  # wall time of the index and policy calls (stores and hits) per block access

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.num_accesses


def request_metas(trace: Trace, model: TTFTModel) -> list[list[AccessMeta]]:
    """Per request, per block: position, prompt length in blocks, tokens, and the prefill time of a miss."""
    size = trace.block_tokens
    metas = []
    for request in trace.requests:
        num = len(request.hash_ids)
        row = []
        for i in range(num):
            tokens = request.block_tokens(i, size)
            row.append(AccessMeta(i, num, tokens, model.prefill_s(i * size, i * size + tokens)))
        metas.append(row)
    return metas


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


IndexFactory = Callable[[int], PolicyIndex]  # capacity in blocks -> a fresh index


def simulate_one_tier(trace: Trace, make_index: IndexFactory, capacity_frac: float, policy: str,
                      model: TTFTModel = TTFTModel(), metas: list[list[AccessMeta]] | None = None,
                      on_request: Callable[[int], None] | None = None) -> SimResult:
    """One tier of `capacity_frac` x the trace's distinct blocks. `on_request(i)` runs before request i (an
    offline policy's clock)."""
    capacity = max(1, int(capacity_frac * trace.num_distinct_blocks))
    index = make_index(capacity)
    metas = metas or request_metas(trace, model)
    size = trace.block_tokens
    hit_tokens = block_hits = 0
    ttfts = []
    policy_s = 0.0
    for r, request in enumerate(trace.requests):
        if on_request is not None:
            on_request(r)
        blocks = request.hash_ids
        present = [block in index for block in blocks]
        prefix = present.index(False) if False in present else len(blocks)
        tokens = min(prefix * size, request.input_length)
        hit_tokens += tokens
        block_hits += sum(present)
        ttfts.append(model.ttft_s(request.input_length, tokens, 0))
        start = time.process_time()
        for block, meta, is_present in zip(blocks, metas[r], present):
            if not (is_present and index.touch(block, meta)):
                index.add(block, 1, meta)
        policy_s += time.process_time() - start
    stats = index.stats()
    return SimResult(trace.name, policy, 1, capacity_frac, capacity, len(trace.requests),
                     sum(r.input_length for r in trace.requests), hit_tokens, 0, trace.num_accesses, block_hits,
                     0, (stats.num_evicted,), (stats.num_refused,), sum(ttfts) / len(ttfts), _p99(ttfts),
                     1e9 * policy_s / trace.num_accesses)


def simulate_two_tiers(trace: Trace, make_fast: IndexFactory, make_slow: IndexFactory, capacity_frac: float,
                       policy: str, config: TierConfig = TierConfig(), model: TTFTModel = TTFTModel(),
                       metas: list[list[AccessMeta]] | None = None, slow_mult: int = 10,
                       on_request: Callable[[int], None] | None = None) -> SimResult:
    """A fast tier of `capacity_frac` x the distinct blocks over a slow tier `slow_mult` times larger."""
    if config.mode not in ("write-through", "exclusive") or config.promote_after < 1:
        raise ValueError(f"bad tier config {config}")
    is_exclusive = config.mode == "exclusive"
    capacity = max(1, int(capacity_frac * trace.num_distinct_blocks))
    fast, slow = make_fast(capacity), make_slow(slow_mult * capacity)
    metas = metas or request_metas(trace, model)
    # A block the fast tier drops is one slow read away (write-through: the slow tier has it; exclusive: it is
    # demoted there), so the fast tier's miss cost is the slow load, not the prefill.
    fast_metas = [[_load_meta(meta, model) for meta in row] for row in metas]
    size = trace.block_tokens
    slow_hits: dict[int, int] = {}  # slow-tier hits of a block since it last reached the slow tier
    last_meta: dict[int, AccessMeta] = {}  # for demotions, which happen outside the block's own access
    hit_tokens = slow_tokens = block_hits = moved = 0
    ttfts = []
    policy_s = 0.0

    num_demoted = [0]

    def demote(victim: int) -> None:  # exclusive: the fast tier's victims go one tier down
        num_demoted[0] += slow.add(victim, 1, last_meta[victim])

    if is_exclusive:
        fast.on_evict = demote  # write-through: the slow tier already has its copy (or evicted it on its own)

    for r, request in enumerate(trace.requests):
        if on_request is not None:
            on_request(r)
        blocks = request.hash_ids
        in_fast = [block in fast for block in blocks]
        in_slow = [block in slow for block in blocks]
        prefix = next((i for i, (f, s) in enumerate(zip(in_fast, in_slow)) if not (f or s)), len(blocks))
        fast_tok = sum(request.block_tokens(i, size) for i in range(prefix) if in_fast[i])
        slow_tok = sum(request.block_tokens(i, size) for i in range(prefix) if not in_fast[i])
        hit_tokens += fast_tok + slow_tok
        slow_tokens += slow_tok
        block_hits += sum(f or s for f, s in zip(in_fast, in_slow))
        ttfts.append(model.ttft_s(request.input_length, fast_tok, slow_tok))
        start = time.process_time()
        for i, (block, meta, fast_meta) in enumerate(zip(blocks, metas[r], fast_metas[r])):
            last_meta[block] = meta
            if in_fast[i]:
                fast.touch(block, fast_meta)
            elif i < prefix:  # served by the slow tier
                slow.touch(block, meta)
                count = slow_hits.get(block, 0) + 1
                slow_hits[block] = count
                if count >= config.promote_after and fast.add(block, 1, fast_meta):
                    moved += 1
                    slow_hits.pop(block, None)
                    if is_exclusive:
                        slow.remove(block)
            elif is_exclusive:  # recomputed: into the fast tier, its victims down to the slow tier
                is_admitted = fast.add(block, 1, fast_meta)
                if not is_admitted and not in_slow[i]:
                    slow.add(block, 1, meta)  # refused above: place it one tier down
                elif is_admitted and in_slow[i]:
                    slow.remove(block)
            else:  # write-through: every tier
                fast.add(block, 1, fast_meta)
                if not (in_slow[i] and slow.touch(block, meta)):
                    slow.add(block, 1, meta)
                    slow_hits.pop(block, None)
        policy_s += time.process_time() - start
    fs, ss = fast.stats(), slow.stats()
    return SimResult(trace.name, policy, 2, capacity_frac, capacity, len(trace.requests),
                     sum(r.input_length for r in trace.requests), hit_tokens, slow_tokens, trace.num_accesses,
                     block_hits, moved + num_demoted[0], (fs.num_evicted, ss.num_evicted),
                     (fs.num_refused, ss.num_refused), sum(ttfts) / len(ttfts), _p99(ttfts), 1e9 * policy_s / trace.num_accesses)


def _load_meta(meta: AccessMeta, model: TTFTModel) -> AccessMeta:
    """The meta of a block that the slow tier holds: a fast-tier miss costs a slow load, not a prefill."""
    cost = meta.num_tokens * model.bytes_per_token / model.slow_bytes_per_s
    return AccessMeta(meta.position, meta.num_chunks, meta.num_tokens, min(cost, meta.miss_cost_s))
