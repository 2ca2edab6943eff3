"""The chunk index contract on every backend: in memory, Redis, and Redis Cluster (real redis-server processes)."""
from __future__ import annotations

import threading
import time

import pytest

from kvfabric.cluster.index import InstanceInfo, Namespace, TierInfo, open_index
from kvfabric.cluster.index_memory import MemoryIndex
from kvfabric.cluster.index_redis import RedisIndex
from tests.cluster_scripts.helpers import key
from tests.redis_fixtures import needs_redis, redis_cluster, redis_server  # noqa: F401  (fixtures)


def info(instance_id: str, port: int = 1000) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, host="127.0.0.1", port=port,
                        tiers=[TierInfo("cpu", 100), TierInfo("disk", 1000)],
                        namespaces=[Namespace("m", "ab" * 32, 16)])


class IndexContract:
    def make(self):  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def index(self):
        index = self.make()
        yield index
        index.close()

    def test_register_and_locate(self, index):
        index.register(info("a"))
        index.register(info("b", 1001))
        assert index.apply("a", {"cpu": [key(1), key(2)], "disk": [key(2)]}, {})
        assert index.apply("b", {"disk": [key(2), key(3)]}, {})
        assert index.locate([key(1), key(2), key(3), key(4)]) == [
            {"a": ["cpu"]}, {"a": ["cpu", "disk"], "b": ["disk"]}, {"b": ["disk"]}, {}]
        assert index.counts("a") == {"cpu": 2, "disk": 1}
        got = {i.instance_id: i for i in index.instances()}
        assert set(got) == {"a", "b"} and got["b"].port == 1001
        assert got["a"].namespaces == [Namespace("m", "ab" * 32, 16)]
        assert [t.name for t in got["a"].tiers] == ["cpu", "disk"]

    def test_evict_and_unknown_instance(self, index):
        index.register(info("a"))
        index.apply("a", {"cpu": [key(1), key(2)]}, {})
        index.apply("a", {}, {"cpu": [key(1)]})
        assert index.locate([key(1), key(2)]) == [{}, {"a": ["cpu"]}]
        assert index.apply("ghost", {"cpu": [key(1)]}, {}) is False
        assert index.locate([key(1)]) == [{}]

    def test_heartbeat_updates_usage_and_unknown_is_false(self, index):
        index.register(info("a"))
        before = index.get_instance("a").last_seen
        assert index.heartbeat("a", [TierInfo("cpu", 100, 3, 30)], before + 5)
        got = index.get_instance("a")
        assert got.last_seen == pytest.approx(before + 5) and got.tiers == [TierInfo("cpu", 100, 3, 30)]
        assert index.heartbeat("nobody", None, time.time()) is False

    def test_expire_drops_silent_instances_and_their_entries(self, index):
        now = time.time()
        index.register(info("old"))
        index.register(info("new"))
        index.apply("old", {"cpu": [key(1)]}, {})
        index.apply("new", {"cpu": [key(1)]}, {})
        index.heartbeat("old", None, now - 100)
        index.heartbeat("new", None, now)
        assert index.expire(now - 10) == ["old"]
        assert [i.instance_id for i in index.instances()] == ["new"]
        assert index.locate([key(1)]) == [{"new": ["cpu"]}]
        assert index.heartbeat("old", None, now) is False

    def test_drop_one_tier_or_all_and_reset_on_register(self, index):
        index.register(info("a"))
        index.apply("a", {"cpu": [key(1)], "disk": [key(1), key(2)]}, {})
        assert index.drop("a", "disk") == 2
        assert index.locate([key(1), key(2)]) == [{"a": ["cpu"]}, {}]
        index.apply("a", {"disk": [key(2)]}, {})
        index.register(info("a"), reset=False)  # re-register keeping entries
        assert index.locate([key(2)]) == [{"a": ["disk"]}]
        index.register(info("a"))  # a restarted worker: everything it said before is gone
        assert index.locate([key(1), key(2)]) == [{}, {}]
        assert index.counts("a") == {}

    def test_unregister(self, index):
        index.register(info("a"))
        index.apply("a", {"cpu": [key(1)]}, {})
        assert index.unregister("a") is True
        assert index.unregister("a") is False
        assert index.instances() == [] and index.locate([key(1)]) == [{}]

    def test_large_batches(self, index):
        index.register(info("a"))
        keys = [i.to_bytes(32, "little") for i in range(2500)]
        index.apply("a", {"cpu": keys}, {})
        assert all(loc == {"a": ["cpu"]} for loc in index.locate(keys))
        assert index.drop("a") == 2500
        assert all(loc == {} for loc in index.locate(keys))

    def test_concurrent_writers(self, index):
        for n in range(4):
            index.register(info(f"w{n}"))

        def worker(n):
            for i in range(50):
                index.apply(f"w{n}", {"cpu": [key(i)]}, {})
                if i % 2:
                    index.apply(f"w{n}", {}, {"cpu": [key(i)]})

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        located = index.locate([key(i) for i in range(50)])
        assert all(set(loc) == ({f"w{n}" for n in range(4)} if i % 2 == 0 else set())
                   for i, loc in enumerate(located))


class TestMemoryIndex(IndexContract):
    def make(self):
        return MemoryIndex()


@needs_redis
class TestRedisIndex(IndexContract):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server):  # noqa: F811
        self.url = redis_server.url

    def make(self):
        return open_index(self.url)

    def test_shared_by_two_controllers_and_survives_a_restart(self):
        first, second = open_index(self.url), open_index(self.url)
        first.register(info("a"))
        first.apply("a", {"cpu": [key(1)]}, {})
        assert second.locate([key(1)]) == [{"a": ["cpu"]}]
        first.close()
        again = open_index(self.url)  # a restarted controller
        assert again.locate([key(1)]) == [{"a": ["cpu"]}]
        assert [i.instance_id for i in again.instances()] == ["a"]
        again.close()
        second.close()

    def test_prefixes_separate_fleets(self):
        a, b = RedisIndex(self.url, prefix="fleet-a:"), RedisIndex(self.url, prefix="fleet-b:")
        a.register(info("x"))
        a.apply("x", {"cpu": [key(1)]}, {})
        assert b.locate([key(1)]) == [{}] and b.instances() == []
        a.close()
        b.close()


@needs_redis
class TestRedisClusterIndex(IndexContract):
    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster):  # noqa: F811
        self.cluster = redis_cluster
        client = redis_cluster.nodes[0].client()
        yield
        for node in redis_cluster.nodes:  # each test starts empty
            node.client().flushall()
        client.close()

    def make(self):
        return open_index(self.cluster.url.replace("redis://", "redis+cluster://"))


def test_open_index_rejects_unknown_urls():
    with pytest.raises(ValueError):
        open_index("http://example.com")
    assert isinstance(open_index("memory"), MemoryIndex)
