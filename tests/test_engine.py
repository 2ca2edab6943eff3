"""CacheEngine: lookup / store / retrieve, and the per-chunk calls (read_into, read_chunk, read_many, new_payload /
store_chunks) the vLLM connector uses, over real cpu and disk tiers."""
from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from kvfabric import CacheEngine, Config, KVLayout
from kvfabric.cache.protocol import ChunkHit, ChunkMiss, TokenSource
from kvfabric.codec.format import HEADER_BYTES, ChunkHeader, write_blob
from kvfabric.codec.raw import RawCodec, blob_bytes
from kvfabric.config import CpuTierConfig, DiskTierConfig, PlacementConfig
from kvfabric.host.pages import Scratch
from kvfabric.tiers.cpu import CpuTier
from kvfabric.tiers.disk import DiskTier

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32")


@pytest.fixture
def config(tmp_path):
    return Config(chunk_size=16, disk=DiskTierConfig(path=str(tmp_path / "chunks")))


def make_kv(num_tokens: int, seed: int = 0, layout: KVLayout = LAYOUT) -> torch.Tensor:
    return torch.randn(layout.shape(num_tokens), generator=torch.Generator().manual_seed(seed))


def read_kv(engine: CacheEngine, key: bytes) -> torch.Tensor | ChunkMiss:
    """read_chunk's KV copied out of its source (valid only inside its `with`), or its miss."""
    got = engine.read_chunk(key)
    if isinstance(got, ChunkMiss):
        return got
    assert isinstance(got, TokenSource)
    with got:
        return got.kv.clone()


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
    disk = DiskTier(config.disk.path, config.disk.capacity)
    engine = CacheEngine(Config(chunk_size=16, tiers=("disk",), disk=config.disk), LAYOUT, "m", tiers=[disk])
    path = disk.path(keys[2])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert engine.lookup(tokens) == 64  # lookup reads no data
    got = engine.retrieve(tokens)
    assert got.shape[3] == 32 and torch.equal(got, kv[:, :, :, :32])
    assert engine.stats().counters["corrupt.disk"] == 1
    assert engine.lookup(tokens) == 32
    engine.close()


def test_a_damaged_slow_chunk_is_checked_before_it_is_promoted(tmp_path):
    """retrieve hashes a slow tier's chunk on its own thread (after the next read started): a damaged one is never
    promoted into process memory, and a lower tier's good copy is served in its place."""
    tokens, kv = list(range(64)), make_kv(64)
    upper, lower = DiskTier(tmp_path / "upper", 1 << 30), DiskTier(tmp_path / "lower", 1 << 30)
    cpu = CpuTier(1 << 30)
    config = Config(chunk_size=16, tiers=("cpu", "disk"))
    with CacheEngine(config, LAYOUT, "m", tiers=[cpu, upper, lower]) as engine:
        engine.store(tokens, kv)
        engine.flush()
        keys = engine.keys(tokens)
        cpu.clear()
        path = upper.path(keys[1])
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        got = engine.retrieve(tokens)
        assert torch.equal(got, kv)
        counters = engine.stats().counters
        assert counters["corrupt.disk"] == 1 and counters["promoted"] == 4
        engine.flush()
        assert path.read_bytes() == lower.path(keys[1]).read_bytes()  # promoted from below: the good copy
        assert cpu.contains_many(keys) == [True] * 4
        for i, key in enumerate(keys):  # what process memory holds is the good copy
            got = engine.read_chunk(key)
            assert isinstance(got, TokenSource) and got.tier == "cpu"
            with got:
                assert torch.equal(got.kv, kv[:, :, :, 16 * i:16 * i + 16])


