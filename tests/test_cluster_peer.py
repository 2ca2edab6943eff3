"""PeerTier, ClusterNode and the management API with real sockets in one process (no model): a controller
served by uvicorn in a thread, and CacheEngines built from config with tier "peer" (each makes its ClusterNode).
Also the Tier contract on the PeerTier."""
from __future__ import annotations

import pytest
import torch

from kvfabric import CacheEngine, Config
from kvfabric.cache.builder import build_engine
from kvfabric.cluster.client import ControllerClient, ControllerError
from kvfabric.cluster.controller_app import create_app
from kvfabric.cluster.index_memory import MemoryIndex
from kvfabric.cluster.peer import PeerTier
from kvfabric.cluster.worker import ClusterNode
from kvfabric.config import ClusterConfig, CpuTierConfig, DiskTierConfig
from kvfabric.net.breaker import CircuitBreaker
from kvfabric.tiers.cpu import CpuTier
from tests.cluster_scripts.helpers import LAYOUT, ControllerThread, FakeClock, finishes, wait_for
from tests.tier_contract import TierContract

TOKEN = "cluster-token"
CHUNK = 16
TOKENS = list(range(1000, 1100))  # 6 whole chunks + 4 tokens
NUM_CHUNKS = len(TOKENS) // CHUNK


@pytest.fixture
def controller():
    ctl = ControllerThread(create_app(MemoryIndex(), token=TOKEN, instance_ttl_s=30, sweep_interval_s=0.2)).start()
    yield ctl
    ctl.stop()


@pytest.fixture
def api(controller):
    client = ControllerClient(controller.url, TOKEN)
    yield client
    client.close()


class Fleet:
    def __init__(self, url: str, tmp_path) -> None:
        self.url = url
        self.tmp_path = tmp_path
        self.engines: list[CacheEngine] = []

    def engine(self, name: str, cpu_bytes: int = 1 << 24, disk: bool = False, token: str = TOKEN,
               **cluster_kw) -> tuple[ClusterNode, CacheEngine]:
        kw = dict(report_interval_s=0.05, heartbeat_interval_s=0.2, lookup_ttl_s=0.5, fetch_timeout_s=2.0)
        kw.update(cluster_kw)
        config = Config(chunk_size=CHUNK, tiers=("cpu", "disk", "peer") if disk else ("cpu", "peer"),
                        cpu=CpuTierConfig(capacity=cpu_bytes),
                        disk=DiskTierConfig(path=str(self.tmp_path / name), capacity=1 << 26),
                        cluster=ClusterConfig(controller_url=self.url, token=token, instance_id=name, **kw))
        engine = build_engine(config, LAYOUT, "test-model")
        self.engines.append(engine)
        assert engine.node is not None
        if token == TOKEN:
            assert engine.node.flush_reports()  # registered, with the engine's namespace
        return engine.node, engine

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


@pytest.fixture
def fleet(controller, tmp_path):
    f = Fleet(controller.url, tmp_path)
    yield f
    f.close()


def kv(num_tokens=len(TOKENS), seed=0):
    return torch.randn(LAYOUT.shape(num_tokens), generator=torch.Generator().manual_seed(seed))


def stored_on_a(fleet, **kw):
    node_a, a = fleet.engine("a", **kw)
    data = kv()
    assert a.store(TOKENS, data) == NUM_CHUNKS
    a.flush()
    assert node_a.flush_reports()
    return node_a, a, data


