"""CacheEngine: lookup / store / retrieve over real cpu and disk tiers."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvfabric import CacheEngine, Config, KVLayout
from kvfabric.config import DiskTierConfig

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32")


@pytest.fixture
def config(tmp_path):
    return Config(chunk_size=16, disk=DiskTierConfig(path=str(tmp_path / "chunks")))


def make_kv(num_tokens: int, seed: int = 0, layout: KVLayout = LAYOUT) -> torch.Tensor:
    return torch.randn(layout.shape(num_tokens), generator=torch.Generator().manual_seed(seed))


def test_store_lookup_retrieve_exact(config):
    tokens, kv = list(range(100)), make_kv(100)
    with CacheEngine(config, LAYOUT, "m") as engine:
        assert engine.lookup(tokens) == 0
        assert engine.store(tokens, kv) == 6
        assert engine.lookup(tokens) == 96
        assert engine.lookup(tokens[:40]) == 32
        got = engine.retrieve(tokens[:96])
        assert torch.equal(got, kv[:, :, :, :96])
        assert engine.store(tokens, kv) == 0  # nothing new


def test_store_with_offset_and_into_out_buffer(config):
    tokens, kv = list(range(64)), make_kv(64)
    with CacheEngine(config, LAYOUT, "m") as engine:
        engine.store(tokens[:32], kv[:, :, :, :32])
        assert engine.store(tokens, kv[:, :, :, 32:], start=32) == 2
        out = torch.full(LAYOUT.shape(80), 7.0)
        got = engine.retrieve(tokens, out=out)
        assert got.shape[3] == 64 and got.data_ptr() == out.data_ptr()
        assert torch.equal(out[:, :, :, :64], kv) and (out[:, :, :, 64:] == 7).all()


def test_divergent_prompts_share_only_common_chunks(config):
    a = list(range(64))
    b = a[:40] + [999] * 24
    with CacheEngine(config, LAYOUT, "m") as engine:
        engine.store(a, make_kv(64))
        assert engine.lookup(b) == 32


def test_partial_chunk(tmp_path):
    config = Config(chunk_size=16, save_partial_chunk=True, disk=DiskTierConfig(path=str(tmp_path)))
    tokens, kv = list(range(40)), make_kv(40)
    with CacheEngine(config, LAYOUT, "m") as engine:
        assert engine.store(tokens, kv) == 3
        assert engine.lookup(tokens) == 40
        assert torch.equal(engine.retrieve(tokens), kv)
        assert engine.lookup(tokens + [1]) == 32  # 33..41 is another partial chunk


def test_fp16_layout_converts(config):
    layout = KVLayout(3, 2, 8, "float16")
    tokens, kv = list(range(32)), make_kv(32, layout=layout)
    with CacheEngine(config, layout, "m") as engine:
        engine.store(tokens, kv)
        out = torch.empty(layout.shape(32), dtype=torch.float32)
        assert torch.equal(engine.retrieve(tokens, out=out), kv.half().float())


def test_corrupt_disk_chunk_is_a_miss_counted_and_removed(config):
    tokens, kv = list(range(64)), make_kv(64)
    with CacheEngine(config, LAYOUT, "m") as engine:
        engine.store(tokens, kv)
        engine.flush()
        keys = engine.keys(tokens)
    engine = CacheEngine(Config(chunk_size=16, tiers=("disk",), disk=config.disk), LAYOUT, "m")
    path = engine.stack.tiers[0].path(keys[2])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert engine.lookup(tokens) == 64  # lookup reads no data
    got = engine.retrieve(tokens)
    assert got.shape[3] == 32 and torch.equal(got, kv[:, :, :, :32])
    assert engine.stats()["counters"]["corrupt.disk"] == 1
    assert engine.lookup(tokens) == 32
    engine.close()


def test_other_model_or_layout_never_hits(config):
    tokens, kv = list(range(32)), make_kv(32)
    with CacheEngine(config, LAYOUT, "m") as engine:
        engine.store(tokens, kv)
        engine.flush()
    with CacheEngine(config, LAYOUT, "other-model") as engine:
        assert engine.lookup(tokens) == 0
    with CacheEngine(config, KVLayout(3, 2, 8, "float16"), "m") as engine:
        assert engine.lookup(tokens) == 0
    with CacheEngine(Config(chunk_size=16, salt="tenant-b", disk=config.disk), LAYOUT, "m") as engine:
        assert engine.lookup(tokens) == 0


def test_bad_arguments_raise(config):
    with CacheEngine(config, LAYOUT, "m") as engine:
        with pytest.raises(ValueError, match="shape"):
            engine.store(list(range(16)), torch.zeros(3, 2, 2, 16, 4))
        with pytest.raises(ValueError, match="start"):
            engine.store(list(range(32)), make_kv(16), start=3)
        with pytest.raises(ValueError, match="beyond"):
            engine.store(list(range(16)), make_kv(32))
        with pytest.raises(ValueError, match="out must be"):
            engine.retrieve(list(range(32)), out=torch.empty(LAYOUT.shape(16)))


def test_eviction_during_retrieve_keeps_pinned_chunks(config):
    small = Config(chunk_size=16, tiers=("cpu",), cpu=type(config.cpu)(capacity=LAYOUT.num_bytes(16) * 3 + 400))
    tokens, kv = list(range(48)), make_kv(48)
    with CacheEngine(small, LAYOUT, "m") as engine:
        engine.store(tokens, kv)
        keys = engine.keys(tokens)
        with engine.stack.pinned(keys):
            engine.store(list(range(1000, 1048)), make_kv(48, seed=1))  # would evict all of `tokens`
            assert engine.stack.prefix_length(keys) == 3
        assert torch.equal(engine.retrieve(tokens), kv)


def test_reuse_across_processes(config):
    code = f"""