def test_tier_peer_needs_the_builder(config):
    """CacheEngine composes no cluster node itself (engine.py imports nothing from the cluster): a config with tier
    "peer" is built by build_engine, which makes the node."""
    peer = Config.from_dict({"chunk_size": 16, "tiers": ["cpu", "peer"],
                             "cluster": {"controller_url": "http://127.0.0.1:9"}})
    with pytest.raises(ValueError, match="build_engine"):
        CacheEngine(peer, LAYOUT, "m")


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
    cpu = CpuTier(blob_bytes(LAYOUT, 16) * 3 + 16)
    tokens, kv = list(range(48)), make_kv(48)
    with CacheEngine(Config(chunk_size=16, tiers=("cpu",)), LAYOUT, "m", tiers=[cpu]) as engine:
        engine.store(tokens, kv)
        keys = engine.keys(tokens)
        cpu.pin(keys)  # as retrieve does while it reads
        engine.store(list(range(1000, 1048)), make_kv(48, seed=1))  # would evict all of `tokens`
        assert engine.lookup(tokens) == 48
        cpu.unpin(keys)
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
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16")
    disk = DiskTierConfig(path=str(tmp_path / "chunks"), codec="cachegen:3")
    config = Config(chunk_size=32, disk=disk, cpu=CpuTierConfig(codec=""))
    tokens, kv = list(range(64)), make_kv(64, layout=layout).to(torch.float16)
    with CacheEngine(config, layout, "m") as engine:
        engine.store(tokens, kv)
        engine.flush()
        key = engine.keys(tokens)[0]
        hit = engine.read_chunk(key)
        assert isinstance(hit, TokenSource) and hit.tier == "cpu"
        with hit:
            assert torch.equal(hit.kv, kv[:, :, :, :32])
        assert hit.num_bytes == blob_bytes(layout, 32)  # raw in memory
        assert torch.equal(engine.retrieve(tokens), kv)  # served raw from memory
    files = sorted((tmp_path / "chunks").rglob("*.kvc"))
    assert len(files) == 2 and all(f.stat().st_size < hit.num_bytes / 2 for f in files)  # compressed on disk
    with CacheEngine(Config(chunk_size=32, tiers=("disk",), disk=disk), layout, "m") as engine:
        got = engine.retrieve(tokens)
        assert got.shape == kv.shape and not torch.equal(got, kv)
        assert float((got.float() - kv.float()).abs().max()) < 0.5  # lossy, but close


# ---- per-chunk calls (the vLLM connector's seam) ----------------------------------------------------------
def test_read_chunk_hit_names_its_tier(config):
    """read_chunk and read_into name the tier that served them; with placement.promote_chunk_reads a chunk read
    from a slower tier is copied up (off by default: the next test)."""
    tokens, kv = list(range(48)), make_kv(48)
    config = Config(chunk_size=16, disk=config.disk, placement=PlacementConfig(promote_chunk_reads=True))
    with CacheEngine(config, LAYOUT, "m") as engine:
        engine.store(tokens, kv)
        engine.flush()
        keys = engine.keys(tokens)
        hit = engine.read_chunk(keys[1])
        assert isinstance(hit, TokenSource) and hit.tier == "cpu" and hit.layers is None
        with hit:
            assert hit.num_bytes == blob_bytes(LAYOUT, 16) and torch.equal(hit.kv, kv[:, :, :, 16:32])
        out = torch.zeros(LAYOUT.shape(16), dtype=torch.float64)  # any float dtype
        into = engine.read_into(keys[2], out)
        assert into == ChunkHit("cpu", blob_bytes(LAYOUT, 16))
        assert torch.equal(out, kv[:, :, :, 32:48].double())
        engine.clear_tier("cpu")
        assert engine.tier_keys("cpu") == [] and engine.tier_usage("cpu").num_chunks == 0
        from_disk = engine.read_chunk(keys[0])
        assert isinstance(from_disk, TokenSource) and from_disk.tier == "disk"
        with from_disk:
            assert torch.equal(from_disk.kv, kv[:, :, :, :16])
        assert engine.tier_keys("cpu") == [keys[0]]  # promoted
        stats = engine.stats()
        assert stats.counters["hit.disk"] == 1 and stats.counters["hit.cpu"] == 2
        assert [usage.name for usage in stats.tiers] == ["cpu", "disk"] and stats.tiers[1].num_chunks == 3
        with pytest.raises(KeyError, match="redis"):
            engine.tier_keys("redis")


