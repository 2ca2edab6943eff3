"""FlexiCache (engines.flexicache): pools, radar, plans, paged decode KV on synthetic tensors; the real model in
the slow tests at the end."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import xxhash
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvfabric.config import Config, ConfigError, FlexiCacheConfig
from kvfabric.engines.flexicache import BudgetError, HeadTable, HeadTableError, PagedKV, load_table
from kvfabric.engines.flexicache.heads import read_table, save_table
from kvfabric.engines.flexicache.plan import Role
from kvfabric.engines.flexicache.pools import FastPool, PoolFull, SlowPool
from kvfabric.engines.flexicache.radar import page_bounds, page_scores, summarize, update_summary
from kvfabric.research.flexicache_baselines import make_plan  # the runtime's methods and the baselines


@dataclasses.dataclass
class Module:  # what the attention hook reads of a transformers attention module
    layer_idx: int
    num_key_value_groups: int
    is_causal: bool = True


def table(num_layers: int, heads: int, unstable: list[tuple[int, int]] = ()) -> HeadTable:
    stability = np.ones((num_layers, heads), np.float32)
    for layer, head in unstable:
        stability[layer, head] = 0.1
    return HeadTable("test", stability, threshold=0.5)


class Decoder:
    """Drives a PagedKV like a model would: per step and layer, append the token's K/V, then attend."""

    def __init__(self, method: str, budget: float, kv: torch.Tensor, num_tokens: int, steps: int, group: int = 2,
                 heads_table: HeadTable | None = None, **config: object) -> None:
        self.L, _, self.H, _, self.D = kv.shape
        self.group = group
        cfg = FlexiCacheConfig(**config)
        plan = make_plan(method, budget, self.L, self.H, cfg, heads_table or table(self.L, self.H))
        self.paged = PagedKV(plan, self.L, self.H, self.D, num_tokens + steps, cfg.slow_pool)
        self.kv = kv  # [L, 2, H, T, D]: the prompt, then every token this decoder appends
        self.num_tokens = num_tokens
        self.paged.ingest(kv, num_tokens)

    def step(self, queries: torch.Tensor) -> torch.Tensor:
        """queries [L, Hq, D]; appends kv[..., num_tokens, :]; returns outputs [L, Hq, D]."""
        outs = []
        for layer in range(self.L):
            k = self.kv[layer, 0, :, self.num_tokens][None, :, None]  # [1, H, 1, D]
            v = self.kv[layer, 1, :, self.num_tokens][None, :, None]
            self.paged.layers[layer].update(k, v)
            out = self.paged.attend(Module(layer, self.group), queries[layer][None, :, None], k, v, 0.125)
            outs.append(out[0, 0])
        self.num_tokens += 1
        return torch.stack(outs)

    def dense(self, queries: torch.Tensor) -> torch.Tensor:
        """What dense KV gives for the last step (all tokens so far)."""
        n = self.num_tokens
        return torch.stack([sdpa_attention_forward(Module(layer, self.group), queries[layer][None, :, None],
                                                   self.kv[layer, 0, :, :n][None], self.kv[layer, 1, :, :n][None],
                                                   None, scaling=0.125)[0][0, 0] for layer in range(self.L)])


def random_kv(num_layers=2, heads=3, tokens=200, dim=16, seed=0) -> torch.Tensor:
    return torch.randn(num_layers, 2, heads, tokens, dim, generator=torch.Generator().manual_seed(seed))


# ---- pools -------------------------------------------------------------------------------------------------
def test_fast_pool_reuses_freed_blocks_and_refuses_overflow():
    pool = FastPool(8, 4, 2, reserved=2)
    storage = pool.k.data_ptr()
    a = pool.alloc(6)
    assert sorted(a.tolist()) == [2, 3, 4, 5, 6, 7] and pool.used == 6
    with pytest.raises(PoolFull):
        pool.alloc(1)
    pool.free(a[:3])
    b = pool.alloc(3)
    assert sorted(b.tolist()) == sorted(a[:3].tolist())  # the same blocks again, no new storage
    assert pool.k.data_ptr() == storage
    pool.claim(2)
    assert pool.used == 8 and pool.peak == 8
    with pytest.raises(PoolFull):
        pool.claim(1)


