"""The codec registry: every name, id and level round-trips through a real chunk; bad specs and ids are refused."""
from __future__ import annotations

import pytest
import torch

from kvfabric.codec import registry
from kvfabric.codec.cachegen import wire
from kvfabric.codec.format import ChunkFormatError, parse
from kvfabric.codec.registry import CodecChoice, CodecSpecError, codec_for_id, parse_codec
from kvfabric.config import Config, ConfigError, RedisTierConfig
from kvfabric.kv.layout import KVLayout

KEY = bytes(range(32))
LAYOUT = KVLayout(2, 1, 8, "float16")


@pytest.mark.parametrize("entry", registry.CODECS, ids=[e.name for e in registry.CODECS])
def test_every_name_id_and_level_round_trips(entry):
    kv = torch.randn(LAYOUT.shape(12), generator=torch.Generator().manual_seed(0)).half()
    assert parse_codec(entry.name) == CodecChoice(entry.name, None if entry.per_layout_default else entry.default_level)
    for level in entry.levels:
        choice = parse_codec(f"{entry.name}:{level}")
        assert choice == CodecChoice(entry.name, level)
        codec = choice.make()
        assert (codec.name, codec.codec_id) == (entry.name, entry.codec_id)
        blob = codec.encode(kv, KEY, LAYOUT)
        header = parse(blob, KEY)
        assert (header.codec_id, header.level) == (entry.codec_id, level)
        out = torch.empty(LAYOUT.shape(12))
        codec_for_id(header.codec_id).decode(header, memoryview(blob), LAYOUT, out)
        assert torch.isfinite(out).all()
        if codec.is_lossless:
            assert torch.equal(out, kv.float())


def test_cachegen_default_is_decided_per_layout_with_the_same_fallback():
    entry = registry.entry("cachegen")
    assert entry.per_layout_default and entry.default_level == wire.DEFAULT_LEVEL
    codec = entry.make()
    assert codec.level is None
    header = parse(codec.encode(torch.randn(LAYOUT.shape(12)).half(), KEY, LAYOUT), KEY)
    assert header.level == wire.DEFAULT_LEVEL  # no profile for this layout: the fallback


def test_ids_and_names_are_unique_and_defaults_in_range():
    ids = [e.codec_id for e in registry.CODECS]
    names = [e.name for e in registry.CODECS]
    assert len(set(ids)) == len(ids) and len(set(names)) == len(names)
    assert ids == [0, 1, 2, 3] and names == ["raw", "int8", "cachegen", "video"]  # ids are forever
    assert all(e.default_level in e.levels for e in registry.CODECS)


def test_cachegen_stream_constants_agree_with_the_table():
    entry = registry.entry("cachegen")
    assert (wire.CODEC_ID, wire.MAX_LEVEL, wire.DEFAULT_LEVEL) == (entry.codec_id, entry.max_level,
                                                                   entry.default_level)


@pytest.mark.parametrize("codec_id", [4, 99, 255])
def test_unknown_id_is_a_chunk_format_error(codec_id):
    with pytest.raises(ChunkFormatError, match=f"codec id {codec_id}"):
        codec_for_id(codec_id)


def test_a_codec_whose_package_is_missing_reads_as_a_miss(monkeypatch):
    """A video chunk on a machine without PyAV: ChunkFormatError (the caller's miss), naming the codec."""
    real = registry.importlib.import_module

    def no_video(name, *args):
        if name == "kvfabric.codec.video":
            raise ImportError("No module named 'av'")
        return real(name, *args)
    monkeypatch.setattr(registry.importlib, "import_module", no_video)
    with pytest.raises(ChunkFormatError, match="video .id 3. is unavailable"):
        codec_for_id(3)
    with pytest.raises(ImportError):
        registry.parse_codec("video").make()  # choosing it in config: the ImportError itself, naming the package


@pytest.mark.parametrize("spec,allowed", [("zstd", "raw, int8, cachegen"), ("cachegen:10", "0..9"),
                                          ("int8:2", "0..1"), ("raw:1", "0..0"), ("cachegen:x", "0..9"),
                                          ("cachegen:-1", "0..9")])
def test_unknown_name_or_level_names_the_allowed_values(spec, allowed):
    with pytest.raises(CodecSpecError, match=allowed):
        parse_codec(spec)
    with pytest.raises(ConfigError, match=f"codec: .*{allowed}"):
        Config(codec=spec)
    with pytest.raises(ConfigError, match=f"redis.codec: .*{allowed}"):
        Config.from_dict({"redis": {"codec": spec}})
    assert RedisTierConfig(codec="").codec == ""  # "" = the engine's codec


def test_make_checks_the_level():
    entry = registry.entry("int8")
    assert entry.make().level == entry.default_level and entry.make(1).level == 1
    with pytest.raises(CodecSpecError, match="0..1"):
        entry.make(2)