def test_read_chunk_without_out_is_a_view_over_the_callers_scratch(config):
    """A raw chunk read from a first tier that reads into buffers (disk) lands in the caller's scratch: no copy."""
    tokens, kv = list(range(32)), make_kv(32)
    with CacheEngine(config, LAYOUT, "m") as engine:
        engine.store(tokens, kv)
        engine.flush()
    with CacheEngine(Config(chunk_size=16, tiers=("disk",), disk=config.disk), LAYOUT, "m") as engine:
        scratch = Scratch()
        hit = engine.read_chunk(engine.keys(tokens)[1], scratch=scratch)
        assert isinstance(hit, TokenSource) and hit.tier == "disk"
        with hit:
            assert torch.equal(hit.kv, kv[:, :, :, 16:32])
            start = torch.frombuffer(scratch.view(hit.num_bytes), dtype=torch.uint8).data_ptr()
            assert hit.kv.data_ptr() == start + HEADER_BYTES


def test_read_chunk_without_promotion_reads_a_lower_tier_into_the_scratch(config):
    """By default (placement.promote_chunk_reads off: the vLLM connector's loads) a chunk on disk behind a
    process-memory tier is read into the caller's scratch and not copied into process memory."""
    tokens, kv = list(range(32)), make_kv(32)
    with CacheEngine(config, LAYOUT, "m") as engine:
        engine.store(tokens, kv)
        engine.flush()
        engine.clear_tier("cpu")
        scratch = Scratch()
        hit = engine.read_chunk(engine.keys(tokens)[1], scratch=scratch)
        assert isinstance(hit, TokenSource) and hit.tier == "disk"
        with hit:
            assert torch.equal(hit.kv, kv[:, :, :, 16:32])
            start = torch.frombuffer(scratch.view(hit.num_bytes), dtype=torch.uint8).data_ptr()
            assert hit.kv.data_ptr() == start + HEADER_BYTES
        assert engine.tier_keys("cpu") == []
        assert engine.chunk_blob_bytes() == hit.num_bytes


def _put_blob(cpu: CpuTier, key: bytes, header: ChunkHeader) -> None:
    blob = bytearray(HEADER_BYTES + header.payload_len)
    write_blob(header, blob)  # valid checksums: only the decoder can tell what is wrong
    cpu.put(key, blob)


def test_read_chunk_misses_say_why_and_bad_chunks_are_discarded():
    cpu = CpuTier(1 << 20)
    with CacheEngine(Config(chunk_size=16, tiers=("cpu",)), LAYOUT, "m", tiers=[cpu]) as engine:
        missing, corrupt, foreign, short = engine.keys(list(range(64)))
        assert engine.read_chunk(missing) == ChunkMiss("missing")
        # a raw chunk whose dtype is not the layout's: well-formed, but its payload cannot be this layout's KV
        _put_blob(cpu, corrupt, ChunkHeader(RawCodec.codec_id, 1, 0, LAYOUT.fingerprint, LAYOUT.shape(16), corrupt,
                                            LAYOUT.num_bytes(16)))
        other = KVLayout(3, 2, 4, "float32")
        cpu.put(foreign, RawCodec().encode(make_kv(16, layout=other), foreign, other))
        cpu.put(short, RawCodec().encode(make_kv(8), short, LAYOUT))  # 8 tokens where a chunk holds 16
        assert engine.read_chunk(corrupt) == ChunkMiss("corrupt")
        assert engine.read_chunk(foreign) == ChunkMiss("wrong_layout")
        assert engine.read_into(short, torch.empty(LAYOUT.shape(16))) == ChunkMiss("wrong_layout")
        assert engine.tier_keys("cpu") == []  # all three discarded
        assert engine.stats().counters["discarded"] == 3
        assert engine.read_chunk(corrupt) == ChunkMiss("missing")


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_store_chunk_of_a_caller_laid_out_payload(config, codec):
    """The caller gathers KV into new_payload().kv (raw: the payload of the very blob stored) and stores it under
    its own key; it reads back bit-exact (raw) or within the codec's bound, and a second store is skipped."""
    config = Config(chunk_size=16, codec=codec, disk=config.disk)
    kv = make_kv(16)
    with CacheEngine(config, LAYOUT, "m") as engine:
        key = engine.keys(list(range(16)))[0]
        payload = engine.new_payload()
        assert payload.kv.shape == LAYOUT.shape(16) and payload.kv.dtype == LAYOUT.torch_dtype
        assert (payload.blob is not None) == (codec == "raw")
        for layer in range(LAYOUT.num_layers):  # filled layer by layer, as the connector does
            payload.kv[layer].copy_(kv[layer])
        assert engine.store_chunks([(key, payload)]) == [True]
        assert engine.store_chunks([(key, engine.new_payload())]) == [False]  # present: skipped, nothing overwritten
        assert engine.stats().counters["chunks_stored"] == 1
        hit = engine.read_chunk(key)
        assert isinstance(hit, TokenSource) and hit.tier == "cpu"
        with hit:
            if codec == "raw":
                assert torch.equal(hit.kv, kv) and hit.kv.data_ptr() == payload.kv.data_ptr()  # stored without a copy
            else:
                assert float((hit.kv - kv).abs().max()) < 0.05
        assert engine.lookup(list(range(16))) == 16  # the same key as the token path
        engine.flush()
    with CacheEngine(Config(chunk_size=16, codec=codec, tiers=("disk",), disk=config.disk), LAYOUT, "m") as engine:
        got = engine.retrieve(list(range(16)))
        assert got.shape[3] == 16 and (torch.equal(got, kv) or codec != "raw")