@pytest.mark.parametrize("kind", ["memory", "shm"])
def test_slow_pool_round_trip_is_exact_and_counted(kind):
    slow = SlowPool(2, 3, 5, 4, 8, kind)
    fast = FastPool(4, 4, 8)
    k, v = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    heads, pages = torch.tensor([0, 2]), torch.tensor([4, 1])
    slow.write(1, heads, pages, k, v)
    blocks = fast.alloc(2)
    slow.read(1, heads, pages, fast, blocks)
    assert torch.equal(fast.k[blocks], k) and torch.equal(fast.v[blocks], v)
    assert slow.transfers.to_slow_bytes == slow.transfers.to_fast_bytes == 2 * 2 * 4 * 8 * 4
    slow.close()


# ---- radar -------------------------------------------------------------------------------------------------
def test_page_bound_is_an_upper_bound_of_every_logit_in_the_page():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(3, 37, 16, generator=gen)  # [H, T, D], the last page partial
    summary = summarize(keys, 37, 8)  # [H, 3D, pages]
    q = torch.randn(3, 2, 16, generator=gen)  # [H, G, D]
    bounds = page_bounds(q, summary)  # [H, pages]
    logits = torch.einsum("hgd,htd->hgt", q, keys).amax(1)  # [H, T]: best over the group
    for page in range(bounds.shape[1]):
        best = logits[:, page * 8:(page + 1) * 8].amax(1)
        assert torch.all(bounds[:, page] >= best - 1e-5)


