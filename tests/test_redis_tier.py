"""RedisTier against real redis-server processes: round trips, pipelining, TTL, faults, eviction, damage, cluster."""
from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.config import Config, RedisTierConfig
from kvfabric.net.breaker import CircuitBreaker
from kvfabric.tiers.disk import DiskTier
from kvfabric.tiers.factory import build_tiers
from kvfabric.tiers.redis import RedisTier, redis_key
from kvfabric.tiers.redis_nodes import NodeBreakers
from kvfabric.tiers.stack import TierStack
from tests.cluster_scripts.helpers import FakeClock, finishes, wait_for
from tests.redis_fixtures import (  # noqa: F401 - fixtures are used by name
    RedisServer,
    make_blob,
    needs_redis,
    redis_cluster,
    redis_server,
    redis_server_factory,
    redis_url,
)
from tests.tier_contract import TierContract

pytestmark = needs_redis


def key_of(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


@pytest.fixture
def tier(redis_url: str):
    t = RedisTier(redis_url, timeout_s=0.5, breaker_failures=3, backoff_max_s=0.4)
    yield t
    t.close()


def test_round_trip_and_protocol(tier: RedisTier, redis_server: RedisServer) -> None:
    k1, k2, k3 = key_of(1), key_of(2), key_of(3)
    assert tier.get(k1) is None
    assert tier.put(k1, b"bytes-value")
    assert tier.put(k2, bytearray(b"bytearray-value"))
    assert tier.put(k3, memoryview(b"xxmemoryview-value")[2:])
    assert tier.get(k1) == b"bytes-value"
    assert tier.get(k2) == b"bytearray-value"
    assert tier.get(k3) == b"memoryview-value"
    assert redis_server.client().get(b"kvf:" + k1.hex().encode()) == b"bytes-value"  # the documented key layout
    assert sorted(tier.keys()) == sorted([k1, k2, k3])
    assert tier.usage().num_chunks == 3 and tier.usage().num_bytes > 0
    assert tier.delete(k1) and not tier.delete(k1)
    assert tier.get(k1) is None
    tier.pin([k2])
    tier.unpin([k2])  # no-ops
    redis_server.client().set(b"other:key", b"not ours")
    tier.clear()
    assert tier.keys() == [] and tier.get(k2) is None
    assert redis_server.client().get(b"other:key") == b"not ours"  # clear() only touches kvf: keys
    assert tier.contains_many([]) == []


def test_large_values_round_trip(tier: RedisTier) -> None:
    for size in (int(5.9e6), 33_000_000):
        blob = os.urandom(size)
        assert tier.put(key_of(size), blob)
        assert tier.get(key_of(size)) == blob


def test_contains_many_is_one_pipelined_round_trip(tier: RedisTier) -> None:
    keys = [key_of(i) for i in range(50)]
    for key in keys[::2]:
        assert tier.put(key, b"v")
    client = tier.client()
    calls = {"pipelines": 0, "direct": 0}
    real_pipeline, real_execute = client.pipeline, client.execute_command

    def pipeline(*args, **kwargs):
        calls["pipelines"] += 1
        return real_pipeline(*args, **kwargs)

    def execute_command(*args, **kwargs):
        calls["direct"] += 1
        return real_execute(*args, **kwargs)

    client.pipeline, client.execute_command = pipeline, execute_command
    try:
        assert tier.contains_many(keys) == [i % 2 == 0 for i in range(50)]
    finally:
        del client.pipeline, client.execute_command
    assert calls == {"pipelines": 1, "direct": 0}


def test_ttl(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, ttl_s=1)
    assert tier.put(key_of(1), b"short-lived")
    pttl = redis_server.client().pttl(redis_key(key_of(1)))
    assert 0 < pttl <= 1000
    assert tier.get(key_of(1)) == b"short-lived"
    wait_for(lambda: tier.get(key_of(1)) is None, 30)  # the server expires it
    assert tier.contains_many([key_of(1)]) == [False]
    no_ttl = RedisTier(redis_server.url)
    assert no_ttl.put(key_of(2), b"v") and redis_server.client().pttl(redis_key(key_of(2))) == -1


def network_calls(tier: RedisTier) -> int:
    """Calls that went to the server and failed (the breaker counts the others as skipped)."""
    return sum(n for name, n in tier.counters.snapshot().items() if name.endswith(".errors"))


def test_dead_server_is_misses_then_reconnects(tier: RedisTier, redis_server: RedisServer) -> None:
    clock = FakeClock()
    tier.breaker = CircuitBreaker(failures=3, backoff_max_s=0.4, clock=clock)
    keys = [key_of(i) for i in range(100)]
    for key in keys[:10]:
        assert tier.put(key, b"value")
    assert tier.contains_many(keys[:10]) == [True] * 10
    redis_server.stop()

    def calls() -> None:
        assert tier.contains_many(keys) == [False] * 100
        assert tier.get(keys[0]) is None
        assert tier.put(keys[0], b"lost") is False
        assert tier.delete(keys[0]) is False
        assert tier.keys() == []
        assert tier.usage().num_chunks == 0
        tier.clear()

    finishes(calls)  # a refused connection is a miss at once; every call is bounded by timeout_s anyway
    assert tier.breaker.is_open and network_calls(tier) == 3  # three failures opened the breaker
    assert tier.counters["put.dropped"] == 1 and tier.counters["breaker.opened"] == 1
    assert tier.counters["delete.skipped"] == tier.counters["keys.skipped"] == tier.counters["clear.skipped"] == 1

    # While open, calls do not touch the network.
    for _ in range(200):
        assert tier.get(keys[0]) is None
        assert not tier.put(keys[1], b"x")
    assert network_calls(tier) == 3
    assert tier.counters["put.dropped"] == 201 and tier.counters["get.skipped"] == 200

    redis_server.start()  # same port, empty (no persistence)

    def probe() -> bool:
        clock.advance(1.0)  # past the backoff: the next call is the half-open probe
        return tier.put(keys[0], b"back")

    wait_for(probe, 30)
    assert not tier.breaker.is_open and tier.counters["breaker.closed"] == 1
    assert tier.get(keys[0]) == b"back"
    assert tier.contains_many(keys[:2]) == [True, False]


def test_hung_server_never_hangs_the_caller(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, timeout_s=0.2, breaker_failures=2, backoff_max_s=0.3)
    clock = FakeClock()
    tier.breaker = CircuitBreaker(failures=2, backoff_max_s=0.3, clock=clock)
    assert tier.put(key_of(1), b"v")
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # alive but silent: only timeouts can help

    def calls() -> None:
        for _ in range(20):
            assert tier.get(key_of(1)) is None
            assert tier.contains_many([key_of(1), key_of(2)]) == [False, False]
        assert not tier.put(key_of(3), b"v")

    try:
        finishes(calls)
        # two timed-out calls (each bounded by timeout_s) opened the breaker; the other 39 never waited
        assert network_calls(tier) == 2 and tier.breaker.is_open
        assert tier.counters["get.skipped"] + tier.counters["contains.skipped"] == 38
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)

    def recovered() -> bool:
        clock.advance(1.0)
        return tier.get(key_of(1)) == b"v"

    wait_for(recovered, 30)