def test_store_chunks_and_read_many_by_key_in_batches(config):
    """The batched calls by key (the SGLang backend's): store_chunks skips what the tiers hold, read_many reads
    each chunk into its scratch (disk here: read into the caller's buffer, not promoted) and misses the rest."""
    kvs = [make_kv(16, seed=i) for i in range(3)]
    with CacheEngine(Config(chunk_size=16, tiers=("disk",), disk=config.disk), LAYOUT, "m") as engine:
        keys = [engine.keys(list(range(i * 100, i * 100 + 16)))[0] for i in range(3)]
        payloads = []
        for kv in kvs:
            payloads.append(engine.new_payload())
            payloads[-1].kv.copy_(kv)
        assert engine.store_chunks(list(zip(keys[:2], payloads[:2]))) == [True, True]
        engine.flush()
        assert engine.store_chunks([(keys[1], engine.new_payload()), (keys[2], payloads[2])]) == [False, True]
        engine.flush()
        scratches = [Scratch() for _ in range(4)]
        hits = engine.read_many([keys[0], b"\x01" * 32, keys[2], keys[1]], scratches)
        assert [isinstance(h, TokenSource) for h in hits] == [True, False, True, True]
        assert hits[1] == ChunkMiss("missing")
        for h, i in zip((hits[0], hits[2], hits[3]), (0, 2, 1)):
            assert isinstance(h, TokenSource) and h.tier == "disk"
            with h:
                assert torch.equal(h.kv, kvs[i])
        start = np.frombuffer(scratches[0].view(1), dtype=np.uint8).ctypes.data  # read into the caller's buffer
        assert isinstance(hits[0], TokenSource)
        assert start <= hits[0].kv.data_ptr() < start + HEADER_BYTES + LAYOUT.num_bytes(16)
        counters = engine.stats().counters
        assert counters["chunks_stored"] == 3 and counters["chunk_read_hits"] == 3 and counters["miss"] == 1


def test_store_chunk_and_read_chunk_from_two_threads(config):
    """The connector stores from its saver thread while its step reads: every chunk lands once and is counted."""
    kv = make_kv(16)
    with CacheEngine(Config(chunk_size=16, tiers=("cpu",)), LAYOUT, "m") as engine:
        keys = engine.keys(list(range(16 * 40)))

        def store() -> None:
            for key in keys:
                payload = engine.new_payload()
                payload.kv.copy_(kv)
                engine.store_chunks([(key, payload)])

        threads = [threading.Thread(target=store) for _ in range(2)]
        for thread in threads:
            thread.start()
        reads = [read_kv(engine, key) for key in keys for _ in range(2)]
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)
        assert all(r == ChunkMiss("missing") or torch.equal(r, kv) for r in reads)
        assert all(isinstance(r, torch.Tensor) and torch.equal(r, kv) for r in (read_kv(engine, key) for key in keys))
        assert 40 <= engine.stats().counters["chunks_stored"] <= 80  # a race may store a chunk twice, never lose one


