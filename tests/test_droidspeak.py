"""kvfabric.droidspeak: family namespace, hidden-state chunks, the runtime's exactness (the profiler and the fine-tuned
sibling: tests/test_droidspeak_profile.py, tests/test_finetune.py).

Fast tests use a tiny randomly initialised Llama (seeded) so the runtime's arithmetic is checked without the real
model; the real fine-tuned pair is exercised by `kvfabric bench droidspeak`.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvfabric.blend.runner import LlamaRunner
from kvfabric.config import Config, DiskTierConfig
from kvfabric.droidspeak.family import DroidStore, FamilyMember, chunk_as_hidden, hidden_as_chunk
from kvfabric.droidspeak.runtime import Block, droid_prefill, recompute_block, sender_prefill
from kvfabric.kv.hashing import family_namespace
from kvfabric.kv.layout import KVLayout

LAYOUT = KVLayout(4, 2, 16, "float32")


def tiny_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def disk_config(path: Path) -> Config:
    return Config(chunk_size=16, tiers=("disk",), disk=DiskTierConfig(path=str(path)))


def member(model_id: str, family: str | None = "tiny", tokenizer: str = "tok1", layout: KVLayout = LAYOUT):
    return FamilyMember(model_id, family, tokenizer, layout)


# ---- namespace ---------------------------------------------------------------------------------------------
def test_family_namespace_is_not_a_model_id_and_rejects_bad_parts():
    ns = family_namespace("fam", "tok", "a", "kv")
    assert ns.startswith("\x00") and ns != family_namespace("fam", "tok", "a", "hidden@3")
    assert family_namespace("fam", "tok", "a", "kv") == ns  # deterministic
    for bad in (("", "tok", "a", "kv"), ("fam", "to\x00k", "a", "kv")):
        with pytest.raises(ValueError):
            family_namespace(*bad)


def test_family_members_share_only_with_same_family_tokenizer_and_layout():
    a = member("a")
    assert a.shares_with(member("b"))
    assert not a.shares_with(member("b", family="other"))
    assert not a.shares_with(member("b", tokenizer="tok2"))
    assert not a.shares_with(member("b", layout=KVLayout(4, 2, 32, "float32")))
    assert not member("a", family=None).shares_with(member("b", family=None))
    with pytest.raises(ValueError):
        DroidStore(member("x", family=None), "x", hidden_size=64)


def test_sibling_finds_owner_chunks_and_foreign_models_never_do(tmp_path):
    tokens = list(range(40))
    kv = torch.randn(LAYOUT.shape(40))
    hidden = {2: torch.randn(40, 64)}
    with DroidStore(member("a"), "a", 64, disk_config(tmp_path)) as owner:
        owner.store(tokens, kv, hidden)
    out = torch.zeros(LAYOUT.shape(40))
    with DroidStore(member("b"), "a", 64, disk_config(tmp_path)) as sibling:
        assert sibling.load_kv(tokens, out) and torch.equal(out, kv)
        h = torch.empty(40, 64)
        assert sibling.load_hidden(tokens, 2, h) and torch.equal(h, hidden[2])
        assert not sibling.load_hidden(tokens, 1, h)  # never stored for layer 1
        assert sibling.kv.lookup(tokens[:30] + [99] * 10) == 16  # prefix-chained like any key
    other_layout = KVLayout(4, 2, 32, "float32")
    for viewer in (member("b", family="other"), member("b", tokenizer="tok2"), member("b", layout=other_layout)):
        with DroidStore(viewer, "a", 64, disk_config(tmp_path)) as foreign:
            assert foreign.kv.lookup(tokens) == 0
            assert not foreign.load_kv(tokens, torch.zeros(viewer.layout.shape(40)))
            assert not foreign.load_hidden(tokens, 2, torch.empty(40, 64))
    with DroidStore(member("b"), "b", 64, disk_config(tmp_path)) as own:  # b's own family chunks: separate
        assert own.kv.lookup(tokens) == 0
    with pytest.raises(ValueError):
        DroidStore(member("b"), "a", 64, disk_config(tmp_path)).store(tokens, kv, {})


def test_hidden_chunk_round_trip_and_corruption_is_a_miss(tmp_path):
    h = torch.randn(40, 64)
    assert torch.equal(chunk_as_hidden(hidden_as_chunk(h)), h)
    tokens = list(range(100, 140))
    with DroidStore(member("a"), "a", 64, disk_config(tmp_path)) as owner:
        owner.store(tokens, torch.randn(LAYOUT.shape(40)), {1: h})
    # hidden chunks hold <= 16 x 64 fp32 values (4 KiB), KV chunks >= 8 x 1 KiB
    hidden_files = [p for p in tmp_path.rglob("*") if p.is_file() and 1024 < p.stat().st_size < 8000]
    assert len(hidden_files) == 3
    for path in hidden_files:  # flip one payload byte of every hidden-state chunk
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    with DroidStore(member("b"), "a", 64, disk_config(tmp_path)) as sibling:
        assert sibling.load_kv(tokens, torch.zeros(LAYOUT.shape(40)))  # the KV is intact
        assert not sibling.load_hidden(tokens, 1, torch.empty(40, 64))


# ---- runtime exactness ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair():
    return LlamaRunner(tiny_model(1)), LlamaRunner(tiny_model(2))


def _full_kv(runner: LlamaRunner, ids: list[int]) -> torch.Tensor:
    kv = runner.workspace(len(ids))
    runner.forward(torch.tensor(ids), kv)
    return kv


def test_empty_block_is_the_plain_cache_hit_and_whole_model_is_full_prefill(pair, tmp_path):
    a, b = pair
    ids = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    kv_a, hidden_a = sender_prefill(a, ids, capture=range(3))
    assert torch.equal(kv_a, _full_kv(a, ids))  # the capturing prefill is the ordinary one
    with DroidStore(member("a"), "a", 64, disk_config(tmp_path)) as owner:
        owner.store(ids, kv_a, hidden_a)
    with ThreadPoolExecutor(1) as loader:
        with DroidStore(member("a"), "a", 64, disk_config(tmp_path)) as self_view:  # A reusing its own KV
            hit = droid_prefill(a, self_view, ids, Block(0, 0), 50, loader)
            plain = torch.zeros(LAYOUT.shape(50))
            assert hit is not None and self_view.load_kv(ids, plain) and torch.equal(hit.kv, plain)
            assert torch.equal(hit.kv, kv_a)
            same = droid_prefill(a, self_view, ids, Block(1, 3), 50, loader)  # A's own hidden: A's own KV
            assert same is not None and torch.allclose(same.kv, kv_a, atol=1e-5)
        with DroidStore(member("b"), "a", 64, disk_config(tmp_path)) as sibling:
            whole = droid_prefill(b, sibling, ids, Block(0, 4), 50, loader)
            assert whole is not None and torch.equal(whole.kv, _full_kv(b, ids))
            part = droid_prefill(b, sibling, ids, Block(2, 3), 50, loader)
            assert part is not None
            assert torch.equal(part.kv[[0, 1, 3]], kv_a[[0, 1, 3]])  # outside the block: A's KV
            assert not torch.allclose(part.kv[2], kv_a[2])  # inside: recomputed by B
            assert part.num_bytes == LAYOUT.num_bytes(50) + 50 * 64 * 4
            assert droid_prefill(b, sibling, ids + [5], Block(0, 0), 51, loader) is None  # a miss
            assert droid_prefill(b, sibling, ids, Block(3, 4), 50, loader) is None  # hidden@3 never stored
    with pytest.raises(ValueError):
        recompute_block(b, ids, b.workspace(50), Block(1, 2), None)
    with pytest.raises(ValueError):
        Block(3, 2)


@pytest.mark.slow
def test_real_model_self_reuse_is_exact(tmp_path):
    """SmolLM2-135M reusing its own chunks through the family path: empty block == the plain hit, whole model ==
    its full prefill, a middle block from its own hidden state == its own KV (fp error)."""
    from kvfabric.droidspeak.pair import load_sibling
    me = load_sibling("smollm2-135m-instruct", kv_dtype="float32")
    runner = me.runner
    ids = me.tokenizer("The quick brown fox jumps over the lazy dog. " * 8)["input_ids"]
    n, num_layers = len(ids), runner.num_layers
    kv, hidden = sender_prefill(runner, ids, capture=[10])
    hidden_size = runner.config.hidden_size
    with DroidStore(me.member, me.name, hidden_size, disk_config(tmp_path)) as store, ThreadPoolExecutor(1) as pool:
        store.store(ids, kv, hidden)
        plain = torch.zeros(me.member.layout.shape(n))
        assert store.load_kv(ids, plain)
        empty = droid_prefill(runner, store, ids, Block(0, 0), n, pool)
        assert empty is not None and torch.equal(empty.kv, plain)
        whole = droid_prefill(runner, store, ids, Block(0, num_layers), n, pool)
        assert whole is not None and torch.equal(whole.kv, _full_kv(runner, ids))
        middle = droid_prefill(runner, store, ids, Block(10, 20), n, pool)
        assert middle is not None and torch.allclose(middle.kv, kv, atol=1e-4)


def test_fp16_chunks_load_on_the_loader_thread(pair, tmp_path):
    """The loader thread decodes fp16 chunks into the receiver's fp32 (inference-mode) workspace."""
    a, b = pair
    half = KVLayout(4, 2, 16, "float16")
    ids = list(range(30))
    kv_a, hidden_a = sender_prefill(a, ids, capture=[2])
    with DroidStore(member("a", layout=half), "a", 64, disk_config(tmp_path)) as owner:
        owner.store(ids, kv_a, hidden_a)
    with DroidStore(member("b", layout=half), "a", 64, disk_config(tmp_path)) as sibling, \
            ThreadPoolExecutor(1) as loader:
        got = droid_prefill(b, sibling, ids, Block(2, 3), 30, loader)
        assert got is not None
        assert torch.equal(got.kv[[0, 1, 3]], kv_a[[0, 1, 3]].half().float())


