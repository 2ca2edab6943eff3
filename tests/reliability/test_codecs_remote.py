"""Codecs on every remote tier: CacheGen (lossless level 0 and the default lossy level) and int8 chunks stored
through Redis (single server and cluster), shm and a peer, then read back by another engine: the tier really
holds that codec's encoding (its header says so: nothing silently skipped or stored raw), and what comes back is
exactly the stored values (lossless) or exactly the codec's own decode of them (lossy)."""
from __future__ import annotations

import os
import random

import pytest
import torch

from kvfabric import Config, KVLayout
from kvfabric.cache.builder import build_engine
from kvfabric.codec.format import parse
from kvfabric.codec.registry import parse_codec
from kvfabric.config import ClusterConfig, CpuTierConfig, RedisTierConfig, ShmTierConfig
from kvfabric.tiers.shm import ShmTier
from tests.cluster_scripts.helpers import ControllerThread, wait_for
from tests.redis_fixtures import needs_redis, redis_cluster, redis_server  # noqa: F401 - fixtures
from tests.reliability.harness import report

pytestmark = pytest.mark.slow
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")
CHUNK = 64
CODECS = ("cachegen:0", "cachegen", "int8")


def expected(spec: str, kv: torch.Tensor, keys: list[bytes]) -> torch.Tensor:
    """What a reader must get: the values themselves (lossless) or the codec's own decode of each chunk."""
    codec = parse_codec(spec).make()
    kv = kv.to(LAYOUT.torch_dtype)
    if codec.is_lossless:
        return kv
    parts = []
    for i, key in enumerate(keys):
        chunk = kv[:, :, :, i * CHUNK:(i + 1) * CHUNK, :].contiguous()
        blob = codec.encode(chunk, key, LAYOUT)
        out = torch.empty(LAYOUT.shape(CHUNK), dtype=LAYOUT.torch_dtype)
        codec.decode(parse(blob, key), memoryview(blob), LAYOUT, out)
        parts.append(out)
    return torch.cat(parts, dim=3)


def kv_values(num_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(LAYOUT.shape(num_tokens), generator=gen) * 2).to(LAYOUT.torch_dtype)


def check_round_trip(writer_config: Config, reader_config: Config, tier: str, spec: str, label: str = "") -> None:
    start = 1000 * (1 + CODECS.index(spec)) + 100_000 * len(label or tier)  # fresh chunks for each case
    TOKENS = list(range(start, start + 4 * CHUNK))
    kv = kv_values(len(TOKENS))
    with build_engine(writer_config, LAYOUT, "m") as writer:
        assert writer.store(TOKENS, kv) == 4
        writer.flush()
        keys = writer.keys(TOKENS)
        held = writer._tier(tier) if tier != "peer" else writer._tier("cpu")
        blobs = [held.get(key) for key in keys]
        assert all(blob is not None for blob in blobs), f"{spec} chunks missing from {tier}"
        assert {parse(blob, key).codec_id for blob, key in zip(blobs, keys)} == {parse_codec(spec).make().codec_id}
        with build_engine(reader_config, LAYOUT, "m") as reader:
            if tier == "peer":
                wait_for(lambda: reader.lookup(TOKENS) == len(TOKENS), 30)
            got = reader.retrieve(TOKENS)
            hits = reader.stats().counters.get(f"hit.{tier}", 0)
    assert got.shape[3] == len(TOKENS) and hits == 4
    assert torch.equal(got, expected(spec, kv, keys)), f"{spec} through {tier} is not exact"
    report(f"codec {spec} through {label or tier}", None, chunks=4, wrong=0, hangs=0, exact=True, recovery_s=0.0)


@needs_redis
@pytest.mark.parametrize("spec", CODECS)
def test_codec_through_redis(spec, redis_server):  # noqa: F811
    redis = RedisTierConfig(url=redis_server.url, codec=spec)
    write = Config(chunk_size=CHUNK, tiers=("cpu", "redis"), redis=redis)
    read = Config(chunk_size=CHUNK, tiers=("redis",), redis=redis)
    check_round_trip(write, read, "redis", spec)


@needs_redis
@pytest.mark.parametrize("spec", CODECS)
def test_codec_through_redis_cluster(spec, redis_cluster):  # noqa: F811
    redis = RedisTierConfig(url=redis_cluster.url, is_cluster=True, codec=spec)
    write = Config(chunk_size=CHUNK, tiers=("cpu", "redis"), redis=redis)
    read = Config(chunk_size=CHUNK, tiers=("redis",), redis=redis)
    check_round_trip(write, read, "redis", spec, "redis cluster (3 nodes)")


@pytest.mark.parametrize("spec", CODECS)
def test_codec_through_shm(spec):
    name = f"codec-{os.getpid()}-{random.randrange(1 << 30)}"
    shm = ShmTierConfig(name=name, capacity=16 << 20, codec=spec)
    try:
        check_round_trip(Config(chunk_size=CHUNK, tiers=("cpu", "shm"), shm=shm),
                         Config(chunk_size=CHUNK, tiers=("shm",), shm=shm), "shm", spec)
    finally:
        ShmTier.destroy(name)


@pytest.mark.parametrize("spec", CODECS)
def test_codec_through_a_peer(spec):
    from kvfabric.cluster.controller_app import create_app
    controller = ControllerThread(create_app(token="t", instance_ttl_s=30)).start()
    try:
        def config(name: str, codec: str) -> Config:
            return Config(chunk_size=CHUNK, tiers=("cpu", "peer"), cpu=CpuTierConfig(capacity=1 << 24, codec=codec),
                          cluster=ClusterConfig(controller_url=controller.url, token="t", instance_id=name,
                                                report_interval_s=0.05, lookup_ttl_s=0.1))
        check_round_trip(config("writer", spec), config("reader", ""), "peer", spec)
    finally:
        controller.stop()