def test_summaries_built_at_once_and_key_by_key_agree_and_hold_each_pages_mean():
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 21, 4, generator=gen)  # [H, T, D]: pages of 8, the tail holds 5 keys
    summary = summarize(keys, 21, 8)  # [H, 3D, 3]
    running = torch.empty(2, 12, 3)
    for t in range(21):
        update_summary(running[:, :, t // 8], keys[:, t], t % 8)
    assert torch.allclose(running, summary, atol=1e-6)
    for page, (lo, hi) in enumerate([(0, 8), (8, 16), (16, 21)]):
        chunk = keys[:, lo:hi]
        assert torch.equal(summary[:, :4, page], chunk.amax(1)) and torch.equal(summary[:, 4:8, page], chunk.amin(1))
        assert torch.allclose(summary[:, 8:, page], chunk.mean(1), atol=1e-6)  # the tail's repeats left out


def test_mid_score_is_the_groups_logsumexp_of_bound_and_centroid_midpoints():
    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(3, 32, 8, generator=gen)
    summary = summarize(keys, 32, 8)
    q = torch.randn(3, 2, 8, generator=gen)  # [H, G, D]
    per_head_bound = torch.einsum("hgd,hdn->hgn", q.clamp(min=0), summary[:, :8]) + \
        torch.einsum("hgd,hdn->hgn", q.clamp(max=0), summary[:, 8:16])
    centroid = torch.einsum("hgd,hdn->hgn", q, summary[:, 16:])
    assert torch.allclose(page_scores(q, summary), ((per_head_bound + centroid) / 2).logsumexp(1), atol=1e-5)
    assert torch.equal(page_scores(q, summary, "bound"), page_bounds(q, summary))
    # one key far out in q's direction tops the bound, a page of many good keys the mid score
    q1 = torch.zeros(1, 1, 8)
    q1[0, 0, 0] = 1.0
    pages = torch.zeros(1, 16, 8)
    pages[0, :8, 0] = torch.tensor([4.0, -3, -3, -3, -3, -3, -3, -3])  # page 0: one outlier
    pages[0, 8:, 0] = 2.0  # page 1: eight keys at 2
    two = summarize(pages, 16, 8)
    assert page_scores(q1, two, "bound").argmax() == 0 and page_scores(q1, two).argmax() == 1


# ---- plans -------------------------------------------------------------------------------------------------
def test_plans_split_the_budget_as_documented():
    cfg = FlexiCacheConfig(max_full_share=0.9, rerank_interval=16, head_order="stability")
    heads = table(4, 3, unstable=[(0, 0), (1, 1), (3, 2)])
    plan = make_plan("flexicache", 0.5, 4, 3, cfg, heads)
    assert plan.num_full == 3 and plan.roles[0, 0] == Role.FULL and plan.roles[3, 2] == Role.FULL
    assert (plan.intervals[plan.roles == Role.TOPK] == 16).all()
    assert plan.budget_blocks(10) == 60 and plan.cap(10) == (60 - 30) // 9
    small = make_plan("flexicache", 0.1, 4, 3, cfg, heads)  # 0.9 * 0.1 * 12 = 1 head fits whole
    assert small.num_full == 1 and int((small.intervals == 1).sum()) == 2  # the other unstable: every step
    assert (small.stable == ((small.roles == Role.TOPK) & (small.intervals == 16))).all()
    leaky = dataclasses.replace(heads, miss=np.where(np.arange(12).reshape(4, 3) == 7, 0.95, 0.0).astype(np.float32))
    by_retention = make_plan("flexicache", 0.1, 4, 3, dataclasses.replace(cfg, head_order="retention"), leaky)
    assert by_retention.roles[2, 1] == Role.FULL  # leaks 95 % of its attention: kept whole first
    with pytest.raises(BudgetError):
        make_plan("flexicache", 0.0, 4, 3, cfg, heads)
    with pytest.raises(ValueError):
        make_plan("flexicache", 0.3, 4, 3, cfg)  # no head table


def test_config_section_is_typed_and_validated():
    cfg = Config.from_dict({"flexicache": {"kv_budget": "0.3", "rerank_interval": "8", "slow_pool": "shm"}})
    assert cfg.flexicache.kv_budget == 0.3 and cfg.flexicache.rerank_interval == 8
    for bad in ({"kv_budget": 1.5}, {"page_size": 0}, {"slow_pool": "disk"}, {"max_full_share": 0},
                {"radar_margin": -1}, {"radar_score": "max"}, {"pages": 3}):
        with pytest.raises(ConfigError):
            Config.from_dict({"flexicache": bad})
    env = Config.load(environ={"KVFABRIC_FLEXICACHE__KV_BUDGET": "0.25"})
    assert env.flexicache.kv_budget == 0.25


def test_head_table_round_trip_and_errors(tmp_path):
    heads = HeadTable("m", np.random.default_rng(0).random((4, 3)).astype(np.float32), 0.4,
                      kinds={"a": np.zeros((4, 3), np.float32), "b": np.ones((4, 3), np.float32)},
                      miss=np.full((4, 3), 0.25, np.float32), meta={"lag": 16})
    path = tmp_path / "t.npz"
    save_table(heads, path)
    back = read_table(path)
    assert back.model_id == "m" and back.threshold == 0.4 and back.meta["lag"] == 16
    assert np.array_equal(back.stability, heads.stability) and set(back.kinds) == {"a", "b"}
    assert np.array_equal(back.miss, heads.miss)
    assert np.allclose(back.retention(), 0.75 * heads.stability)
    assert load_table("m", 4, 3, path).shape == (4, 3)
    with pytest.raises(HeadTableError):
        load_table("m", 5, 3, path)
    with pytest.raises(HeadTableError):
        load_table("no-such-model", 4, 3)
    (tmp_path / "bad.npz").write_bytes(b"not a table")
    with pytest.raises(HeadTableError):
        read_table(tmp_path / "bad.npz")


# ---- paged decode ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["flexicache", "quest", "full", "streaming", "h2o", "shuffled"])
def test_full_budget_is_dense_kv_bit_for_bit(method):
    kv = random_kv(tokens=120)
    heads = table(2, 3, unstable=[(1, 2)])
    dec = Decoder(method, 1.0, kv, 90, 30, heads_table=heads, page_size=8)
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):  # crosses page boundaries (90 = 11 pages + 2 tokens)
        q = torch.randn(2, 6, 16, generator=gen)
        assert torch.equal(dec.step(q), dec.dense(q))


def test_partial_budget_attention_is_exact_over_the_resident_pages():
    kv = random_kv(tokens=160)
    dec = Decoder("quest", 0.4, kv, 128, 8, page_size=8)
    q = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2))
    out = dec.step(q)
    for layer in range(2):
        pages = dec.paged.pages[layer]
        for head in range(3):
            resident = (pages.block[head, :pages.num_pages] >= 0).nonzero().flatten()
            tokens = torch.cat([torch.arange(p * 8, min(p * 8 + 8, dec.num_tokens)) for p in resident.tolist()])
            k, v = kv[layer, 0, head, tokens], kv[layer, 1, head, tokens]
            for g in range(2):
                probs = torch.softmax(k @ q[layer, head * 2 + g] * 0.125, 0)
                assert torch.allclose(out[layer, head * 2 + g], probs @ v, atol=1e-6)