def test_b_finds_and_fetches_a_chunks_then_keeps_a_copy(fleet, api):
    node_a, a, data = stored_on_a(fleet, disk=True)
    node_b, b = fleet.engine("b")
    assert b.lookup(TOKENS) == NUM_CHUNKS * CHUNK
    got = b.retrieve(TOKENS)
    assert torch.equal(got, data[:, :, :, :NUM_CHUNKS * CHUNK])
    counters = b.stats().counters
    assert counters["hit.peer"] == NUM_CHUNKS and counters.get("corrupt.peer", 0) == 0
    assert node_b.peer.counters["chunks_fetched"] == NUM_CHUNKS
    # promoted into B's cpu tier, and the fleet learns that B holds them too
    assert node_b.local[0].contains_many(b.keys(TOKENS)) == [True] * NUM_CHUNKS
    assert node_b.flush_reports()
    hits = {h["instance_id"]: h for h in api.lookup(tokens=TOKENS)["instances"]}
    assert hits["a"]["prefix_tokens"] == hits["b"]["prefix_tokens"] == NUM_CHUNKS * CHUNK
    assert hits["a"]["tier"] == "cpu" and hits["a"]["tiers"] == {"cpu": NUM_CHUNKS}
    assert b.retrieve(TOKENS).shape[3] == NUM_CHUNKS * CHUNK
    assert b.stats().counters["hit.cpu"] == NUM_CHUNKS  # second time: local


def test_peer_never_serves_an_instance_its_own_chunks(fleet, api):
    node_a, a, _ = stored_on_a(fleet)
    node_a.local[0].clear()  # A lost them locally; the index may still list A until the next report
    assert a.lookup(TOKENS) == 0


def test_dead_peer_is_a_bounded_miss_and_avoided(fleet):
    node_a, a, _ = stored_on_a(fleet)
    node_b, b = fleet.engine("b")
    node_a.server.close()  # A crashes: nothing listens any more, the index still lists it
    assert b.lookup(TOKENS) == NUM_CHUNKS * CHUNK  # the index says so...
    assert finishes(lambda: b.retrieve(TOKENS)).shape[3] == 0  # ...but the fetch fails: a clean miss, no hang
    assert node_b.peer.counters["fetch_errors"] >= 1 and node_b.peer.counters["suspected"] >= 1
    assert b.lookup(TOKENS) == 0  # A is avoided for a while


def test_dead_controller_is_a_fast_miss(fleet, controller):
    node_a, a, _ = stored_on_a(fleet)
    node_b, b = fleet.engine("b", lookup_ttl_s=0.0)
    clock = FakeClock()
    node_b.peer.breaker = CircuitBreaker(failures=2, backoff_max_s=10.0, backoff_start_s=0.5, clock=clock)
    controller.stop()
    assert finishes(lambda: [b.lookup(TOKENS) for _ in range(20)]) == [0] * 20
    # two failures open the breaker: it stops asking. A missed lookup asks the peer tier twice: for the chunks'
    # own keys, then for the other ways a parallel engine may have stored the first one (kvfabric.kv.shares)
    counters = node_b.peer.counters
    assert counters["lookup_errors"] == 2 and counters["lookups_skipped"] == 38
    clock.advance(0.5)
    assert b.lookup(TOKENS) == 0 and counters["lookup_errors"] == 3  # one probe per backoff window
    assert counters["lookups_skipped"] == 39
    assert b.lookup(TOKENS) == 0 and counters["lookups_skipped"] == 41
    assert a.lookup(TOKENS) == NUM_CHUNKS * CHUNK  # local caches are unaffected


def test_damaged_chunk_from_a_peer_is_rejected(fleet):
    node_a, a, data = stored_on_a(fleet, disk=True)
    disk = node_a.served["disk"].inner
    key0 = a.keys(TOKENS)[0]
    node_a.served["cpu"].inner.clear()  # serve from disk, where we damage chunk 0
    raw = bytearray(disk.path(key0).read_bytes())
    raw[-1] ^= 0xFF
    disk.path(key0).write_bytes(bytes(raw))
    node_b, b = fleet.engine("b")
    assert b.retrieve(TOKENS).shape[3] == 0  # chunk 0 fails its checksum on B: the prefix ends there
    assert b.stats().counters["corrupt.peer"] == 1
    assert node_b.local[0].contains_many([key0]) == [False]  # and it is not kept


