"""KVFabricStorage (kvfabric.connectors.sglang) against SGLang's own storage interface, with SGLang's HiCacheFile
backend as the behavioural reference (same inputs, same results), over the mooncake tier on a real master.

Runs in .venv-sglang (scripts/setup_sglang_venv.sh; `make test` runs this file there); skipped where SGLang is
not installed. The host pool is a stand-in with SGLang's page methods (tests/sglang_host_pool.py).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

hicache = pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                              reason="SGLang is not installed in this venv: the backend's tests run in .venv-sglang "
                                     "(scripts/setup_sglang_venv.sh, part of `make test`)")

from kvfabric.config import ConfigError  # noqa: E402
from kvfabric.connectors.sglang import KVFabricStorage, backend_config  # noqa: E402
from tests.mooncake_fixtures import MooncakeMaster, hang, mooncake_master, needs_mooncake  # noqa: E402, F401
from tests.sglang_host_pool import MHATokenToKVPoolHost  # noqa: E402

pytestmark = needs_mooncake
BACKEND = {"backend_name": "kvfabric", "module_path": "kvfabric.connectors.sglang", "class_name": "KVFabricStorage",
           "interface_v1": 1}


def storage_config(master: MooncakeMaster, extra: dict | None = None, **fields) -> hicache.HiCacheStorageConfig:
    mooncake = {"master": master.address, "metadata_url": master.metadata_url, "metrics_url": master.metrics_url,
                "segment": "64MiB", "buffer": "16MiB", "timeout_s": 2.0}
    defaults = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                    enable_storage_metrics=False, is_page_first_layout=False, model_name="org/model-1b",
                    extra_config={**BACKEND, "tiers": ["mooncake"], "mooncake": mooncake, **(extra or {})})
    return hicache.HiCacheStorageConfig(**{**defaults, **fields})


def backend(master: MooncakeMaster, pool: MHATokenToKVPoolHost, **fields) -> KVFabricStorage:
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    storage = StorageBackendFactory.create_backend("dynamic", storage_config(master, **fields), pool)
    storage.register_mem_pool_host(pool)  # what SGLang's cache controller does next
    return storage


def reference(tmp_path: Path, pool: MHATokenToKVPoolHost) -> hicache.HiCacheStorage:
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    config = hicache.HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                          is_mla_model=False, enable_storage_metrics=False,
                                          is_page_first_layout=False, model_name="org/model-1b",
                                          extra_config={"file_storage_path": str(tmp_path / "hicache")})
    storage = hicache.HiCacheFile(config)
    storage.register_mem_pool_host(pool)
    return storage


@pytest.fixture
def pool() -> MHATokenToKVPoolHost:
    return MHATokenToKVPoolHost(seed=1)


def test_sglang_loads_it_with_the_dynamic_backend_option(mooncake_master, pool) -> None:
    storage = backend(mooncake_master, pool)
    try:
        assert isinstance(storage, KVFabricStorage) and isinstance(storage, hicache.HiCacheStorage)
        assert storage.tier_name == "mooncake" and storage.model_id == "org/model-1b"
        assert storage.batch_set_v1(["p0", "p1"], pool.indices([0, 1])) == [True, True]
        assert storage.batch_exists(["p0", "p1", "p2"]) == 2
    finally:
        storage.close()


def test_config_keys(mooncake_master) -> None:
    config, options = backend_config({**BACKEND, "model_id": "m", "tiers": ["disk"], "disk": {"capacity": "1GiB"},
                                      "file_storage_path": "/ignored", "prefetch_threshold": 256})
    assert config.tiers == ("disk",) and config.disk.capacity == 2**30 and options == {"model_id": "m"}
    assert backend_config({})[0].tiers == ("mooncake",)
    with pytest.raises(ConfigError, match="one local tier"):
        backend_config({"tiers": ["cpu", "mooncake"]})
    with pytest.raises(ConfigError, match="mooncake.protocol"):
        backend_config({"mooncake": {"protocol": "udp"}})
    with pytest.raises(ConfigError, match="one local tier"):
        backend_config({"tiers": ["peer"]})
    with pytest.raises(ConfigError, match="'server' is not supported"):
        backend_config({"mode": "server"})
    pages_as_they_are = backend_config({"codec": "int8", "tiers": ["disk"], "disk": {"codec": "cachegen"}})[0]
    assert (pages_as_they_are.codec, pages_as_they_are.disk.codec) == ("raw", "")


PAGE_KEYS = [f"{i:064x}" for i in range(6)]
OPS = st.lists(st.one_of(
    st.tuples(st.just("set"), st.integers(0, 5), st.integers(0, 31)),
    st.tuples(st.just("batch_set"), st.lists(st.integers(0, 5), min_size=1, max_size=4), st.integers(0, 28)),
    st.tuples(st.just("get"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("batch_get"), st.lists(st.integers(0, 5), min_size=1, max_size=4), st.just(0)),
    st.tuples(st.just("exists"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("batch_exists"), st.lists(st.integers(0, 5), min_size=1, max_size=6), st.just(0)),
    st.tuples(st.just("clear"), st.just(0), st.just(0))), max_size=14)


def _run(storage, pool: MHATokenToKVPoolHost, op: str, arg, page: int):
    """One call of SGLang's generic interface, as its cache controller makes it; the result as plain values."""
    def as_values(pages):
        return [None if p is None else p.tolist() for p in pages]

    if op == "set":
        return storage.set(PAGE_KEYS[arg], pool.page(page))
    if op == "batch_set":
        return storage.batch_set([PAGE_KEYS[k] for k in arg], [pool.page(page + i) for i in range(len(arg))])
    if op == "get":
        return as_values([storage.get(PAGE_KEYS[arg], pool.get_dummy_flat_data_page())])
    if op == "batch_get":
        return as_values(storage.batch_get([PAGE_KEYS[k] for k in arg],
                                           [pool.get_dummy_flat_data_page() for _ in arg]))
    if op == "exists":
        return storage.exists(PAGE_KEYS[arg])
    if op == "batch_exists":
        return storage.batch_exists([PAGE_KEYS[k] for k in arg])
    storage.clear()  # HiCacheFile answers True, the interface says None
    return None


