"""cachegen's shipped per-model profiles: one per test model, matching its layout; the per-layout default level."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfabric.codec.cachegen import CacheGenCodec
from kvfabric.codec.cachegen import profile as P
from kvfabric.codec.cachegen import wire as W
from kvfabric.codec.format import parse
from kvfabric.kv.layout import KVLayout

KEY = bytes(range(32))
GEMMA_TYPES = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)]
LAYOUTS = {  # the layouts engines.runtime.layout_for gives these models' configs
    "smollm2-135m-instruct": KVLayout(30, 3, 64),
    "gemma3-270m": KVLayout.from_layer_types(GEMMA_TYPES, 1, 256, 512),
    "qwen2.5-coder-0.5b": KVLayout(24, 2, 64),
    "qwen2.5-coder-1.5b": KVLayout(28, 2, 128),
}


@pytest.mark.parametrize("model", LAYOUTS)
def test_each_model_ships_a_profile_for_its_layout(model):
    layout = LAYOUTS[model]
    prof = P.for_layout(layout)
    assert prof is not None, f"no profile for {model} ({layout.fingerprint.hex()})"
    assert (P.TABLES / f"profile_{layout.fingerprint.hex()}.npz").is_file()
    assert prof.meta["model"].startswith(model) and prof.fingerprint == layout.fingerprint
    assert prof.e_base.shape == (2 * layout.num_layers, layout.num_kv_heads * layout.head_dim)
    assert set(prof.meta["genres"]) >= {"prose", "code"}  # calibrated on a genre mix, not one corpus
    assert 1 <= P.default_level(layout) <= W.MAX_LEVEL and prof.id != 0
    assert (P.TABLES / f"profile_{layout.fingerprint.hex()}.npz").stat().st_size < 400_000


def test_default_level_comes_from_the_profile_and_is_what_a_level_free_codec_codes(monkeypatch, tmp_path):
    layout = KVLayout(2, 1, 8, "float16")
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(layout.shape(64), generator=g).numpy() for _ in range(2)]
    prof = P.build(layout, np.full((2, 2, 1, 8), 1e-2), chunks, meta={"model": "m"})
    assert P.default_level(layout) == W.DEFAULT_LEVEL  # nothing shipped for this layout
    leveled = P.with_default_level(prof, 3)
    assert leveled.id == prof.id and leveled.meta == {"model": "m", "default_level": 3}
    P.save(leveled, tmp_path / "p.npz")
    monkeypatch.setattr(P, "shipped", lambda: {layout.fingerprint: P.load(tmp_path / "p.npz")})
    assert P.default_level(layout) == 3
    kv = torch.from_numpy(chunks[0]).half()
    auto, fixed = CacheGenCodec(threads=1), CacheGenCodec(3, threads=1)
    blob = auto.encode(kv, KEY, layout)
    assert parse(blob, KEY).level == 3 and bytes(blob) == bytes(fixed.encode(kv, KEY, layout))
    assert parse(CacheGenCodec(5, threads=1).encode(kv, KEY, layout), KEY).level == 5  # an explicit level wins
    with pytest.raises(ValueError):
        P.with_default_level(prof, 0)


def test_profile_cachegen_default_command_keeps_the_id(tmp_path):
    from click.testing import CliRunner

    from kvfabric.apps.cli import main
    layout = KVLayout(2, 1, 8, "float16")
    prof = P.build(layout, np.full((2, 2, 1, 8), 1e-2), [np.zeros(layout.shape(16), np.float32)], meta={})
    P.save(prof, tmp_path / "p.npz")
    result = CliRunner().invoke(main, ["profile", "cachegen-default", str(tmp_path / "p.npz"), "4"])
    assert result.exit_code == 0, result.output
    again = P.load(tmp_path / "p.npz")
    assert again.id == prof.id and again.meta["default_level"] == 4