def test_keep_fetched_false_does_not_keep_copies(fleet):
    stored_on_a(fleet)
    node_b, b = fleet.engine("b", keep_fetched=False)
    assert b.retrieve(TOKENS).shape[3] == NUM_CHUNKS * CHUNK
    assert node_b.local[0].usage().num_chunks == 0


def test_reporter_sees_lru_evictions(fleet, api):
    blob_bytes = LAYOUT.num_bytes(CHUNK) + 200
    node_a, a = fleet.engine("a", cpu_bytes=blob_bytes * 3)
    a.store(TOKENS, kv())  # 6 chunks into room for 3: the first ones are evicted inside the tier
    assert node_a.flush_reports()
    keys = a.keys(TOKENS)
    located = api.lookup(keys=keys, detail=True)["instances"][0]["chunk_tiers"]
    assert located == [[] if not present else ["cpu"] for present in node_a.local[0].contains_many(keys)]
    assert sum(map(bool, located)) == 3


def test_controller_restart_with_memory_index_gets_everything_again(fleet, controller, tmp_path):
    node_a, a, _ = stored_on_a(fleet)
    port = controller.port
    controller.stop()
    again = ControllerThread(create_app(MemoryIndex(), token=TOKEN), port=port).start()
    try:
        api = ControllerClient(again.url, TOKEN)
        wait_for(lambda: node_a.flush_reports(2.0) and api.lookup(tokens=TOKENS)["instances"], 20)
        assert api.lookup(tokens=TOKENS)["instances"][0]["prefix_chunks"] == NUM_CHUNKS
        api.close()
    finally:
        again.stop()


def test_silent_instance_is_dropped_and_closed_instance_unregisters(controller, fleet, api):
    controller.controller.instance_ttl_s = 0.5
    node_a, a, _ = stored_on_a(fleet)
    node_b, b = fleet.engine("b")
    assert node_b.flush_reports()
    assert {i["instance_id"] for i in api.instances()} == {"a", "b"}
    node_a.reporter.close(unregister=False)  # A stops heart-beating (hung or partitioned)
    wait_for(lambda: {i["instance_id"] for i in api.instances()} == {"b"}, 10)
    assert api.lookup(tokens=TOKENS)["instances"][0]["prefix_chunks"] == 0
    b.close()  # a clean shutdown unregisters at once
    fleet.engines.remove(b)
    wait_for(lambda: api.instances() == [], 5)


def test_wrong_token_worker_cannot_join(fleet, api):
    stored_on_a(fleet)
    node_x, x = fleet.engine("x", token="wrong")
    assert not node_x.flush_reports(2.0)
    assert x.lookup(TOKENS) == 0  # its lookups are refused: a miss
    assert "x" not in {i["instance_id"] for i in api.instances()}


def test_pin_unpin(fleet, api):
    blob_bytes = LAYOUT.num_bytes(CHUNK) + 200
    node_a, a = fleet.engine("a", cpu_bytes=blob_bytes * NUM_CHUNKS)
    a.store(TOKENS, kv())
    assert node_a.flush_reports()
    reply = api.pin(tokens=TOKENS[:32])  # the first two chunks
    assert reply["instances"]["a"] == {"ok": True, "chunks": 2, "error": None}
    other = list(range(5000, 5000 + NUM_CHUNKS * CHUNK))
    a.store(other, kv(len(other), seed=1))  # fills the tier: everything unpinned is evicted
    assert a.lookup(TOKENS) == 32
    api.pin("unpin", tokens=TOKENS[:32], instance="a", tier="cpu")
    a.store(list(range(9000, 9000 + NUM_CHUNKS * CHUNK)), kv(len(other), seed=2))
    assert a.lookup(TOKENS) == 0