def test_premap_maps_payloads_ahead_and_paused_holds_it_back_while_nested(config):
    """premap names the payload size to process memory, whose pool maps free buffers of it ahead; paused() holds
    that back (a vLLM forward runs) and nests: only the outermost exit resumes it."""
    cpu = CpuTier(1 << 24, premap_bytes=2 * blob_bytes(LAYOUT, 16))
    with CacheEngine(Config(chunk_size=16, tiers=("cpu",)), LAYOUT, "m", tiers=[cpu]) as engine:
        with engine.paused():
            engine.premap()
            with engine.paused():
                pass
            assert not cpu.pool.wait_premapped(0.3) and cpu.pool.num_premapped == 0  # still paused
        assert cpu.pool.wait_premapped(30) and cpu.pool.num_premapped == 2
        payload = engine.new_payload()
        payload.kv.copy_(make_kv(16))
        assert engine.store_chunks([(engine.keys(list(range(16)))[0], payload)]) == [True]
        assert cpu.pool.num_reused >= 1  # the payload's blob was one mapped ahead


def test_retrieve_hints_the_disk_a_bounded_distance_ahead(config, monkeypatch):
    """Read-ahead hints go READ_AHEAD_BYTES past the chunk being read, never for the whole prompt at once (the
    kernel would read every file side by side and the first chunk would arrive last)."""
    import kvfabric.cache.retrieve as retrieve_module

    events: list[tuple[str, bytes]] = []

    class Recording(DiskTier):
        def prefetch(self, keys):
            events.extend(("hint", k) for k in keys)
            super().prefetch(keys)

        def get_into(self, key, scratch, meta=None):
            events.append(("read", key))
            return super().get_into(key, scratch) if meta is None else super().get_into(key, scratch, meta)

    chunk_bytes = LAYOUT.num_bytes(16)
    monkeypatch.setattr(retrieve_module, "READ_AHEAD_BYTES", 2 * chunk_bytes)  # two chunks ahead
    disk = Recording(config.disk.path, 1 << 30)
    tokens, kv = list(range(16 * 8)), make_kv(16 * 8)
    with CacheEngine(Config(chunk_size=16, tiers=("disk",), disk=config.disk), LAYOUT, "m", tiers=[disk]) as engine:
        engine.store(tokens, kv)
        engine.flush()
        keys = engine.keys(tokens)
        events.clear()
        assert torch.equal(engine.retrieve(tokens), kv)
    hinted = [keys.index(k) for kind, k in events if kind == "hint"]
    assert sorted(hinted) == list(range(8))  # each chunk once
    num_read = 0
    for kind, k in events:
        if kind == "read":
            num_read += 1
        else:
            # the reader thread reads one chunk past the one being decoded; hints go two past that, no further
            assert keys.index(k) <= num_read + 1 + 2


def test_both_caches_offer_the_kvcache_seam(config):
    """CacheEngine and RemoteCache (mode: server) answer the same public calls: the KVCache protocol the connectors
    and engines are written against (a member missing from either fails here)."""
    from kvfabric.cache.protocol import KVCache
    from kvfabric.cache.remote import RemoteCache

    with CacheEngine(config, LAYOUT, "m") as engine:
        assert isinstance(engine, KVCache)
    remote = RemoteCache(Config(chunk_size=16, mode="server"), LAYOUT, "m")  # no server: built, never connected
    try:
        assert isinstance(remote, KVCache)
        protocols = [cls for cls in KVCache.__mro__ if getattr(cls, "_is_protocol", False) and cls.__module__ ==
                     KVCache.__module__]
        members = {name for cls in protocols for name in [*vars(cls), *cls.__dict__.get("__annotations__", {})]
                   if not name.startswith("_")}
        assert {"lookup_keys", "read_into", "read_chunk", "open_chunk", "read_many", "store_chunks", "holds",
                "premap", "paused", "events"} <= members
        assert not {"store_chunk", "read_chunks", "discard_chunk"} & members  # the old calls are gone
        for name in members:  # isinstance checks presence; the calls must be methods on both
            assert callable(getattr(KVCache, name, None)) == callable(getattr(remote, name)) == \
                callable(getattr(CacheEngine, name, None)), name
    finally:
        remote.close()


