"""kvfabric.droidspeak: family namespace, hidden-state chunks, the runtime's exactness, profiling.

Fast tests use a tiny randomly initialised Llama (seeded) so the runtime's arithmetic is checked without the real
model; the real fine-tuned pair is exercised by `kvfabric bench droidspeak`.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvfabric.blend.runner import LlamaRunner
from kvfabric.config import Config, DiskTierConfig
from kvfabric.droidspeak.family import DroidStore, FamilyMember, chunk_as_hidden, hidden_as_chunk
from kvfabric.droidspeak.profile import ProfileTable, kl_rows, profile_prompt
from kvfabric.droidspeak.runtime import Block, droid_prefill, recompute_block, sender_prefill
from kvfabric.hashing import family_namespace
from kvfabric.layout import KVLayout

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


# ---- profiling -----------------------------------------------------------------------------------------------
def test_profile_table_extremes_choice_and_json(pair, tmp_path):
    a, b = pair
    gen = torch.Generator().manual_seed(3)
    context, suffix = torch.randint(0, 128, (40,), generator=gen).tolist(), torch.randint(0, 128, (10,), generator=gen).tolist()
    prof = profile_prompt(a, b, context, suffix, num_answer=4)
    assert float(prof.kl[0, 0]) > 1e-4  # the two models differ: naive reuse costs something
    assert float(prof.kl[0, 4]) < 1e-6 and float(prof.kl_ans[0, 4]) < 1e-6  # whole model: the full prefill
    for s, e in ((0, 0), (1, 3), (2, 4), (3, 4), (0, 2)):  # the shared-trajectory scores equal a direct run
        kv_a, hidden_a = sender_prefill(a, context, capture=range(4))
        ws = b.workspace(50)
        ws[:, :, :, :40] = kv_a
        recompute_block(b, context, ws, Block(s, e), hidden_a.get(s))
        ref = torch.log_softmax(b.logits(b.forward(torch.tensor(context + suffix), b.workspace(50))[40:]), -1)
        with torch.inference_mode():
            rows = kl_rows(ref, b.logits(b.forward(torch.tensor(suffix), ws, start=40)))
        assert abs(float(rows.mean()) - float(prof.kl[s, e])) < 1e-5
        assert abs(float(rows[6:].mean()) - float(prof.kl_ans[s, e])) < 1e-5
    coarse = profile_prompt(a, b, context, suffix, num_answer=4, stride=2)  # ends at 2 and 4 only
    scored = {(s, e) for s in range(5) for e in range(5) if not torch.isnan(coarse.kl[s, e])}
    assert scored == {(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (0, 2), (0, 4), (2, 4)}
    assert all(abs(float(coarse.kl[s, e] - prof.kl[s, e])) < 1e-6 for s, e in scored)
    coarse_table = ProfileTable.from_prompts("a", "b", [coarse])
    assert {(blk.start, blk.stop) for blk in coarse_table.blocks()} == {(0, 2), (0, 4), (2, 4)}
    assert coarse_table.best_of_size(1) is None and coarse_table.nearest_of_size(1).num_layers == 2
    selfprof = profile_prompt(a, a, context, suffix, num_answer=4)
    assert float(selfprof.kl.nan_to_num(0).abs().max()) < 1e-6  # a model reusing itself loses nothing anywhere
    table = ProfileTable.from_prompts("a", "b", [prof, prof])
    assert table.gap_closed(Block(0, 4)) == (1.0, 1.0) and table.gap_closed(Block(0, 0)) == (0.0, 0.0)
    chosen = table.choose(0.9)
    assert min(table.gap_closed(chosen)) >= 0.9
    smaller = [blk for blk in table.blocks() if blk.num_layers < chosen.num_layers]
    assert all(min(table.gap_closed(blk)) < 0.9 for blk in smaller)
    assert table.best_of_size(0) == Block(0, 0) and table.best_of_size(4) == Block(0, 4)
    assert ProfileTable.from_json(table.to_json()).to_json() == table.to_json()  # NaN below the diagonal
    with pytest.raises(ValueError):
        ProfileTable.from_json(table.to_json().replace('"num_layers": 4', '"num_layers": 5'))


# ---- models: family declarations and the fine-tune recipe ----------------------------------------------------
def test_model_families_are_declared_by_builtins_siblings_and_markers(tmp_path):
    from kvfabric.engines.finetune import FINETUNED_MODELS
    from kvfabric.engines.model import MARKER, model_family
    assert model_family("smollm2-135m-instruct") == model_family("smollm2-135m-musique") == "smollm2-135m"
    assert FINETUNED_MODELS["smollm2-135m-musique"].base == "smollm2-135m-instruct"
    assert model_family("qwen2.5-coder-0.5b") == model_family("qwen2.5-coder-1.5b") == "qwen2.5-coder"
    assert model_family(tmp_path) is None  # a folder that declares nothing
    (tmp_path / MARKER).write_text('{"name": "x", "family": "fam"}')
    assert model_family(tmp_path) == "fam"


def test_finetune_text_is_the_first_questions_passages_once(tmp_path, monkeypatch):
    import json

    from kvfabric.engines.finetune import FINETUNED_MODELS, training_text
    examples = [{"ctxs": [{"title": f"t{i}", "text": "same"}, {"title": "t0", "text": "same"}]} for i in range(150)]
    (tmp_path / "musique_s.json").write_text(json.dumps(examples))
    monkeypatch.setenv("KVFABRIC_DATA_DIR", str(tmp_path))
    text = training_text(FINETUNED_MODELS["smollm2-135m-musique"])
    assert text == "".join(f"t{i}\nsame\n\n" for i in range(100))  # questions 0-99, each passage once


def test_a_sibling_built_by_an_older_recipe_is_rebuilt(tmp_path, monkeypatch):
    """setup-model of a fine-tuned sibling: a folder built by today's recipe is reused, one whose recorded recipe
    differs (e.g. the 24-step one) is rebuilt. The 25-minute build itself is replaced by a stand-in here."""
    import json

    from kvfabric.engines import finetune, model
    from kvfabric.engines.finetune import FINETUNED_MODELS
    monkeypatch.setenv("KVFABRIC_HOME", str(tmp_path))
    monkeypatch.setattr(model, "ensure_model", lambda name=None: tmp_path / "base")
    builds = []

    def stand_in(name, base_dir, out):
        builds.append(name)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(finetune, "build_finetuned", stand_in)
    name = "smollm2-135m-musique"
    dest = model._setup_finetuned(name)
    assert builds == [name] and model._setup_finetuned(name) == dest and builds == [name]  # built once
    meta = json.loads((dest / model.MARKER).read_text())
    assert meta["recipe"]["steps"] == FINETUNED_MODELS[name].steps
    meta["recipe"]["steps"] = 24  # as a folder built before the recipe changed records it
    (dest / model.MARKER).write_text(json.dumps(meta))
    assert model._setup_finetuned(name) == dest and builds == [name, name]


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


def test_finetune_training_is_seeded_and_leaves_the_embedding_alone():
    """`train`: the same recipe and windows give the same weights; the input embedding never moves, the layers do."""
    from kvfabric.engines.finetune import FINETUNED_MODELS, train
    recipe = dataclasses.replace(FINETUNED_MODELS["smollm2-135m-musique"], steps=3, warmup=1, seq_len=16, threads=1)
    windows = torch.randint(0, 128, (5, 16), generator=torch.Generator().manual_seed(1))
    base = tiny_model(0).state_dict()
    runs = []
    for _ in range(2):
        model = tiny_model(0)
        losses = train(model, windows, recipe)
        assert len(losses) == 3 and not model.training
        runs.append(model.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in base)
    emb = "model.embed_tokens.weight"
    assert torch.equal(runs[0][emb], base[emb])
    assert not torch.equal(runs[0]["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])


def test_heldout_passages_are_not_training_passages(tmp_path, monkeypatch):
    import json

    from kvfabric.engines.finetune import FINETUNED_MODELS, heldout_texts
    examples = [{"ctxs": [{"title": f"t{i}", "text": "x"}, {"title": "t0", "text": "x"}]} for i in range(150)]
    (tmp_path / "musique_s.json").write_text(json.dumps(examples))
    monkeypatch.setenv("KVFABRIC_DATA_DIR", str(tmp_path))
    # questions 110-119: their own passage is new, the shared "t0" passage was trained on
    assert heldout_texts(FINETUNED_MODELS["smollm2-135m-musique"], 110, 10) == [f"t{i}\nx" for i in range(110, 120)]


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