def test_breaker_backoff_doubles_and_caps() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures=2, backoff_max_s=0.25, clock=clock)
    assert breaker.allow()
    assert not breaker.failure() and breaker.allow()
    assert breaker.failure() and breaker.is_open
    assert not breaker.allow()  # within the first 0.1 s backoff
    clock.advance(0.1)
    assert breaker.allow()  # the half-open probe
    assert not breaker.allow()  # only one probe per window
    assert breaker.failure()  # probe failed: backoff 0.2 s
    clock.advance(0.19)
    assert not breaker.allow()
    clock.advance(0.01)
    assert breaker.allow()
    breaker.failure()  # backoff capped at 0.25 s
    assert breaker.backoff_s == 0.25
    assert breaker.success()  # closes it
    assert not breaker.is_open and breaker.allow() and breaker.backoff_s == 0.1


def test_maxmemory_eviction_is_clean_misses(redis_server_factory) -> None:
    server = redis_server_factory("--maxmemory", "20mb", "--maxmemory-policy", "allkeys-lru")
    tier = RedisTier(server.url)
    stack = TierStack([tier])
    keys = [key_of(i) for i in range(40)]
    blobs = [make_blob(key, 1_000_000, seed=i) for i, key in enumerate(keys)]
    for key, blob in zip(keys, blobs):
        assert tier.put(key, blob)  # the server evicts, it never refuses
    present = tier.contains_many(keys)
    # 40 MB into 20 MB: much is gone. Which keys is up to Redis: its LRU is sampled and its clock ticks once a
    # second, so keys written within one second tie and any may go; only the last write is sure to stay
    assert sum(present) <= 20 and present[-1]
    for key, blob, hit in zip(keys, blobs, present):
        got = stack.get(key)
        if hit:
            assert got is not None and bytes(got.blob) == bytes(blob)
        else:
            assert got is None and tier.get(key) is None
    assert not any(name.endswith(".errors") for name in tier.counters)
    assert stack.counters["miss"] == present.count(False) and not stack.counters["corrupt.redis"]
    stack.close()