def test_clear_instance_tier_and_all(fleet, api):
    node_a, a, _ = stored_on_a(fleet, disk=True)
    node_b, b = fleet.engine("b")
    other = list(range(7000, 7064))
    assert b.store(other, kv(len(other))) == 4
    assert node_b.flush_reports()
    reply = api.clear(instance="a", tier="cpu")
    assert reply["instances"]["a"]["ok"] and reply["instances"]["a"]["chunks"] == NUM_CHUNKS
    assert node_a.served["cpu"].usage().num_chunks == 0 and node_a.served["disk"].usage().num_chunks == NUM_CHUNKS
    hits = {h["instance_id"]: h for h in api.lookup(tokens=TOKENS)["instances"]}
    assert hits["a"]["tier"] == "disk"
    reply = api.clear()
    assert set(reply["instances"]) == {"a", "b"} and all(r["ok"] for r in reply["instances"].values())
    assert all(h["prefix_chunks"] == 0 for h in api.lookup(tokens=TOKENS)["instances"])
    assert all(h["prefix_chunks"] == 0 for h in api.lookup(tokens=other)["instances"])
    node_a.peer.clear()  # forget recent answers (else they stand for lookup_ttl_s)
    node_b.peer.clear()
    assert a.lookup(TOKENS) == 0 and b.lookup(other) == 0 and a.lookup(other) == 0


def test_move_copy_and_migrate(fleet, api):
    node_a, a, data = stored_on_a(fleet)
    node_b, b = fleet.engine("b", disk=True)
    reply = api.move(src="a", dst="b", dst_tier="disk", tokens=TOKENS)
    assert reply["chunks"] == NUM_CHUNKS and reply["missing"] == 0
    assert reply["bytes"] == sum(len(node_a.served["cpu"].get(k)) for k in a.keys(TOKENS))
    disk_b = node_b.served["disk"]
    assert disk_b.contains_many(a.keys(TOKENS)) == [True] * NUM_CHUNKS
    hits = {h["instance_id"]: h for h in api.lookup(tokens=TOKENS)["instances"]}
    assert hits["b"]["tier"] == "disk" and hits["a"]["prefix_chunks"] == NUM_CHUNKS
    # migrate A's cpu copies to B's cpu: A loses them
    reply = api.move(src="a", src_tier="cpu", dst="b", dst_tier="cpu", tokens=TOKENS, mode="migrate")
    assert reply["chunks"] == NUM_CHUNKS
    assert node_a.served["cpu"].usage().num_chunks == 0
    hits = {h["instance_id"]: h for h in api.lookup(tokens=TOKENS)["instances"]}
    assert hits["a"]["prefix_chunks"] == 0 and hits["b"]["tier"] == "cpu"
    assert torch.equal(b.retrieve(TOKENS), data[:, :, :, :NUM_CHUNKS * CHUNK])
    # within one instance: B's cpu -> B's disk
    reply = api.move(src="b", src_tier="cpu", dst="b", dst_tier="disk", keys=[k.hex() for k in b.keys(TOKENS)])
    assert reply["chunks"] == NUM_CHUNKS
    with pytest.raises(ControllerError) as err:
        api.move(src="a", dst="b", dst_tier="nvme", tokens=TOKENS)
    assert err.value.status == 400


def test_engines_built_from_config_share_chunks_through_the_controller(controller, tmp_path):
    """The user path: `tiers: [cpu, peer]` plus a `cluster` section; nothing wired by hand."""
    from kvfabric.config import ClusterConfig
    def config(name: str) -> Config:
        return Config(chunk_size=CHUNK, tiers=("cpu", "peer"), cluster=ClusterConfig(
            controller_url=controller.url, token=TOKEN, instance_id=name, report_interval_s=0.05,
            heartbeat_interval_s=0.2, lookup_ttl_s=0.1))
    kv = torch.randn(LAYOUT.shape(len(TOKENS)))
    with build_engine(config("a"), LAYOUT, "test-model") as a, build_engine(config("b"), LAYOUT, "test-model") as b:
        assert a.store(TOKENS, kv[:, :, :, :NUM_CHUNKS * CHUNK]) == NUM_CHUNKS
        assert wait_for(lambda: b.lookup(TOKENS) == NUM_CHUNKS * CHUNK)
        got = b.retrieve(TOKENS[:NUM_CHUNKS * CHUNK])
        assert torch.equal(got, kv[:, :, :, :NUM_CHUNKS * CHUNK].to(LAYOUT.torch_dtype))
        assert b.stats().counters["hit.peer"] == NUM_CHUNKS
        assert b.store(TOKENS, kv[:, :, :, :NUM_CHUNKS * CHUNK]) == 0  # kept locally on fetch