import torch
from kvfabric import CacheEngine, Config, KVLayout
from kvfabric.config import DiskTierConfig
layout = KVLayout(3, 2, 8, "float32")
kv = torch.randn(layout.shape(64), generator=torch.Generator().manual_seed(3))
with CacheEngine(Config(chunk_size=16, disk=DiskTierConfig(path={config.disk.path!r})), layout, "m") as e:
    e.store(list(range(64)), kv)
"""
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONHASHSEED": "77", "PATH": "/usr/bin"})
    with CacheEngine(config, LAYOUT, "m") as engine:
        assert engine.lookup(list(range(64))) == 64
        assert torch.equal(engine.retrieve(list(range(64))), make_kv(64, seed=3))


def test_per_tier_codec_keeps_memory_raw_and_disk_compressed(tmp_path):
    """cpu keeps raw chunks, disk gets cachegen ones; a fresh engine reads the compressed copy within the codec's
    error bound, and the engine's own codec is untouched."""
    from kvfabric.codec.format import parse
    from kvfabric.config import CpuTierConfig
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16")
    disk = DiskTierConfig(path=str(tmp_path / "chunks"), codec="cachegen:3")
    config = Config(chunk_size=32, disk=disk, cpu=CpuTierConfig(codec=""))
    tokens, kv = list(range(64)), make_kv(64, layout=layout).to(torch.float16)
    with CacheEngine(config, layout, "m") as engine:
        engine.store(tokens, kv)
        engine.flush()
        key = engine.keys(tokens)[0]
        cpu_tier, disk_tier = engine.stack.tiers
        assert parse(cpu_tier.get(key), key).codec_id == 0
        disk_blob = disk_tier.get(key)
        assert parse(disk_blob, key).codec_id == 2 and len(disk_blob) < len(cpu_tier.get(key))
        assert torch.equal(engine.retrieve(tokens), kv)  # served raw from memory
    with CacheEngine(Config(chunk_size=32, tiers=("disk",), disk=disk), layout, "m") as engine:
        got = engine.retrieve(tokens)
        assert got.shape == kv.shape and not torch.equal(got, kv)
        assert float((got.float() - kv.float()).abs().max()) < 0.5  # lossy, but close