@pytest.fixture
def ours(mooncake_master, pool):
    storage = backend(mooncake_master, pool)
    yield storage
    storage.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_same_results_as_hicache_file(ours, pool, tmp_path_factory, ops) -> None:
    """Random call sequences of SGLang's generic interface: every answer and every page read is the same."""
    theirs = reference(tmp_path_factory.mktemp("ref"), pool)  # a fresh directory; `ours` is emptied instead
    ours.clear()
    for op, arg, page in ops:
        assert _run(ours, pool, op, arg, page) == _run(theirs, pool, op, arg, page), (op, arg, page)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_v1_calls_move_pages_like_sglangs_generic_path(mooncake_master, tmp_path, layout) -> None:
    """batch_set_v1 / batch_get_v1 between the tier and the host pool leave the pool exactly as SGLang's generic
    path does with HiCacheFile (get_data_page -> batch_set; batch_get into dummy pages -> set_from_flat_data_page)."""
    source = MHATokenToKVPoolHost(layout, seed=2)
    ours_dst, ref_dst = MHATokenToKVPoolHost(layout, seed=3), MHATokenToKVPoolHost(layout, seed=3)
    keys, pages = PAGE_KEYS[:5], [7, 3, 12, 0, 30]
    ours, theirs = backend(mooncake_master, source), reference(tmp_path, source)
    try:
        assert ours.batch_set_v1(keys[:4], source.indices(pages[:4])) == [True] * 4
        assert theirs.batch_set(keys[:4], [source.get_data_page(p * source.page_size) for p in pages[:4]])
        ours.register_mem_pool_host(ours_dst)
        theirs.register_mem_pool_host(ref_dst)
        dst_pages = [1, 2, 5, 9, 11]
        got = ours.batch_get_v1(keys, ours_dst.indices(dst_pages))
        ref = theirs.batch_get(keys, [ref_dst.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(ref):
            if page is not None:
                ref_dst.set_from_flat_data_page(dst_pages[i] * ref_dst.page_size, page)
        assert got == [page is not None for page in ref] == [True] * 4 + [False]
        assert torch.equal(ours_dst.kv_buffer, ref_dst.kv_buffer)
        for src, dst in zip(pages[:4], dst_pages):
            assert torch.equal(ours_dst.page(dst), source.page(src))
        assert ours.batch_set_v1(keys[3:], source.indices(pages[3:])) == [True, True]  # present: skipped; new
        assert ours.counters["pages_stored"] == 5 and ours.batch_exists(keys) == 5
    finally:
        ours.clear()
        ours.close()


def test_many_pages_in_tier_batches(mooncake_master) -> None:
    from kvfabric.connectors.sglang import SLOTS
    pool = MHATokenToKVPoolHost("page_first", num_pages=2 * SLOTS + 8, seed=4)
    storage = backend(mooncake_master, pool)
    keys, pages = [f"page-{i}" for i in range(2 * SLOTS + 5)], list(range(2 * SLOTS + 5))
    try:
        assert storage.batch_set_v1(keys, pool.indices(pages)) == [True] * len(keys)
        dst = MHATokenToKVPoolHost("page_first", num_pages=2 * SLOTS + 8, seed=5)
        storage.register_mem_pool_host(dst)
        assert storage.batch_get_v1(keys, dst.indices(pages)) == [True] * len(keys)
        assert all(torch.equal(dst.page(p), pool.page(p)) for p in pages)
    finally:
        storage.clear()
        storage.close()


def test_keys_are_namespaced_by_model_shard_and_page_format(mooncake_master, pool) -> None:
    rank0 = backend(mooncake_master, pool, tp_size=2, tp_rank=0)
    rank1 = backend(mooncake_master, pool, tp_size=2, tp_rank=1)
    mla0 = backend(mooncake_master, pool, tp_size=2, tp_rank=0, is_mla_model=True)
    mla1 = backend(mooncake_master, pool, tp_size=2, tp_rank=1, is_mla_model=True)
    other_model = backend(mooncake_master, pool, tp_size=2, tp_rank=0, model_name="org/other")
    other_format = backend(mooncake_master, MHATokenToKVPoolHost("page_first"), tp_size=2, tp_rank=0)
    try:
        assert rank0.set("p", pool.page(0)) and mla0.set("p", pool.page(1))
        assert [rank0.exists("p"), rank1.exists("p"), mla1.exists("p")] == [True, False, True]  # MLA: shared
        assert not other_model.exists("p") and not other_format.exists("p")
        assert torch.equal(mla1.get("p", pool.get_dummy_flat_data_page()), pool.page(1))
    finally:
        rank0.clear()
        for storage in (rank0, rank1, mla0, mla1, other_model, other_format):
            storage.close()


def test_damaged_page_is_a_miss_and_is_dropped(mooncake_master, pool) -> None:
    from mooncake.store import MooncakeDistributedStore

    from kvfabric.tiers.mooncake import object_key
    from tests.cluster_scripts.helpers import free_port

    storage = backend(mooncake_master, pool)
    raw = MooncakeDistributedStore()
    assert raw.setup(f"127.0.0.1:{free_port()}", mooncake_master.metadata_url, 0, 16 << 20, "tcp", "",
                     mooncake_master.address) == 0
    try:
        keys = PAGE_KEYS[:3]
        assert storage.batch_set_v1(keys, pool.indices([0, 1, 2])) == [True] * 3
        name = object_key(storage.chunk_key(keys[1]))
        damaged = bytearray(raw.get(name))
        damaged[-5] ^= 0xFF  # one payload byte, written back raw through the store client
        assert raw.upsert(name, bytes(damaged)) == 0
        dst = MHATokenToKVPoolHost(seed=9)
        before = dst.kv_buffer.clone()
        storage.register_mem_pool_host(dst)
        assert storage.batch_get_v1(keys, dst.indices([4, 5, 6])) == [True, False, True]
        assert storage.cache.stats().counters["corrupt.mooncake"] == 1 and raw.is_exist(name) == 0  # dropped
        assert torch.equal(dst.page(5), before[:, :, 20:24].flatten())  # the damaged page never reached the pool
        assert storage.batch_exists(keys) == 1
    finally:
        raw.close()
        storage.clear()
        storage.close()


def test_dead_master_is_misses_within_the_deadline(mooncake_master, pool) -> None:
    storage = backend(mooncake_master, pool)
    try:
        assert storage.batch_set_v1(PAGE_KEYS[:2], pool.indices([0, 1])) == [True, True]
        hang(mooncake_master)  # alive but silent: only the deadline can help
        try:
            started = time.monotonic()
            assert storage.batch_exists(PAGE_KEYS[:2]) == 0
            assert storage.batch_get_v1(PAGE_KEYS[:2], pool.indices([3, 4])) == [False, False]
            assert storage.batch_set_v1(PAGE_KEYS[2:4], pool.indices([2, 3])) == [False, False]
            assert storage.get(PAGE_KEYS[0], pool.get_dummy_flat_data_page()) is None
            assert time.monotonic() - started < 4 * 2.0 + 2  # three deadlines, then the breaker answers at once
        finally:
            os.kill(mooncake_master.proc.pid, signal.SIGCONT)
    finally:
        storage.close()
