"""KVLayout and its layer groups: validation, the fingerprint (what keeps layouts apart), the window rule."""
from __future__ import annotations

import pytest
import torch

from kvfabric import CacheEngine, Config
from kvfabric.cache.protocol import ChunkMiss
from kvfabric.codec.raw import RawCodec
from kvfabric.kv.hashing import root_key
from kvfabric.kv.layout import KVLayout, LayerGroup

GEMMA_TYPES = ["sliding_attention"] * 5 + ["full_attention"]  # Gemma 3's pattern, 6 layers here


def gemma_like(window: int = 8, dtype: str = "float32") -> KVLayout:
    return KVLayout.from_layer_types(GEMMA_TYPES, 1, 4, window, dtype)


def test_groups_from_layer_types():
    layout = gemma_like()
    assert [(g.layers, g.window) for g in layout.groups] == [((5,), 0), ((0, 1, 2, 3, 4), 8)]
    assert layout.window_groups == (layout.groups[1],)
    assert layout.shape(3) == (6, 2, 1, 3, 4)  # one tensor per chunk, as for plain layouts


def test_all_full_attention_is_the_plain_layout():
    """Qwen2 / Llama configs list only full_attention layers: same value and fingerprint as before groups."""
    grouped = KVLayout.from_layer_types(["full_attention"] * 4, 2, 8, None, "float16")
    assert grouped == KVLayout(4, 2, 8, "float16") and grouped.groups == ()
    assert grouped.fingerprint == KVLayout(4, 2, 8, "float16").fingerprint


def test_fingerprint_names_the_group_map_and_window():
    base = gemma_like()
    others = [gemma_like(window=16), KVLayout(6, 1, 4, "float32"),
              KVLayout.from_layer_types(GEMMA_TYPES[::-1], 1, 4, 8, "float32"),  # same counts, other layers
              gemma_like(dtype="float16")]
    prints = {base.fingerprint, *(o.fingerprint for o in others)}
    assert len(prints) == 5
    assert gemma_like().fingerprint == base.fingerprint  # stable for equal values


@pytest.mark.parametrize("groups, message", [
    ((LayerGroup((0, 1), 1, 4),), "cover layers 0..2"),  # layer 2 missing
    ((LayerGroup((0, 1, 2), 1, 4), LayerGroup((2,), 1, 4, 8)), "cover layers"),  # layer 2 twice
    ((LayerGroup((0, 1), 1, 4), LayerGroup((2,), 2, 4, 8)), "per-group KV shapes"),
])
def test_bad_groups_are_refused_at_construction(groups, message):
    with pytest.raises(ValueError, match=message):
        KVLayout(3, 1, 4, "float32", groups)


@pytest.mark.parametrize("kwargs", [dict(layers=()), dict(layers=(2, 1)), dict(window=-1), dict(num_kv_heads=0)])
def test_bad_group_values(kwargs):
    args = dict(layers=(0,), num_kv_heads=1, head_dim=4, window=0) | kwargs
    with pytest.raises(ValueError):
        LayerGroup(**args)


def test_unknown_attention_kinds_are_refused():
    with pytest.raises(ValueError, match="linear_attention"):
        KVLayout.from_layer_types(["full_attention", "linear_attention"], 1, 4, None)
    with pytest.raises(ValueError, match="sliding window"):
        KVLayout.from_layer_types(["sliding_attention"], 1, 4, None)


def test_window_rule_keeps_w_minus_1_rows():
    """A query at q reads q-W < p <= q; continuing after N tokens reads positions [N-W+1, N): W-1 rows."""
    layout = gemma_like(window=8)
    window = layout.window_groups[0]
    assert window.window_start(5) == 0 and window.window_start(8) == 1 and window.window_start(20) == 13
    assert 20 - window.window_start(20) == window.window - 1
    assert layout.groups[0].window_start(20) == 0  # full attention reads everything
    assert layout.stale_rows(7) == ()
    assert layout.stale_rows(20) == (((0, 1, 2, 3, 4), 13),)


def test_chunks_of_other_layouts_are_never_read(tmp_path):
    """Same model id, same shape, another group map: another key namespace, and a blob planted under the other
    layout's key is rejected by the header check (a wrong_layout miss), never decoded as ours."""
    ours, theirs = gemma_like(), KVLayout(6, 1, 4, "float32")
    assert root_key("m", ours, 4) != root_key("m", theirs, 4)
    tokens = list(range(16))
    kv = torch.randn(ours.shape(16), generator=torch.Generator().manual_seed(0))
    config = Config(chunk_size=4, tiers=("cpu",))
    with CacheEngine(config, theirs, "m") as plain, CacheEngine(config, ours, "m") as grouped:
        assert plain.store(tokens, kv) == 4
        assert grouped.lookup(tokens) == 0  # other keys
        key = grouped.keys(tokens)[0]
        grouped.stack.tiers[0].put(key, RawCodec().encode(kv[:, :, :, :4], key, theirs))  # planted under our key
        assert grouped.read_chunk(key) == ChunkMiss("wrong_layout")
        assert grouped.store(tokens, kv) == 4
        got = grouped.retrieve(tokens)
        # window layers read positions >= 9 after 16 tokens: chunks 0-1 of them are not loaded, left zero
        assert torch.equal(got[5], kv[5]) and torch.equal(got[:5, :, :, 8:], kv[:5, :, :, 8:])
        assert not got[:5, :, :, :8].any()