class _AskingNode:
    """A cluster node whose reporting thread asks for the engine's stats the moment it is given the source (the
    real one runs from before the engine exists, on its own schedule)."""

    def __init__(self) -> None:
        self.first_stats: dict | None = None

    @property
    def stats_source(self):  # noqa: ANN201
        return None

    @stats_source.setter
    def stats_source(self, source) -> None:  # noqa: ANN001
        self.first_stats = source()

    def flush_reports(self, timeout_s: float = 10.0) -> bool:
        return True

    def p2p_counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def test_a_node_asking_for_stats_at_once_gets_the_engines_summary():
    node = _AskingNode()
    engine = CacheEngine(Config(chunk_size=16, tiers=("cpu",)), KVLayout(2, 1, 8, "float32"), "m", node=node)
    try:
        assert node.first_stats == {"lookup_tokens": 0, "hit_tokens": 0, "retrieved_tokens": 0, "stored_chunks": 0,
                                    "evictions": 0, "errors": 0}
    finally:
        engine.close()


@pytest.mark.parametrize("kv_of", [lambda kv: kv, lambda kv: kv.transpose(3, 4).contiguous().transpose(3, 4)],
                         ids=["contiguous", "rows-not-one-run"])
def test_a_prompts_chunks_stored_in_one_pass_are_the_blobs_encoded_one_by_one(config, kv_of):
    """Writes._put_many (one streamed pass over the prompt's KV into the cpu tier's buffers) stores byte for byte
    what RawCodec.encode does chunk by chunk; KV whose rows are not one run each is stored chunk by chunk."""
    tokens, kv = list(range(70)), kv_of(make_kv(70))
    config = Config(chunk_size=16, save_partial_chunk=True, tiers=("cpu",))
    with CacheEngine(config, LAYOUT, "m") as engine:
        assert engine.store(tokens, kv) == 5
        cpu = engine.stack.tiers[0]
        for i, key in enumerate(engine.keys(tokens)):
            s, e = 16 * i, min(16 * (i + 1), 70)
            expected = RawCodec().encode(kv[:, :, :, s:e].contiguous(), key, LAYOUT, with_checksums=False)
            end = HEADER_BYTES + LAYOUT.num_bytes(e - s)  # the header and the KV (an unsealed blob's head table is
            assert bytes(cpu.get(key))[:end] == bytes(expected)[:end]  # filled in only when it leaves the process)
        assert torch.equal(engine.retrieve(tokens), kv)


def test_a_long_prompt_is_stored_in_passes_of_bounded_bytes(config, monkeypatch):
    """Writes takes at most STORE_PASS_BYTES of buffers per pass: a prompt larger than the cpu tier does not map
    all its chunks before storing one."""
    from kvfabric.cache import writes

    monkeypatch.setattr(writes, "STORE_PASS_BYTES", 3 * LAYOUT.num_bytes(16))
    passes: list[int] = []
    real = writes.Writes._put_many
    monkeypatch.setattr(writes.Writes, "_put_many",
                        lambda self, keys, chunks, *args: passes.append(len(chunks)) or real(self, keys, chunks, *args))
    tokens, kv = list(range(16 * 8)), make_kv(16 * 8)
    with CacheEngine(Config(chunk_size=16, tiers=("cpu",)), LAYOUT, "m") as engine:
        assert engine.store(tokens, kv) == 8
        assert torch.equal(engine.retrieve(tokens), kv)
    assert passes == [3, 3, 2]