def test_out_of_memory_put_is_rejected_not_a_fault(redis_server_factory) -> None:
    server = redis_server_factory("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    tier = RedisTier(server.url, breaker_failures=1)
    results = [tier.put(key_of(i), b"x" * 500_000) for i in range(20)]
    assert results[0] and not results[-1]
    assert tier.counters["put.rejected"] > 0 and not tier.breaker.is_open
    assert tier.get(key_of(0)) == b"x" * 500_000


def test_corrupted_value_is_caught_by_the_stack(tier: RedisTier, redis_server: RedisServer, tmp_path: Path) -> None:
    key = key_of(7)
    blob = make_blob(key, 4096, seed=7)
    stack = TierStack([tier])
    stack.put(key, blob)
    stack.flush()
    client = redis_server.client()
    client.setrange(redis_key(key), 2000, b"\xff\x00\xff")  # flip payload bytes on the server
    assert stack.get(key) is None
    assert stack.counters["corrupt.redis"] == 1
    assert client.exists(redis_key(key)) == 0  # the damaged value was deleted
    stack.close()

    disk = DiskTier(tmp_path / "disk", 10**8)
    tier2 = RedisTier(redis_server.url)
    stack = TierStack([tier2, disk])
    stack.put(key, blob)
    stack.flush()
    client.setrange(redis_key(key), 100, b"garbage")
    got = stack.get(key)
    assert got is not None and got.tier == "disk" and bytes(got.blob) == bytes(blob)
    assert stack.counters["corrupt.redis"] == 1
    stack.flush()  # the disk hit is promoted back into redis, intact
    assert tier2.get(key) == bytes(blob)
    stack.close()


def test_unix_socket_url(redis_server_factory, tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    redis_server_factory("--unixsocket", str(sock), "--unixsocketperm", "700")
    tier = RedisTier(f"unix://{sock}?db=0")
    assert tier.put(key_of(1), b"over a unix socket")
    assert tier.get(key_of(1)) == b"over a unix socket"


def test_built_from_config(redis_url: str) -> None:
    cfg = RedisTierConfig(url=redis_url, ttl_s=5, timeout_s=0.3, capacity=10**6, breaker_failures=4,
                          backoff_max_s=2.0)
    (tier,) = build_tiers(Config(tiers=("redis",), redis=cfg))
    assert isinstance(tier, RedisTier) and tier.url == redis_url
    assert (tier.ttl_s, tier.timeout_s, tier.capacity_bytes, tier.breaker.threshold) == (5, 0.3, 10**6, 4)
    assert tier.put(key_of(1), b"v") and tier.get(key_of(1)) == b"v"
    assert not tier.put(key_of(2), b"x" * (10**6 + 1))  # larger than the whole configured capacity


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "delete", "contains"]),
                              st.binary(min_size=1, max_size=40), st.binary(max_size=300)), max_size=30))
def test_matches_a_dict_model(tier: RedisTier, ops) -> None:
    tier.clear()
    model: dict[bytes, bytes] = {}
    for op, key, value in ops:
        if op == "put":
            assert tier.put(key, value)
            model[key] = value
        elif op == "get":
            assert tier.get(key) == model.get(key)
        elif op == "delete":
            assert tier.delete(key) == (model.pop(key, None) is not None)
        else:
            assert tier.contains_many([key]) == [key in model]
    assert sorted(tier.keys()) == sorted(model)


def test_cluster_round_trip_across_slots(redis_cluster) -> None:
    tier = RedisTier(redis_cluster.url, is_cluster=True)
    tier.clear()
    keys = [key_of(i) for i in range(300)]
    for i, key in enumerate(keys[:200]):
        assert tier.put(key, i.to_bytes(4, "little") * 100)
    nodes_used = {redis_cluster.nodes[0].client().cluster("keyslot", redis_key(k)) * 3 // 16384 for k in keys[:200]}
    assert len(nodes_used) == 3  # the keys really are spread over the three nodes' slot ranges
    assert tier.contains_many(keys) == [True] * 200 + [False] * 100
    assert all(tier.get(key) == i.to_bytes(4, "little") * 100 for i, key in enumerate(keys[:200]))
    assert sorted(tier.keys()) == sorted(keys[:200])
    assert tier.usage().num_chunks == 200
    assert tier.delete(keys[0]) and tier.get(keys[0]) is None
    blob = make_blob(keys[250], 6_000_000, seed=3)
    stack = TierStack([tier])
    stack.put(keys[250], blob)
    stack.flush()
    got = stack.get(keys[250])
    assert got is not None and bytes(got.blob) == bytes(blob)
    stack.close()  # closes the tier
    tier = RedisTier(redis_cluster.url, is_cluster=True)
    tier.clear()
    assert tier.keys() == []
    tier.close()


def test_cluster_unreachable_is_misses(tmp_path: Path) -> None:
    from tests.redis_fixtures import free_port
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}", is_cluster=True, timeout_s=0.2)

    def calls() -> None:
        assert tier.contains_many([key_of(1)]) == [False]
        assert tier.get(key_of(1)) is None and not tier.put(key_of(1), b"v")

    finishes(calls)
    assert network_calls(tier) == 3 and tier.breaker.is_open  # every failure counted; the third opened it