def test_cacheblend_over_a_siblings_kv_at_full_compute_is_the_full_prefill(tmp_path):
    """bench droidspeak's `cacheblend` method: the sender's KV as the one cached passage; recomputing every
    token-layer gives the receiver's own prefill, a smaller share loads the sender's KV and differs."""
    from kvfabric.bench.droidspeak import blend_prefill
    from kvfabric.blend.fusion import Blender
    from kvfabric.blend.values import BlendConfig
    a, b = LlamaRunner(tiny_model(1)), tiny_model(2)
    context, question = list(range(3, 43)), [50, 51, 52, 53]
    kv_a, _ = sender_prefill(a, context)
    with Blender(b, model_id="a--b", config=disk_config(tmp_path), blend=BlendConfig(check_layers=(1, 2))) as blender:
        blender.store.store(context, kv_a)
        ref_kv = blender.runner.workspace(64)
        ref = blender.runner.logits(blender.runner.forward(torch.tensor(context + question), ref_kv)[len(context):])
        kv, logits, num_bytes = blend_prefill(blender, context, question, 1.0, 64)
        assert logits.shape == ref.shape and torch.allclose(logits, ref, atol=1e-4)
        _, part, part_bytes = blend_prefill(blender, context, question, 0.5, 64)
        assert part_bytes > 0 and not torch.allclose(part, ref, atol=1e-3)
