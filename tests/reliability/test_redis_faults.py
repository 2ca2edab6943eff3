"""Redis faults under load, with a real redis-server: killed and restarted; at maxmemory with noeviction (writes
refused) and with allkeys-lru. For each: no wrong chunk, no call past its deadline, and the recovery time."""
from __future__ import annotations

import pytest

from kvfabric.cache.engine import CacheEngine
from kvfabric.config import Config
from kvfabric.engines.synthetic import MODEL_ID, SMALL_LAYOUT
from tests.redis_fixtures import needs_redis, redis_server, redis_server_factory  # noqa: F401 - fixtures
from tests.reliability.harness import Load, assert_clean, report, time_until

pytestmark = [pytest.mark.slow, needs_redis]


def redis_engine(url: str) -> CacheEngine:
    # a small cpu tier: most reads reach Redis
    config = Config.from_dict({"chunk_size": 32, "tiers": ["cpu", "redis"], "cpu": {"capacity": 256 * 1024},
                               "redis": {"url": url, "timeout_s": 0.3, "breaker_failures": 2,
                                         "backoff_max_s": 1.0}})
    return CacheEngine(config, SMALL_LAYOUT, MODEL_ID)


def redis_hits(engine: CacheEngine) -> int:
    return engine.stats().counters.get("hit.redis", 0)


def test_redis_killed_and_restarted(redis_server):  # noqa: F811
    with redis_engine(redis_server.url) as engine:
        load = Load(engine).start()
        load.run_for(3)
        assert redis_hits(engine) > 0
        redis_server.stop()  # SIGKILL
        ops_during = load.ops_after(4)
        assert engine.stats().breakers_open["redis"]
        redis_server.start()  # same port, empty (no persistence)
        hits = redis_hits(engine)
        recovery_s = time_until(lambda: redis_hits(engine) > hits, 60)
        load.stop()
    assert ops_during > 0  # the load went on during the outage (misses, recomputes)
    assert_clean(load)
    report("redis killed (SIGKILL) and restarted", load, outage_s=4, ops_during_outage=ops_during,
           recovery_s=recovery_s)


def test_redis_at_maxmemory_with_noeviction_refuses_writes(redis_server_factory):  # noqa: F811
    server = redis_server_factory("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    with redis_engine(server.url) as engine:
        load = Load(engine).start()
        refused = lambda: engine.stats().tier_counters["redis"].get("put.rejected", 0)  # noqa: E731
        time_until(lambda: refused() > 20, 120)
        load.run_for(2)
        load.stop()
        counters = engine.stats().tier_counters["redis"]
    assert counters.get("breaker.opened", 0) == 0  # a refusal is an answer, not a dead server
    assert redis_hits(engine) > 0
    assert_clean(load)
    report("redis at maxmemory, noeviction (writes refused)", load, writes_refused=counters["put.rejected"],
           breaker_opened=0, recovery_s=0.0)


def test_redis_at_maxmemory_with_allkeys_lru_evicts_cleanly(redis_server_factory):  # noqa: F811
    server = redis_server_factory("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    client = server.client()
    with redis_engine(server.url) as engine:
        load = Load(engine).start()
        time_until(lambda: int(client.info("stats")["evicted_keys"]) > 50, 120)
        load.run_for(2)
        load.stop()
        evicted = int(client.info("stats")["evicted_keys"])
        used = int(client.info("memory")["used_memory"])
    assert used <= 2 * 2**20 * 1.1
    assert redis_hits(engine) > 0
    assert_clean(load)
    report("redis at maxmemory, allkeys-lru (server evicts)", load, server_evictions=evicted,
           used_memory_mb=used / 2**20, recovery_s=0.0)