def test_cluster_node_hung_costs_only_its_own_keys(redis_cluster) -> None:
    """A breaker per cluster node: a silent node's timeouts open its breaker only, the other nodes' keys are
    served (with one breaker for the whole cluster they would all miss), and its keys come back after it."""
    clock = FakeClock()  # the breakers' backoffs move only when the test says
    tier = RedisTier(redis_cluster.url, is_cluster=True, timeout_s=0.2)
    tier.breaker = CircuitBreaker(failures=3, backoff_max_s=0.4, clock=clock)
    tier.node_breakers = NodeBreakers(failures=3, backoff_max_s=0.4, clock=clock)
    tier.clear()
    keys = [key_of(i) for i in range(60)]
    assert all(tier.put(key, key) for key in keys)
    node_of = {key: tier.client().get_node_from_key(redis_key(key)).name for key in keys}
    hung = redis_cluster.nodes[2]
    hung_name = next(name for name in node_of.values() if name.endswith(f":{hung.port}"))
    theirs = [key for key in keys if node_of[key] == hung_name]
    ours = [key for key in keys if node_of[key] != hung_name]
    assert theirs and ours
    os.kill(hung.proc.pid, signal.SIGSTOP)  # alive but silent (well within the cluster's node timeout, 2 s)

    def calls() -> None:
        assert all(tier.get(key) is None for key in theirs[:3])  # three timeouts open that node's breaker
        assert tier.node_breakers.open_nodes() == [hung_name] and tier.is_breaker_open  # reported by the engine
        assert all(tier.get(key) == key for key in ours)
        assert tier.contains_many(keys) == [node_of[key] != hung_name for key in keys]
        assert all(tier.get(key) is None and not tier.put(key, b"x") for key in theirs)  # at once: its breaker

    try:
        finishes(calls)
        assert network_calls(tier) == 3 and not tier.breaker.is_open
        assert tier.counters["breaker.opened"] == 1
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)

    def recovered() -> bool:
        clock.advance(1.0)  # past the backoff: the next call on that node is its probe
        return tier.get(theirs[0]) == theirs[0]

    wait_for(recovered, 30)
    assert tier.node_breakers.open_nodes() == [] and not tier.is_breaker_open
    assert tier.counters["breaker.closed"] == 1
    assert all(tier.get(key) == key for key in keys)
    tier.clear()
    tier.close()


# ---- the shared tier contract (tests/tier_contract.py) -----------------------------------------------------
class TestRedisContract(TierContract):
    """Redis evicts under its own maxmemory policy (see test_maxmemory_eviction_is_clean_misses) and a client
    cannot pin a key there: declared, and checked in that form."""
    declared = dict(is_trusted=False, is_read_only=False, is_persistent=True, is_shared=True, honors_capacity=False,
                    honors_pins=False, is_zero_copy=False)
    is_cluster = False

    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.url = redis_server.url

    def make_tier(self, capacity_bytes):
        return RedisTier(self.url, is_cluster=self.is_cluster, capacity_bytes=capacity_bytes)

    def reopen(self, tier):
        return RedisTier(self.url, is_cluster=self.is_cluster, capacity_bytes=tier.capacity_bytes)


class TestRedisClusterContract(TestRedisContract):
    is_cluster = True

    @pytest.fixture(autouse=True)
    def _server(self, redis_cluster) -> None:
        self.url = redis_cluster.url

    def make_tier(self, capacity_bytes):
        tier = super().make_tier(capacity_bytes)
        tier.clear()  # one cluster serves the whole module
        return tier


def test_engines_share_chunks_through_redis(redis_url: str) -> None:
    import torch

    from kvfabric import CacheEngine, Config, KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
    redis_cfg = RedisTierConfig(url=redis_url)
    tokens = list(range(100))
    kv = torch.randn(layout.shape(100), generator=torch.Generator().manual_seed(0)).to(torch.float16)
    with CacheEngine(Config(chunk_size=16, tiers=("cpu", "redis"), redis=redis_cfg), layout, "m") as writer:
        assert writer.store(tokens, kv) == 6
        writer.flush()
    with CacheEngine(Config(chunk_size=16, tiers=("redis",), redis=redis_cfg), layout, "m") as reader:
        assert reader.lookup(tokens) == 96
        assert torch.equal(reader.retrieve(tokens), kv[:, :, :, :96])


def test_typed_memoryview_is_stored_as_its_bytes(tier: RedisTier) -> None:
    import array
    values = array.array("d", [1.5, 2.5, 3.5])
    assert tier.put(key_of(1), memoryview(values))  # 3 items, 24 bytes
    assert tier.get(key_of(1)) == values.tobytes()