def test_layout_for_reads_transformers_configs():
    """Gemma 3's default config (window every layer but each 6th) and Qwen2 with and without its sliding window."""
    from transformers import Gemma3TextConfig, Qwen2Config

    from kvfabric.engines.runtime import layout_for
    gemma = layout_for(Gemma3TextConfig(num_hidden_layers=12, sliding_window=512, num_key_value_heads=1,
                                        head_dim=256), "float32")
    assert [(g.layers, g.window) for g in gemma.groups] == [((5, 11), 0), ((0, 1, 2, 3, 4, 6, 7, 8, 9, 10), 512)]
    assert (gemma.num_kv_heads, gemma.head_dim) == (1, 256)
    plain = layout_for(Qwen2Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_size=256))
    assert plain == KVLayout(4, 2, 64, "float16")
    windowed = layout_for(Qwen2Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      hidden_size=256, use_sliding_window=True, sliding_window=128,
                                      max_window_layers=2))
    assert windowed.fingerprint != plain.fingerprint and windowed.window_groups[0].window == 128


def test_layout_for_refuses_an_mla_config():
    """transformers caches DeepSeek-V2's K (192 wide) and V (128) decompressed: no KVLayout of it; the vLLM
    connector stores its latents (connectors/vllm/config.layout_from_vllm)."""
    from transformers import DeepseekV2Config

    from kvfabric.engines.runtime import layout_for
    with pytest.raises(ValueError, match="multi-head latent attention"):
        layout_for(DeepseekV2Config(num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64))


def test_a_latent_layout_holds_one_vector_per_token():
    """MLA (DeepSeek-V2/V3 in vLLM's MLA backends): [L, 1, 1, T, D], a fingerprint of its own (test vector: what
    stored latent chunks are named by), one head slot, no window groups."""
    latent = KVLayout(2, 1, 576, "bfloat16", is_latent=True)
    assert latent.shape(10) == (2, 1, 1, 10, 576) and latent.num_states == 1
    assert latent.num_bytes(10) == 2 * 10 * 576 * 2
    assert latent.fingerprint.hex() == "96688dcacbea9cf0"
    assert KVLayout(2, 1, 576, "bfloat16").fingerprint.hex() == "55ef7917e1d74569"  # K|V: unchanged by the field
    assert latent.part((1,)).is_latent and latent.part((1,)).shape(3) == (1, 1, 1, 3, 576)
    latent.check(torch.zeros(2, 1, 1, 4, 576))
    with pytest.raises(ValueError, match=r"\[layers, 1 \(latent\), kv_heads"):
        latent.check(torch.zeros(2, 2, 1, 4, 576))
    with pytest.raises(ValueError, match="one head slot"):
        KVLayout(2, 2, 576, "bfloat16", is_latent=True)
    with pytest.raises(ValueError, match="no window groups"):
        KVLayout(2, 1, 576, "bfloat16", groups=(LayerGroup((0,), 1, 576, 64), LayerGroup((1,), 1, 576)), is_latent=True)


def test_latent_and_kv_chunks_never_read_as_each_other():
    """Same bytes per token (a K|V layout of D/2 per state): the fingerprint keeps them apart, a miss either way."""
    latent, kv = KVLayout(2, 1, 16, "float16", is_latent=True), KVLayout(2, 1, 8, "float16")
    assert latent.num_bytes(32) == kv.num_bytes(32)
    tokens = list(range(32))
    config = Config(chunk_size=32, tiers=("cpu",))
    with CacheEngine(config, latent, "m") as mla, CacheEngine(config, kv, "m") as plain:
        assert mla.store(tokens, torch.ones(latent.shape(32), dtype=torch.float16)) == 1
        assert mla.retrieve(tokens).shape == (2, 1, 1, 32, 16)
        (key,) = plain.keys(tokens)
        assert key != mla.keys(tokens)[0]
        plain.stack.tiers[0].put(key, RawCodec().encode(torch.ones(latent.shape(32)), key, latent))  # planted
        assert plain.read_chunk(key) == ChunkMiss("wrong_layout")


@pytest.mark.parametrize("settings", [{"codec": "cachegen"}, {"codec": "video:0"},
                                      {"tiers": ["cpu", "disk"], "disk": {"codec": "cachegen:3"}}])
def test_a_codec_of_k_and_v_is_refused_for_a_latent_layout_before_any_tier_is_made(tmp_path, settings):
    from kvfabric.config import ConfigError

    settings = {**settings, **({"disk": {**settings["disk"], "path": str(tmp_path / "d")}} if "disk" in settings
                                else {})}
    with pytest.raises(ConfigError, match=r"^codec: (cachegen|video) codes K and V; .* raw or int8$"):
        CacheEngine(Config.from_dict(settings), KVLayout(2, 1, 576, "bfloat16", is_latent=True), "m")
    assert not (tmp_path / "d").exists()
    with CacheEngine(Config.from_dict({"codec": "int8"}), KVLayout(2, 1, 576, "bfloat16", is_latent=True), "m"):
        pass