def test_flush_to_peers_returns_once_a_peer_can_find_the_chunks(controller):
    """A P/D prefill instance answers after flush(to_peers=True): the decode instance's lookup right after hits."""
    from kvfabric.config import ClusterConfig
    def config(name: str, interval_s: float) -> Config:
        return Config(chunk_size=CHUNK, tiers=("cpu", "peer"), cluster=ClusterConfig(
            controller_url=controller.url, token=TOKEN, instance_id=name, report_interval_s=interval_s,
            lookup_ttl_s=0.0))
    kv = torch.randn(LAYOUT.shape(NUM_CHUNKS * CHUNK))
    # a report interval far longer than the test: only the flush can have told the controller
    with build_engine(config("a", 600.0), LAYOUT, "m") as a, build_engine(config("b", 600.0), LAYOUT, "m") as b:
        assert a.node.flush_reports()  # registered, nothing stored yet
        assert a.store(TOKENS, kv) == NUM_CHUNKS
        a.flush(to_peers=True)  # (a plain flush() here leaves b's lookup at 0 until the next report)
        assert b.lookup(TOKENS) == NUM_CHUNKS * CHUNK


def test_peer_tier_must_be_last_and_needs_a_controller():
    from kvfabric.config import ClusterConfig, ConfigError
    with pytest.raises(ConfigError, match="'peer' must come last"):
        Config(tiers=("peer", "cpu"), cluster=ClusterConfig(controller_url="x"))
    with pytest.raises(ConfigError, match="controller_url"):
        Config(tiers=("cpu", "peer"))


def test_closing_the_peer_tier_leaves_the_node_running(fleet, api):
    node_a, a, _ = stored_on_a(fleet)
    node_a.peer.close()  # the stack closing its tiers does not end the node's membership
    assert node_a.flush_reports() and "a" in {i["instance_id"] for i in api.instances()}
    a.close()  # the engine closes the node it made: it leaves the fleet at once
    fleet.engines.remove(a)
    assert api.instances() == []


# ---- the shared tier contract (tests/tier_contract.py) -----------------------------------------------------
class TestPeerContract(TierContract):
    """A PeerTier stores nothing: chunks are seeded into another instance's served cpu tier and found through
    the controller."""
    declared = dict(is_trusted=False, is_read_only=True, is_persistent=False, is_shared=False, honors_capacity=False,
                    honors_pins=False, is_zero_copy=False)

    @pytest.fixture(autouse=True)
    def _source(self, controller):
        self.url = controller.url
        self.source = ClusterNode([CpuTier(1 << 26)], ClusterConfig(controller_url=self.url, token=TOKEN,
                                                                   instance_id="source", report_interval_s=0.05))
        yield
        self.source.close()

    def make_tier(self, capacity_bytes):
        return PeerTier(ClusterConfig(controller_url=self.url, token=TOKEN, lookup_ttl_s=0.0), "reader", miss_ttl_s=0.0)

    def reopen(self, tier):
        return self.make_tier(tier.capacity_bytes)

    def seed(self, tier, items):
        for k, blob in items:
            assert self.source.served["cpu"].put(k, blob)
        assert self.source.flush_reports()
