"""kvfabric.blend: matcher and controller (pure), then the real model (SmolLM2-135M, CPU, short passages).

Passages are paragraphs of the shipped demo document; nothing here reads the benchmark data set.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from importlib import resources

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric import Config
from kvfabric.bench.blend import random_ranker
from kvfabric.blend import (
    BlendConfig,
    Blender,
    LlamaRunner,
    LoadController,
    PassageMatcher,
    PassageStore,
    passage_digest,
    rotate,
    sparse,
)
from kvfabric.blend import matcher as matcher_mod


# ---- matcher (no model) ----------------------------------------------------------------------------------
def test_matcher_finds_passages_at_any_offset_and_splits():
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(0, 50_000, n).tolist() for n in (40, 25, 60))
    m = PassageMatcher(window=8)
    assert m.add(a) and m.add(b) and m.add(c)
    assert not m.add([1, 2, 3])  # shorter than min_tokens: not matchable
    short = [70_001, 70_002, 70_003, 70_004, 70_005]  # shorter than the window: its own window length
    filler = rng.integers(0, 50_000, 7).tolist()
    flat = filler + b + a + [5, 6] + c + filler
    found = m.find(flat)
    assert [(x.start, x.length) for x in found] == [(7, 25), (32, 40), (74, 60)]
    parts = m.split(flat)
    assert parts[0] == (0, 7, False) and parts[-1] == (134, 141, False)
    assert [p for p in parts if p[2]] == [(7, 32, True), (32, 72, True), (74, 134, True)]
    assert sum(e - s for s, e, _ in parts) == len(flat)
    assert m.find(filler * 3) == [] and PassageMatcher().find(flat) == []
    assert m.add(short)
    assert [(x.start, x.length) for x in m.find([9] + short + a)] == [(1, 5), (6, 40)]
    with pytest.raises(ValueError):
        PassageMatcher(window=4, min_tokens=5)


def test_matcher_prefers_the_longest_passage_and_verifies_by_full_hash(monkeypatch):
    rng = np.random.default_rng(2)
    long = rng.integers(0, 1000, 50).tolist()
    m = PassageMatcher(window=8)
    m.add(long[:20])
    m.add(long)
    assert [(x.start, x.length) for x in m.find([9] + long)] == [(1, 50)]
    # a same-anchor text that differs later is not a match (full hash), nor is a truncated one
    assert [(x.start, x.length) for x in m.find(long[:30] + [1, 2, 3])] == [(0, 20)]
    # every window colliding with every anchor: still only true matches
    monkeypatch.setattr(matcher_mod, "window_hashes", lambda t, w: np.zeros(max(len(t) - w + 1, 0), np.uint64))
    m2 = PassageMatcher(window=8)
    m2.add(long[:20])
    flat = rng.integers(0, 1000, 30).tolist() + long[:20]
    assert [(x.start, x.length) for x in m2.find(flat)] == [(30, 20)]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**24 - 1), min_size=8, max_size=40), min_size=1, max_size=5),
       st.lists(st.integers(0, 2**24 - 1), max_size=20), st.randoms(use_true_random=False))
def test_matcher_property_every_inserted_passage_is_found(passages, filler, rnd):
    m = PassageMatcher(window=8)
    for p in passages:
        m.add(p)
    order = list(range(len(passages)))
    rnd.shuffle(order)
    flat, spans = [], []
    for i in order:
        flat += filler[: rnd.randint(0, len(filler))] + [2**24 + 7]  # a separator no passage contains
        spans.append((len(flat), len(passages[i])))
        flat += passages[i]
    found = m.find(flat)
    for x in found:  # every match is real
        assert passage_digest(flat[x.start:x.end]) in {passage_digest(p) for p in passages}
    starts = {x.start: x.length for x in found}
    for s, n in spans:  # every inserted passage is covered by a match starting there (or a longer equal one)
        assert s in starts and starts[s] >= n or any(x.start <= s and s + n <= x.end for x in found)


# ---- loading controller (no model) ----------------------------------------------------------------------
def test_controller_ratio_follows_load_speed():
    c = LoadController(min_ratio=0.1, max_ratio=0.6, default=0.15, smoothing=1.0)
    assert c.choose(1000, 10**6) == 0.15  # nothing measured yet
    c.observe_compute(token_layers=10_000, seconds=1.0)  # 10k tokens/s per layer
    c.observe_load(10**9, 1.0)  # fast tier: 1 GB/s -> 1 MB per layer loads in 1 ms -> 10 tokens
    assert c.choose(1000, 10**6) == 0.1
    c.observe_load(10**7, 1.0)  # 10 MB/s -> 0.1 s per layer -> 1000 tokens of recompute are free
    assert c.choose(4000, 10**6) == pytest.approx(0.25)
    assert c.choose(4000, 10**6, fixed_tokens=200) == pytest.approx(0.2)  # the suffix uses part of the time
    c.observe_load(10**6, 1.0)  # very slow: capped
    assert c.choose(4000, 10**6) == 0.6
    slow, fast = LoadController(smoothing=1.0), LoadController(smoothing=1.0)
    for ctl, bw in ((slow, 2e7), (fast, 2e8)):
        ctl.observe_compute(5000, 1.0)
        ctl.observe_load(int(bw), 1.0)
    assert slow.choose(3000, 2 * 10**6) > fast.choose(3000, 2 * 10**6)


def test_controller_smoothing_and_validation():
    c = LoadController(smoothing=0.5)
    c.observe_load(100, 1.0)
    c.observe_load(300, 1.0)
    assert c.load_bytes_per_s == 200
    c.observe_load(0, 1.0)  # ignored
    assert c.load_bytes_per_s == 200
    with pytest.raises(ValueError):
        LoadController(min_ratio=0.5, max_ratio=0.2)
    with pytest.raises(ValueError):
        LoadController(smoothing=0)
    assert LoadController(min_ratio=0.2, default=0.1).default == 0.2


def test_blend_config_validation_and_gradual_fractions():
    assert BlendConfig().fractions(0.15) == pytest.approx([0.3, 0.25, 0.2, 0.15])  # gradual filtering by default
    assert BlendConfig(check_layers=(1,)).fractions(0.15) == [0.15]
    fr = BlendConfig(check_layers=(1, 2, 3), gradual=2.0).fractions(0.15)
    assert fr == pytest.approx([0.3, 0.225, 0.15])
    assert BlendConfig(check_layers=(1, 2), gradual=10).fractions(0.5)[0] == 1.0
    for bad in (dict(recompute_frac=1.5), dict(check_layers=()), dict(check_layers=(2, 1)), dict(check_layers=(0, 2)),
                dict(gradual=0.5), dict(score="nope")):
        with pytest.raises(ValueError):
            BlendConfig(**bad)


def test_recompute_frac_counts_every_layer_and_the_check_layers():
    config = BlendConfig()  # check layers 2, 4, 6, 8; gradual 2
    shares = config.layer_shares(0.15, 30)
    # layers 0-2 run every token (layer 2 scores them all), then 0.3, 0.25, 0.2 between check layers, then 0.15
    assert shares == pytest.approx([1, 1, 1, .3, .3, .25, .25, .2, .2] + [.15] * 21)
    assert sum(shares) / 30 == pytest.approx(0.255)  # the first pass's "15 %"
    assert sum(shares[1:]) / 29 == pytest.approx(0.229, abs=1e-3)  # what its bench reported (layer 0 left out)
    for frac in (0.1, 0.15, 0.255, 0.41, 1.0):
        assert sum(config.layer_shares(config.ratio_for(frac, 30), 30)) / 30 == pytest.approx(frac, abs=1e-6)
    assert config.ratio_for(0.255, 30) == pytest.approx(0.15)
    with pytest.raises(ValueError, match="every token runs up to the first one"):
        config.ratio_for(0.09, 30)  # below 3 full layers of 30
    with pytest.raises(ValueError):
        config.ratio_for(0.2, 8)  # check layer 8 does not exist


# ---- real model ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    from kvfabric.engines.model import ensure_model, load_model
    model, tok = load_model(ensure_model())
    return model, tok


def _paragraphs(tok, count: int, max_tokens: int = 70) -> list[list[int]]:
    text = resources.files("kvfabric").joinpath("data/demo_document.txt").read_text()
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 250]
    return [tok(p + "\n\n", add_special_tokens=False)["input_ids"][:max_tokens] for p in paras[:count]]


@pytest.fixture(scope="module")
def prompt(smol):
    _, tok = smol
    prefix = tok("<|im_start|>system\nAnswer from the passages.<|im_end|>\n<|im_start|>user\n",
                 add_special_tokens=False)["input_ids"]
    question = tok("Question: Who founded the town, and when?<|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False)["input_ids"]
    return [prefix, *_paragraphs(tok, 3), question]


@pytest.fixture(scope="module")
def blender32(smol):
    config = Config(chunk_size=64, tiers=("cpu",))
    with Blender(smol[0], model_id="test", kv_dtype="float32", config=config) as b:
        yield b


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    p, q = F.log_softmax(ref, -1), F.log_softmax(other, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.slow
def test_runner_equals_hf_when_every_token_is_computed(smol):
    model, tok = smol
    runner = LlamaRunner(model)
    ids = tok("The lighthouse keeper climbed the stairs every night to light the lamp. " * 4)["input_ids"]
    ref = hf_logits(model, ids)
    with torch.inference_mode():
        kv = runner.workspace(len(ids))
        assert (runner.logits(runner.forward(torch.tensor(ids), kv)) - ref).abs().max() < 1e-4
        kv2 = runner.workspace(len(ids))
        runner.forward(torch.tensor(ids[:17]), kv2)  # then the rest over the first part's KV (masked path)
        tail = runner.logits(runner.forward(torch.tensor(ids[17:]), kv2, start=17))
    assert (tail - ref[17:]).abs().max() < 1e-4
    assert (kv2 - kv).abs().max() < 1e-4


@pytest.mark.parametrize("key_start", [0, 7])
@pytest.mark.parametrize("call_cost", [0.0, 50_000.0, 1e12])  # many small blocks, the default, one block
def test_planned_attention_equals_dense_masked_attention(key_start, call_cost):
    """Planned blocks of scattered queries (unmasked prefix + masked window, merged by log-sum-exp) == one dense
    masked softmax, for GQA heads, random positions, a run at the end, and first + last."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, n, d, scale = 9, 3, 300, 64, 0.125
    keys, values = torch.randn(1, hkv, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g)
    for positions in (torch.sort(torch.randperm(n - key_start, generator=g)[:150]).values + key_start,
                      torch.arange(key_start, n)[-70:], torch.tensor([key_start, n - 1]),
                      torch.tensor([key_start + 3])):
        q = torch.randn(1, hq, positions.numel(), d, generator=g)
        p = sparse.plan(positions - key_start, hq // hkv, call_cost=call_cost)
        assert sum(b.stop - b.start for b in p.blocks) == positions.numel()
        got = sparse.attend(p, q, keys[:, :, key_start:], values[:, :, key_start:], scale)  # [1, s, Hq, D]
        k_all = keys[0, :, key_start:].repeat_interleave(hq // hkv, 0)  # [Hq, n', D]
        v_all = values[0, :, key_start:].repeat_interleave(hq // hkv, 0)
        scores = q[0] @ k_all.transpose(1, 2) * scale
        hidden = torch.arange(key_start, n).view(1, -1) > positions.view(-1, 1)
        ref = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ v_all  # [Hq, s, D]
        assert (got[0].transpose(0, 1) - ref).abs().max() < 1e-5
    if call_cost == 0.0:  # (the merge matters: blocks with a prefix exist)
        assert any(b.prefix > 0 for b in p.blocks)
    with pytest.raises(ValueError):
        sparse.plan(torch.tensor([3, 2]), 3)


def test_plan_blocks_trade_calls_against_masked_pairs():
    slots = np.sort(np.random.default_rng(0).choice(6000, 900, replace=False))
    many, one = sparse.choose_blocks(slots, call_cost=0.0), sparse.choose_blocks(slots, call_cost=1e12)
    assert one == [(0, 900)] and len(many) == -(-900 // sparse.UNIT)  # every unit its own block
    mid = sparse.choose_blocks(slots, call_cost=50_000)
    assert 1 < len(mid) < len(many)
    assert [a for a, _ in mid[1:]] == [b for _, b in mid[:-1]] and mid[0][0] == 0 and mid[-1][1] == 900

    def pairs(blocks):
        return sum((b - a) * (slots[b - 1] + 1) for a, b in blocks)
    assert pairs(many) <= pairs(mid) <= pairs(one)


@pytest.mark.slow
def test_blend_with_every_token_recomputed_equals_hf(smol, blender32, prompt):
    for seg in prompt[:-1]:
        blender32.cache_passage(seg)
    ids = [t for seg in prompt for t in seg]
    ref = hf_logits(smol[0], ids)
    q_start = len(ids) - len(prompt[-1])
    res = blender32.prefill(prompt, mode="blend", recompute_frac=1.0, logits_from=q_start)
    assert res.blended and res.reused_tokens == q_start and res.recompute_frac == 1.0
    assert (res.logits - ref[q_start:]).abs().max() < 1e-4
    full = blender32.prefill(prompt, mode="full", logits_from=q_start)
    assert not full.blended and (full.logits - ref[q_start:]).abs().max() < 1e-4
    assert (res.kv[:, :, :, :len(ids)] - full.kv[:, :, :, :len(ids)]).abs().max() < 1e-3  # recomputed KV written


@pytest.mark.slow
def test_rerotation_matches_k_at_true_positions(smol, blender32, prompt):
    model = smol[0]
    runner, store = blender32.runner, blender32.store
    passage = prompt[2]
    blender32.cache_passage(passage)
    n = len(passage)
    for delta in (3, 451):
        with torch.inference_mode():
            cached = runner.workspace(n)
            for g in range(store.num_groups):
                assert store.load_group(passage, g, cached[g:g + 1])
            k = cached[:, 0].clone()
            rotate(k, *runner.delta_rotation(delta))
            true = runner.workspace(delta + n)
            runner.forward(torch.tensor(passage), true, start=delta, key_start=delta)  # alone, at its true place
        k_true = true[:, 0, :, delta:]
        assert float((k - k_true).norm() / k_true.norm()) < 1e-4  # every layer
        assert float((k - cached[:, 0]).norm() / k_true.norm()) > 0.1  # (the rotation is not a no-op)
        assert (cached[:, 1] - true[:, 1, :, delta:]).abs().max() < 1e-3  # V does not depend on the position
    # in a real prompt, layer 0 K depends only on the token and its position: the HF model's own cache agrees
    ids = [t for seg in prompt for t in seg]
    off = len(prompt[0]) + len(prompt[1])
    with torch.inference_mode():
        hf_k0 = model(torch.tensor([ids]), use_cache=True).cache.layers[0].keys[0, :, off:off + n]
        k0 = cached[0, 0].clone()
        rotate(k0, *runner.delta_rotation(off))
    assert float((k0 - hf_k0).norm() / hf_k0.norm()) < 1e-4


@pytest.mark.slow
def test_blend_recomputes_selected_tokens_and_closes_the_gap(smol, prompt):
    config = Config(chunk_size=64, tiers=("cpu",))
    gradual = BlendConfig(check_layers=(1, 2, 3), gradual=2.0)
    with Blender(smol[0], model_id="test16", config=config, blend=gradual) as b:  # fp16 storage (default)
        for seg in prompt[:-1]:
            assert b.cache_passage(seg)
            assert not b.cache_passage(seg)  # already cached
        n = sum(map(len, prompt))
        q_start = n - len(prompt[-1])
        full = b.prefill(prompt, mode="full", logits_from=q_start)
        reuse = b.prefill(prompt, mode="reuse", logits_from=q_start)
        frac = sum(gradual.layer_shares(0.3, 30)) / 30  # the compute of final ratio 0.3 with this schedule
        blend = b.prefill(prompt, mode="blend", recompute_frac=frac, logits_from=q_start)
        rand = b.prefill(prompt, mode="blend", recompute_frac=frac, logits_from=q_start, ranking=random_ranker(3))
        rand2 = b.prefill(prompt, mode="blend", recompute_frac=frac, logits_from=q_start, ranking=random_ranker(3))
    fixed = len(prompt[-1])
    assert reuse.tokens_per_layer == [fixed] * 30  # nothing but the question computed
    tpl = blend.tokens_per_layer
    reused = blend.reused_tokens
    assert reused == q_start and tpl[0] == tpl[1] == n  # layer 0 and the first check layer: every token
    assert tpl[2] == fixed + round(0.6 * reused) and tpl[3] == fixed + round(0.45 * reused)  # gradual filtering
    assert tpl[4:] == [fixed + round(0.3 * reused)] * 26
    assert tpl == sorted(tpl, reverse=True)
    assert blend.ratio == pytest.approx(0.3) and blend.recompute_frac == pytest.approx(frac, abs=0.01)
    assert torch.equal(rand.logits, rand2.logits)  # the control is seeded
    kl_reuse, kl_blend = kl(full.logits, reuse.logits), kl(full.logits, blend.logits)
    assert kl_reuse > 0.01
    assert kl_blend < 0.7 * kl_reuse  # selective recompute restores much of the cross-attention


@pytest.mark.slow
def test_misses_and_vanished_passages_fall_back(smol, blender32, prompt, monkeypatch):
    q_start = sum(map(len, prompt)) - len(prompt[-1])
    for seg in prompt[:-1]:
        blender32.cache_passage(seg)
    full = blender32.prefill(prompt, mode="full", logits_from=q_start)
    # an uncached segment is computed like the question
    novel = [prompt[0], prompt[1], list(reversed(prompt[2])), prompt[3], prompt[4]]
    res = blender32.prefill(novel, mode="blend", logits_from=q_start)
    assert res.blended and res.reused_tokens == q_start - len(prompt[2])
    # nothing cached at all: a plain full prefill
    res = blender32.prefill([[5, 6, 7] * 10, prompt[-1]], mode="blend")
    assert not res.blended and res.fallback == "miss"
    # a passage evicted between the lookup and the load: full prefill, same logits as the reference
    real = blender32.store.load_group
    monkeypatch.setattr(blender32.store, "load_group", lambda toks, g, out: g < 5 and real(toks, g, out))
    res = blender32.prefill(prompt, mode="blend", logits_from=q_start)
    assert not res.blended and res.fallback == "load"
    assert (res.logits - full.logits).abs().max() < 1e-4

    def broken(toks, g, out):
        raise RuntimeError("tier exploded")
    monkeypatch.setattr(blender32.store, "load_group", broken)
    with pytest.raises(RuntimeError, match="tier exploded"):
        blender32.prefill(prompt, mode="blend", logits_from=q_start)
    monkeypatch.setattr(blender32.store, "load_group", real)
    assert blender32.prefill(prompt, mode="blend", logits_from=q_start).blended  # still usable
    for bad in (dict(mode="nope"), dict(reuse=[True] * 5), dict(reuse=[True]), dict(logits_from=3)):
        with pytest.raises(ValueError):
            blender32.prefill(prompt, **bad)


@pytest.mark.slow
def test_a_caller_ranking_chooses_the_recomputed_tokens(blender32, prompt):
    for seg in prompt[:-1]:
        blender32.cache_passage(seg)
    n = sum(map(len, prompt))
    q_start = n - len(prompt[-1])
    a = len(prompt[0]) + len(prompt[1])  # the second passage spans [a, b)
    b = a + len(prompt[2])
    ranking = torch.zeros(n)
    ranking[a:b] = 1.0
    reuse = blender32.prefill(prompt, mode="reuse", logits_from=q_start)
    frac = sum(blender32.config.layer_shares((b - a) / q_start, 30)) / 30  # final ratio: one passage
    res = blender32.prefill(prompt, mode="blend", recompute_frac=frac, ranking=ranking, logits_from=q_start)
    assert res.tokens_per_layer[-1] == len(prompt[-1]) + (b - a)
    last = blender32.runner.num_layers - 1
    assert not torch.equal(res.kv[last, :, :, a:b], reuse.kv[last, :, :, a:b])  # the ranked passage: recomputed
    assert torch.equal(res.kv[last, :, :, :a], reuse.kv[last, :, :, :a])  # the others: the cached KV as loaded
    assert torch.equal(res.kv[last, :, :, b:q_start], reuse.kv[last, :, :, b:q_start])
    with pytest.raises(ValueError, match="one score per prompt token"):
        blender32.prefill(prompt, mode="blend", ranking=torch.zeros(n - 1), logits_from=q_start)
    with pytest.raises(ValueError, match="only used by mode='blend'"):
        blender32.prefill(prompt, mode="reuse", ranking=ranking, logits_from=q_start)


@pytest.mark.slow
def test_loads_run_ahead_in_the_loader_thread(blender32, prompt, monkeypatch):
    for seg in prompt[:-1]:
        blender32.cache_passage(seg)
    calls: list[tuple[str, int]] = []
    real = blender32.store.load_group

    def spy(toks, g, out):
        calls.append((threading.current_thread().name, g))
        return real(toks, g, out)
    monkeypatch.setattr(blender32.store, "load_group", spy)
    blender32.prefill(prompt, mode="blend")
    assert all(name.startswith("kvfabric-blend-loader") for name, _ in calls)
    first = blender32.config.check_layers[0]  # layers below it run for every token: never loaded
    assert first > 0 and sorted({g for _, g in calls}) == list(range(first, 30))
    assert len(calls) == (30 - first) * (len(prompt) - 1)
    calls.clear()
    blender32.prefill(prompt, mode="reuse")
    assert sorted({g for _, g in calls}) == list(range(30))


@pytest.mark.slow
def test_passage_keys_are_the_passages_own_tokens(smol, prompt, monkeypatch):
    config = Config(chunk_size=32, tiers=("cpu",))
    with Blender(smol[0], model_id="grp", kv_dtype="float32", config=config, layers_per_group=5) as b:
        store = b.store
        assert store.namespace == "grp/blend" and store.num_groups == 6
        assert not store.contains(prompt[1])
        b.cache_passage(prompt[1])
        assert store.contains(prompt[1]) and not store.contains(prompt[1][:-1])
        chunks = 6 * -(-len(prompt[1]) // 32)  # 6 groups x the passage's chunks (the last one partial)
        assert store.cache.stats().counters["chunks_stored"] == chunks
        # the same passage anywhere in any prompt is a hit; grouping does not change the result
        for seg in prompt[:-1]:
            b.cache_passage(seg)
        q_start = sum(map(len, prompt)) - len(prompt[-1])
        load_group = store.load_group

        def slow_load(tokens, g, out):  # a slow tier: group 0 (layers 0-4) lands after layer 0 could have run
            time.sleep(0.02)
            return load_group(tokens, g, out)
        monkeypatch.setattr(store, "load_group", slow_load)
        grouped = b.prefill(prompt, mode="blend", logits_from=q_start)
        swapped = b.prefill([prompt[0], prompt[3], prompt[1], prompt[2], prompt[4]], mode="reuse")
        assert swapped.reused_tokens == q_start
        assert store.delete(prompt[1]) == chunks and not store.contains(prompt[1])
    with Blender(smol[0], model_id="grp1", kv_dtype="float32", config=config) as b1:
        for seg in prompt[:-1]:
            b1.cache_passage(seg)
        single = b1.prefill(prompt, mode="blend", logits_from=q_start)
    assert (grouped.logits - single.logits).abs().max() < 1e-4
    n = grouped.length  # the KV left for decoding too: layer 0 fresh for every token, not the late-landing cache
    assert (grouped.kv[:, :, :, :n] - single.kv[:, :, :, :n]).abs().max() < 1e-4
    with pytest.raises(ValueError):
        PassageStore(num_layers=30, num_kv_heads=3, head_dim=64, model_id="x", layers_per_group=7)
    with pytest.raises(ValueError):
        store.tagged([2**24], 0)


@pytest.mark.slow
def test_flat_tokens_matcher_gives_the_segment_result(blender32, prompt):
    for seg in prompt[:-1]:
        blender32.cache_passage(seg)
    flat = [t for seg in prompt for t in seg]
    by_segments = blender32.prefill(prompt, mode="blend")
    by_matcher = blender32.prefill_tokens(flat, mode="blend")
    assert by_matcher.reused_tokens == by_segments.reused_tokens
    assert (by_matcher.logits - by_segments.logits).abs().max() < 1e-5
    tail_only = blender32.prefill_tokens(flat[:len(flat) - len(prompt[-1])])  # ends with a cached passage
    assert tail_only.blended and tail_only.reused_tokens == len(flat) - len(prompt[-1]) - len(prompt[-2])


@pytest.mark.slow
def test_generate_and_extend_match_hf(smol, blender32, prompt):
    model = smol[0]
    ids = [t for seg in prompt for t in seg]
    res = blender32.prefill(prompt, mode="full", capacity=len(ids) + 8)
    new = blender32.generate(res, 5)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
    assert new == ref
    tf = blender32.extend(res, new)  # teacher forcing over the prompt's KV
    assert (tf - hf_logits(model, ids + new)[len(ids):]).abs().max() < 1e-4
    with pytest.raises(ValueError):
        blender32.extend(res, [1] * 100)


@pytest.mark.slow
def test_gate_disables_blending_when_rerotation_is_wrong(smol, prompt, monkeypatch, caplog):
    config = Config(chunk_size=64, tiers=("cpu",))
    with caplog.at_level(logging.INFO, logger="kvfabric.blend"):
        with Blender(smol[0], model_id="ok", config=config) as good:
            assert good.enabled and good.gate_error < 1e-2
    assert "self-test passed" in caplog.text
    caplog.clear()
    # a model whose positions are not a rotation by the delta (simulated): the gate must catch it
    monkeypatch.setattr(LlamaRunner, "delta_rotation",
                        lambda self, d: (torch.ones(self.head_dim), torch.zeros(self.head_dim)))
    with caplog.at_level(logging.INFO, logger="kvfabric.blend"):
        b = Blender(smol[0], model_id="bad", config=config)
    with b:
        assert not b.enabled and b.gate_error > 0.1
        assert "self-test FAILED" in caplog.text and "falls back to a full prefill" in caplog.text
        for seg in prompt[:-1]:
            b.cache_passage(seg)
        q_start = sum(map(len, prompt)) - len(prompt[-1])
        res = b.prefill(prompt, mode="blend", logits_from=q_start)
        ref = b.prefill(prompt, mode="full", logits_from=q_start)
    assert not res.blended and res.fallback == "gate" and torch.equal(res.logits, ref.logits)
    monkeypatch.undo()
    with Blender(smol[0], model_id="strict", config=config, blend=BlendConfig(gate_bound=0.0)) as strict:
        assert not strict.enabled


@pytest.mark.slow
def test_controller_drives_the_ratio(smol, prompt):
    ctl = LoadController(min_ratio=0.1, max_ratio=0.4, smoothing=1.0)
    with Blender(smol[0], model_id="ctl", config=Config(chunk_size=64, tiers=("cpu",)), controller=ctl) as b:
        for seg in prompt[:-1]:
            b.cache_passage(seg)
        first = b.prefill(prompt)
        assert first.ratio == ctl.default and first.load_bytes > 0
        assert ctl.load_bytes_per_s and ctl.tokens_per_s_per_layer  # measured by the first prefill
        reused = first.reused_tokens
        expected = ctl.choose(reused, reused * b.store.layout.num_bytes(1), fixed_tokens=len(prompt[-1]))
        second = b.prefill(prompt)
        assert 0.1 <= second.ratio <= 0.4 and second.ratio == pytest.approx(expected)
        ctl.load_bytes_per_s = 1.0  # a very slow tier: recompute as much as allowed
        assert b.prefill(prompt).ratio == 0.4
        explicit = b.prefill(prompt, recompute_frac=0.2)  # an explicit compute wins
        assert explicit.ratio == pytest.approx(b.config.ratio_for(0.2, 30))
        assert explicit.recompute_frac == pytest.approx(0.2, abs=0.01)


@pytest.mark.slow
def test_bench_blend_smoke(tmp_path, capsys):
    from kvfabric.bench.blend import exact_match, f1_score, report, run
    text = resources.files("kvfabric").joinpath("data/demo_document.txt").read_text()
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 250][:2]
    data = [{"question": "Who founded Halvor's Point?", "answers": ["Halvor Lund"],
             "ctxs": [{"title": f"Part {i}", "text": p[:300]} for i, p in enumerate(paras)]}]
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(data))
    rows = run(as_json=True, limit=1, passages=2, data=path, fracs=(0.15, 0.255), max_new_tokens=4, answer_tokens=3,
               oracle=True)
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    settings_seen = [r["setting"] for r in out if "q" in r]
    assert settings_seen == ["full", "reuse", "blend@15", "blend@25.5", "random@25.5", "oracle@25.5"]
    by = {r["setting"]: r for r in out if "q" in r}
    full = by["full"]
    assert full["kl"] == 0 and full["top1"] == 1 and full["top1_ans"] == 1 and full["passages"] == 2
    assert full["recompute_frac"] == 1.0 and full["same_answer"] == 1.0 and full["em"] in (0.0, 1.0)
    assert by["reuse"]["recompute_frac"] == 0.0
    for name, frac in (("blend@15", 0.15), ("blend@25.5", 0.255), ("random@25.5", 0.255)):
        assert by[name]["recompute_frac"] == pytest.approx(frac, abs=0.02)  # measured, not the request
    reuse = by["reuse"]
    assert reuse["kl_q"] > 0 and reuse["kl"] >= min(reuse["kl_q"], reuse["kl_ans"])  # the parts bracket the mean
    assert reuse["kl"] <= max(reuse["kl_q"], reuse["kl_ans"])
    assert by["oracle@25.5"]["kl"] < reuse["kl"]  # the oracle's recompute fixes part of the reuse error
    path.with_suffix(".jsonl").write_text("\n".join(json.dumps(r) for r in out if "q" in r))
    summary = {s["setting"]: s for s in report(path.with_suffix(".jsonl")) if s.get("summary") == "blend"}
    assert summary["oracle@25.5"]["kl_ans"] == pytest.approx(by["oracle@25.5"]["kl_ans"], abs=1e-4)
    targets = [r for r in rows if r.get("summary") == "targets"]
    assert [(t["setting"], t["metric"]) for t in targets[:3]] == [("blend@25.5", "speedup"),
                                                                  ("blend@25.5", "gap_closed"), ("blend@25.5", "gap_ans")]
    assert all(t["met"] == ("met" if t["value"] >= float(t["goal"][3:]) else "not met") for t in targets[:3])
    assert (targets[3]["setting"], targets[3]["metric"], targets[3]["met"]) == ("blend@25.5", "cpu_speedup", "-")
    assert {t["setting"] for t in targets[4:]} == {"blend@15"}
    assert all(r["cpu_s"] > 0 for r in out if "q" in r) and summary["blend@25.5"]["cpu_speedup"] > 0
    assert f1_score("Halvor Lund, in 1791", ["Halvor Lund"]) == pytest.approx(2 / 3)
    assert f1_score("", ["x"]) == 0.0
    assert exact_match("the Halvor Lund.", ["Halvor Lund"]) == 1.0 and exact_match("Lund", ["Halvor Lund"]) == 0.0
