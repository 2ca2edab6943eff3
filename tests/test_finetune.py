"""The fine-tuned DroidSpeak sibling (kvfabric.research.finetune): its recipe's data, seeded training, and its build
through the runtime's derived-model call (engines.model.ensure_derived): set up once, rebuilt by a new recipe, then
found by name (and family) by the runtime alone."""
from __future__ import annotations

import dataclasses

import torch

from kvfabric.research import finetune
from kvfabric.research.finetune import FINETUNED_MODELS, heldout_texts, train, training_text
from tests.test_droidspeak import tiny_model


def test_model_families_are_declared_by_builtins_siblings_and_markers(tmp_path):
    from kvfabric.engines.gguf import MARKER
    from kvfabric.engines.model import model_family
    assert model_family("smollm2-135m-instruct") == finetune.DERIVED["smollm2-135m-musique"].family == "smollm2-135m"
    assert FINETUNED_MODELS["smollm2-135m-musique"].base == "smollm2-135m-instruct"
    assert model_family("qwen2.5-coder-0.5b") == model_family("qwen2.5-coder-1.5b") == "qwen2.5-coder"
    assert model_family(tmp_path) is None  # a folder that declares nothing
    (tmp_path / MARKER).write_text('{"name": "x", "family": "fam"}')
    assert model_family(tmp_path) == "fam"


def test_finetune_text_is_the_first_questions_passages_once(tmp_path, monkeypatch):
    import json

    examples = [{"ctxs": [{"title": f"t{i}", "text": "same"}, {"title": "t0", "text": "same"}]} for i in range(150)]
    (tmp_path / "musique_s.json").write_text(json.dumps(examples))
    monkeypatch.setenv("KVFABRIC_DATA_DIR", str(tmp_path))
    text = training_text(FINETUNED_MODELS["smollm2-135m-musique"])
    assert text == "".join(f"t{i}\nsame\n\n" for i in range(100))  # questions 0-99, each passage once


def test_a_sibling_built_by_an_older_recipe_is_rebuilt(tmp_path, monkeypatch):
    """setup-model of a fine-tuned sibling: a folder built by today's recipe is reused, one whose recorded recipe
    differs (e.g. the 24-step one) is rebuilt. The 25-minute build itself is replaced by a stand-in here."""
    import json

    from kvfabric.engines import model
    monkeypatch.setenv("KVFABRIC_HOME", str(tmp_path))
    monkeypatch.setattr(model, "ensure_model", lambda name=None: tmp_path / "base")
    builds = []

    def stand_in(name, base_dir, out):
        builds.append(name)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(finetune, "build_finetuned", stand_in)
    name = "smollm2-135m-musique"
    assert model._built(name) is None and model.model_family(name) is None  # not built: the runtime knows nothing
    dest = finetune.ensure_finetuned(name)
    assert builds == [name] and finetune.ensure_finetuned(name) == dest and builds == [name]  # built once
    assert model._built(name) == dest and model.model_family(name) == "smollm2-135m"  # ensure_model finds it now
    meta = json.loads((dest / model.MARKER).read_text())
    assert meta["recipe"]["steps"] == FINETUNED_MODELS[name].steps
    meta["recipe"]["steps"] = 24  # as a folder built before the recipe changed records it
    (dest / model.MARKER).write_text(json.dumps(meta))
    assert finetune.ensure_finetuned(name) == dest and builds == [name, name]


def test_finetune_training_is_seeded_and_leaves_the_embedding_alone():
    """`train`: the same recipe and windows give the same weights; the input embedding never moves, the layers do."""
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

    examples = [{"ctxs": [{"title": f"t{i}", "text": "x"}, {"title": "t0", "text": "x"}]} for i in range(150)]
    (tmp_path / "musique_s.json").write_text(json.dumps(examples))
    monkeypatch.setenv("KVFABRIC_DATA_DIR", str(tmp_path))
    # questions 110-119: their own passage is new, the shared "t0" passage was trained on
    assert heldout_texts(FINETUNED_MODELS["smollm2-135m-musique"], 110, 10) == [f"t{i}\nx" for i in range(110, 120)]