@pytest.mark.parametrize("method", ["flexicache", "quest", "streaming", "h2o", "shuffled"])
@pytest.mark.parametrize("budget", [0.2, 0.35])
def test_resident_bytes_never_exceed_the_budget(method, budget):
    kv = random_kv(tokens=260)
    heads = table(2, 3, unstable=[(0, 1)])
    dec = Decoder(method, budget, kv, 200, 60, heads_table=heads, page_size=4, recent_pages=1,
                  max_full_share=0.5)
    gen = torch.Generator().manual_seed(7)
    for _ in range(60):  # random queries: the worst churn; PagedKV raises BudgetError past the budget
        dec.step(torch.randn(2, 6, 16, generator=gen) * 3)
    paged = dec.paged
    page_size = paged.plan.page_size
    for used, full in zip(paged._resident, paged._full):
        assert used <= paged.plan.budget_blocks(full // 6)
    stats = paged.stats()
    assert stats.resident_bytes_peak <= budget * stats.full_kv_bytes + 1e-9
    assert stats.resident_frac <= budget + 1e-9 and stats.steps == 60
    if method in ("streaming", "h2o"):
        assert stats.promotions == 0 and stats.dropped > 0
    else:
        assert stats.dropped == 0 and stats.promotions > 0
    assert page_size == (1 if method == "h2o" else 4)


def test_offloaded_and_promoted_pages_hold_their_original_values():
    kv = random_kv(num_layers=1, tokens=300)
    dec = Decoder("quest", 0.25, kv, 256, 40, page_size=8, recent_pages=1)
    gen = torch.Generator().manual_seed(11)
    original = {}  # (head, page) -> checksum of the page's K and V as first written
    for head in range(3):
        for page in range(296 // 8):
            k, v = kv[0, 0, head, page * 8:page * 8 + 8], kv[0, 1, head, page * 8:page * 8 + 8]
            original[head, page] = xxhash.xxh3_64_hexdigest(k.numpy().tobytes() + v.numpy().tobytes())
    promoted_once = set()
    for _ in range(40):
        dec.step(torch.randn(1, 6, 16, generator=gen) * 4)
        pages = dec.paged.pages[0]
        full_pages = pages.num_tokens // 8
        for head in range(3):
            for page in (pages.block[head, :full_pages] >= 0).nonzero().flatten().tolist():
                block = pages.block[head, page]
                got = xxhash.xxh3_64_hexdigest(dec.paged.fast.k[block].numpy().tobytes()
                                               + dec.paged.fast.v[block].numpy().tobytes())
                assert got == original[head, page], (head, page)
                promoted_once.add((head, page))
    assert dec.paged.stats().promotions > 100 and len(promoted_once) > 60  # many pages went out and came back


def test_radar_promotes_the_page_whose_score_beats_the_resident_kth():
    dim, size = 16, 4
    kv = torch.randn(1, 2, 1, 80, dim, generator=torch.Generator().manual_seed(3)) * 0.1
    kv[0, 0, 0, :, 0] = -1.0  # every key points away from e0 ...
    target = 9
    kv[0, 0, 0, target * size:(target + 1) * size, 0] = 3.0  # ... except page 9's
    dec = Decoder("flexicache", 0.5, kv, 64, 4, group=2, heads_table=table(1, 1), page_size=size, recent_pages=1,
                  rerank_interval=16)
    e0 = torch.zeros(1, 2, dim)
    dec.step(-e0 - torch.nn.functional.one_hot(torch.tensor(0), dim))  # step 0 (a re-rank): query -e0
    pages = dec.paged.pages[0]
    assert pages.block[0, target] < 0  # page 9 scores lowest: offloaded
    resident_before = set((pages.block[0, :pages.num_pages] >= 0).nonzero().flatten().tolist())
    counts = dataclasses.replace(dec.paged.counts)
    dec.step(e0 + torch.nn.functional.one_hot(torch.tensor(0), dim) * 1.0)  # step 1: not a re-rank step; query +e0
    after = set((pages.block[0, :pages.num_pages] >= 0).nonzero().flatten().tolist())
    assert dec.paged.counts.reranks == counts.reranks  # no re-rank ran
    assert dec.paged.counts.radar_hits == counts.radar_hits + 1
    assert target in after and after - resident_before == {target}  # exactly the right page came in
    block = pages.block[0, target]
    assert torch.equal(dec.paged.fast.k[block], kv[0, 0, 0, target * size:(target + 1) * size])


@pytest.mark.parametrize("promotions", [1, 2, 3])
def test_radar_promotes_at_most_radar_promotions_pages_a_step_the_best_first(promotions):
    dim, size = 16, 4
    kv = torch.randn(1, 2, 1, 80, dim, generator=torch.Generator().manual_seed(3)) * 0.1
    kv[0, 0, 0, :, 0] = -1.0
    targets = {9: 3.0, 11: 2.5}  # two pages that turn important at step 1, page 9 the more
    for page, value in targets.items():
        kv[0, 0, 0, page * size:(page + 1) * size, 0] = value
    dec = Decoder("flexicache", 0.5, kv, 64, 4, group=2, heads_table=table(1, 1), page_size=size, recent_pages=1,
                  rerank_interval=16, radar_promotions=promotions)
    e0 = torch.nn.functional.one_hot(torch.tensor(0), dim).expand(1, 2, dim).float()
    dec.step(-2 * e0)  # step 0 re-ranks: both targets score lowest and go out
    pages = dec.paged.pages[0]
    before = set((pages.block[0, :pages.num_pages] >= 0).nonzero().flatten().tolist())
    assert not before & set(targets)
    dec.step(2 * e0)  # step 1: the radar alone
    after = set((pages.block[0, :pages.num_pages] >= 0).nonzero().flatten().tolist())
    assert after - before == ({9} if promotions == 1 else set(targets))  # only pages that beat a resident one
    assert len(after) == len(before)  # each promotion replaced a resident page


def test_stable_heads_re_rank_and_move_only_at_their_interval():
    """The same decode with stable heads re-ranked every 16 steps and every step: the stable heads' re-ranks
    (and so their promotions) drop to about 1 in 16; the unstable head re-ranks every step in both."""
    kv = random_kv(num_layers=1, heads=3, tokens=260, dim=16, seed=5)
    queries = torch.randn(64, 1, 6, 16, generator=torch.Generator().manual_seed(6))
    counts = {}
    for interval in (1, 16):
        dec = Decoder("flexicache", 0.4, kv, 196, 64, heads_table=table(1, 3, unstable=[(0, 0)]), page_size=8,
                      max_full_share=0.01, rerank_interval=interval, radar_promotions=1)
        for q in queries:
            dec.step(q)
        assert dec.paged.plan.stable[0].tolist() == [False, True, True]
        counts[interval] = dec.paged.counts
    assert counts[1].stable_reranks == 2 * 64
    assert counts[16].stable_reranks == 2 * (1 + 4)  # step 0, then every 16th step per head (staggered)
    assert counts[16].reranks - counts[16].stable_reranks == counts[1].reranks - counts[1].stable_reranks == 64
    assert counts[16].stable_promotions < 0.5 * counts[1].stable_promotions
    assert counts[16].stable_rerank_s < counts[1].stable_rerank_s  # CPU time: only due heads select


def test_a_layer_of_whole_heads_next_to_paged_ones_attends_densely():
    """Layer 0's heads are all kept whole while layer 1's are paged: layer 0 stays dense KV's result exactly."""
    kv = random_kv(num_layers=2, heads=3, tokens=200, seed=7)
    dec = Decoder("flexicache", 0.6, kv, 160, 4, page_size=8, max_full_share=1.0,
                  heads_table=table(2, 3, unstable=[(0, 0), (0, 1), (0, 2)]))
    assert (dec.paged.plan.roles[0] == Role.FULL).all() and (dec.paged.plan.roles[1] == Role.TOPK).all()
    queries = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(8))
    out = dec.step(queries)
    assert torch.equal(out[0], dec.dense(queries)[0])


def test_budget_too_small_is_a_clear_error():
    with pytest.raises(BudgetError, match="pages per paged head"):
        Decoder("quest", 0.02, random_kv(tokens=100), 80, 4, page_size=8)
