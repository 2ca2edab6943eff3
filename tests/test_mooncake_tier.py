"""MooncakeTier against a real mooncake_master: the tier contract, zero-copy reads into registered scratch buffers,
batches, a master killed / hung / absent (misses within the deadline, recovery), damaged objects, two processes."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfabric.cache.builder import build_engine
from kvfabric.config import Config, ConfigError, MooncakeTierConfig
from kvfabric.host.pages import Scratch
from kvfabric.net.breaker import CircuitBreaker
from kvfabric.tiers.disk import DiskTier
from kvfabric.tiers.factory import build_tiers
from kvfabric.tiers.stack import TierStack
from tests.cluster_scripts.helpers import FakeClock, finishes, wait_for
from tests.mooncake_fixtures import MooncakeMaster, hang, mooncake_master, needs_mooncake, shared_mooncake_master  # noqa: F401 - fixtures are used by name
from tests.redis_fixtures import make_blob
from tests.tier_contract import TierContract

pytestmark = needs_mooncake
ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(segment_bytes=64 * 2**20, buffer_bytes=16 * 2**20)


def key_of(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def make_tier(master: MooncakeMaster, **kwargs):
    from kvfabric.tiers.mooncake import MooncakeTier
    return MooncakeTier(**master.tier_args(), **{**SMALL, "timeout_s": 2.0, **kwargs})


def raw_client(master: MooncakeMaster):
    """A plain Mooncake client (no segment of its own) on loopback: what another program sees in the store."""
    from mooncake.store import MooncakeDistributedStore

    from tests.cluster_scripts.helpers import free_port
    store = MooncakeDistributedStore()
    assert store.setup(f"127.0.0.1:{free_port()}", master.metadata_url, 0, 16 * 2**20, "tcp", "", master.address) == 0
    return store


@pytest.fixture
def tier(mooncake_master: MooncakeMaster):
    t = make_tier(mooncake_master)
    yield t
    t.close()


def test_round_trip_and_protocol(tier, mooncake_master: MooncakeMaster) -> None:
    from kvfabric.tiers.mooncake import object_key
    k1, k2, k3 = key_of(1), key_of(2), key_of(3)
    assert tier.get(k1) is None and tier.contains_many([]) == []
    assert tier.put(k1, b"bytes-value")
    assert tier.put(k2, bytearray(b"bytearray-value"))
    assert tier.put(k3, memoryview(b"xxmemoryview-value")[2:])
    assert bytes(tier.get(k1)) == b"bytes-value"
    assert bytes(tier.get_into(k2, Scratch())) == b"bytearray-value"
    assert bytes(tier.get(k3)) == b"memoryview-value"
    assert tier.put(k1, b"overwritten, and longer than before")  # an upsert: Mooncake's put would keep the old one
    assert bytes(tier.get(k1)) == b"overwritten, and longer than before"
    raw = raw_client(mooncake_master)
    try:
        assert object_key(k1) == "kvf:" + k1.hex() and raw.get(object_key(k1)) == b"overwritten, and longer than before"
        raw.put("other:key", b"not ours")
        assert sorted(tier.keys()) == sorted([k1, k2, k3]) and tier.usage().num_chunks == 3
        assert tier.delete(k1) and not tier.delete(k1) and tier.get(k1) is None
        tier.pin([k2])
        tier.unpin([k2])  # no-ops
        tier.clear()
        assert tier.keys() == [] and tier.get(k2) is None
        assert raw.get("other:key") == b"not ours"  # clear() only touches kvf: objects
    finally:
        raw.close()
    assert not tier.put(k1, b"") and tier.counters["put.empty"] == 1  # Mooncake refuses empty objects


def test_reads_land_in_the_callers_registered_scratch(tier) -> None:
    blobs = {size: os.urandom(size) for size in (int(5.9e6), 33_600_000, 1000)}
    for size, blob in blobs.items():
        assert tier.put(key_of(size), blob)
    scratch = Scratch()
    for size, blob in blobs.items():  # growing, then a smaller object into the grown buffer
        got = tier.get_into(key_of(size), scratch)
        assert got is not None and bytes(got) == blob
        assert got.obj is scratch.view(1).obj  # the bytes are in the scratch's own buffer: no copy after the read
    registered = tier.counters["buffers.registered"]
    for _ in range(5):
        assert bytes(tier.get_into(key_of(1000), scratch)) == blobs[1000]
    assert tier.counters["buffers.registered"] == registered <= 3  # one registration per buffer, not per read


def test_batches(tier) -> None:
    keys = [key_of(i) for i in range(10)]
    blobs = [os.urandom(1000 + i) for i in range(10)]
    assert tier.put_many(list(zip(keys[:8], blobs[:8]))) == [True] * 8
    scratches = [Scratch() for _ in keys]
    got = tier.get_many_into(keys, scratches)
    assert [None if g is None else bytes(g) for g in got] == blobs[:8] + [None, None]
    assert tier.contains_many(keys) == [True] * 8 + [False, False]
    with pytest.raises(ValueError):
        tier.get_many_into(keys, scratches[:2])
    # a key repeated in a batch: Mooncake's batch_get_into would fill one buffer of the two (and say both)
    again = tier.get_many_into([keys[0], keys[1], keys[0], keys[0]], scratches[:4])
    assert [bytes(g) for g in again] == [blobs[0], blobs[1], blobs[0], blobs[0]]
    assert len({id(g.obj) for g in again}) == 4  # each in its own scratch
    assert tier.put_many([(keys[0], b"first"), (keys[0], b"second")]) == [True, True]
    assert bytes(tier.get(keys[0])) == b"second"  # as two puts in a row
    tier.capacity_bytes = 1500
    assert tier.put_many([(keys[8], b"x" * 1501), (keys[9], b"y" * 10)]) == [False, True]
    assert tier.counters["put.too_large"] == 1


def network_calls(tier) -> int:
    names = tier.counters.snapshot()
    return sum(n for name, n in names.items() if name.endswith((".errors", ".timeouts")))


def test_master_killed_and_restarted_mid_run(tier, mooncake_master: MooncakeMaster) -> None:
    clock = FakeClock()
    tier.breaker = CircuitBreaker(failures=3, backoff_max_s=0.4, clock=clock)
    keys = [key_of(i) for i in range(20)]
    blob = make_blob(keys[0], 100_000)
    for key in keys[:10]:
        assert tier.put(key, blob)
    scratch = Scratch()
    assert tier.contains_many(keys[:10]) == [True] * 10 and tier.get_into(keys[0], scratch) is not None
    mooncake_master.stop()

    def calls() -> float:
        started = time.monotonic()
        assert tier.contains_many(keys) == [False] * 20
        assert tier.get_into(keys[0], scratch) is None
        assert tier.put(keys[0], blob) is False
        assert tier.delete(keys[0]) is False
        assert tier.keys() == [] and tier.usage().num_chunks == 0
        tier.clear()
        return time.monotonic() - started

    elapsed = finishes(calls)
    assert elapsed < 3 * tier.timeout_s + 3  # each call bounded by timeout_s; the breaker then answers at once
    assert tier.breaker.is_open and network_calls(tier) == 3
    for _ in range(100):  # while open, nothing goes to the network
        assert tier.get(keys[0]) is None and not tier.put(keys[1], blob)
    assert network_calls(tier) == 3 and tier.counters["put.dropped"] >= 101

    mooncake_master.start()  # same ports; a fresh master knows nothing (objects lived in its memory map)

    def probe() -> bool:
        clock.advance(1.0)  # past the backoff: the next call is the half-open probe
        return tier.put(keys[0], blob)

    wait_for(probe, 60, interval_s=0.2)  # the client reconnects and remounts its segment by itself
    assert not tier.breaker.is_open and tier.counters["breaker.closed"] == 1
    assert bytes(tier.get_into(keys[0], scratch)) == bytes(blob)
    assert tier.contains_many(keys[:2]) == [True, False]


def test_master_down_at_start_is_misses_then_works(tmp_path: Path) -> None:
    master = MooncakeMaster(tmp_path / "late")
    tier = make_tier(master, timeout_s=0.5)
    try:
        clock = FakeClock()
        tier.breaker = CircuitBreaker(failures=2, backoff_max_s=0.4, clock=clock)

        def calls() -> None:
            for _ in range(10):
                assert tier.get(key_of(1)) is None and not tier.put(key_of(1), b"v")
                assert tier.contains_many([key_of(1)]) == [False]

        finishes(calls)
        assert tier.breaker.is_open and network_calls(tier) == 2
        master.start()

        def probe() -> bool:
            clock.advance(1.0)
            return tier.put(key_of(1), b"v")

        wait_for(probe, 60, interval_s=0.2)
        assert bytes(tier.get(key_of(1))) == b"v"
    finally:
        tier.close()
        master.stop()


def test_hung_master_never_hangs_the_caller(tier, mooncake_master: MooncakeMaster) -> None:
    tier.timeout_s = 0.3
    clock = FakeClock()
    tier.breaker = CircuitBreaker(failures=2, backoff_max_s=0.3, clock=clock)
    assert tier.put(key_of(1), b"v")
    hang(mooncake_master)  # alive but silent: only the deadline can help
    scratch = Scratch()
    try:
        def calls() -> None:
            for _ in range(10):
                assert tier.get_into(key_of(1), scratch) is None
                assert tier.contains_many([key_of(1), key_of(2)]) == [False, False]
            assert not tier.put(key_of(3), b"v")

        finishes(calls, 30)
        assert network_calls(tier) == 2 and tier.breaker.is_open
    finally:
        os.kill(mooncake_master.proc.pid, signal.SIGCONT)
    tier.timeout_s = 2.0

    def recovered() -> bool:
        clock.advance(1.0)
        got = tier.get_into(key_of(1), scratch)
        return got is not None and bytes(got) == b"v"

    wait_for(recovered, 60, interval_s=0.2)


def test_corrupted_object_is_a_miss(tier, mooncake_master: MooncakeMaster, tmp_path: Path) -> None:
    from kvfabric.tiers.mooncake import object_key
    key = key_of(7)
    blob = make_blob(key, 4096, seed=7)
    stack = TierStack([tier])
    stack.put(key, blob)
    stack.flush()
    assert tier.contains_many([key]) == [True]
    damaged = bytearray(blob)
    damaged[2000:2003] = b"\xff\x00\xff"
    raw = raw_client(mooncake_master)
    try:
        assert raw.upsert(object_key(key), bytes(damaged)) == 0  # written raw through the store client
        assert stack.get(key) is None and stack.counters["corrupt.mooncake"] == 1
        assert raw.is_exist(object_key(key)) == 0  # the damaged object was removed

        disk = DiskTier(tmp_path / "disk", 10**8)
        stack2 = TierStack([make_tier(mooncake_master), disk])
        stack2.put(key, blob)
        stack2.flush()
        assert raw.upsert(object_key(key), bytes(damaged[:500])) == 0  # truncated this time
        got = stack2.get(key)
        assert got is not None and got.tier == "disk" and bytes(got.blob) == bytes(blob)
        assert stack2.counters["corrupt.mooncake"] == 1
        stack2.flush()  # the disk hit is promoted back into the store, intact
        assert raw.get(object_key(key)) == bytes(blob)
        stack2.close()
    finally:
        raw.close()


def test_built_from_config(mooncake_master: MooncakeMaster) -> None:
    from kvfabric.tiers.mooncake import MooncakeTier
    section = MooncakeTierConfig(master=mooncake_master.address, metadata_url=mooncake_master.metadata_url,
                                 metrics_url=mooncake_master.metrics_url, segment=64 * 2**20, buffer=16 * 2**20,
                                 timeout_s=0.7, capacity=10**6, breaker_failures=4)
    (tier,) = build_tiers(Config(tiers=("mooncake",), mooncake=section))
    try:
        assert isinstance(tier, MooncakeTier) and tier.master == mooncake_master.address
        assert (tier.timeout_s, tier.capacity_bytes, tier.breaker.threshold, tier.segment_bytes) == \
            (0.7, 10**6, 4, 64 * 2**20)
        assert tier.put(key_of(1), b"v") and bytes(tier.get(key_of(1))) == b"v"
        assert not tier.put(key_of(2), b"x" * (10**6 + 1))
    finally:
        tier.close()
    assert Config.from_dict({"tiers": ["cpu", "mooncake"], "mooncake": {"segment": "1GiB"}}).mooncake.segment == 2**30
    assert Config.from_dict({"mooncake": {"segment": 0}}).mooncake.segment == 0  # a pure client lends no memory
    with pytest.raises(ConfigError, match="mooncake.buffer: must be positive"):
        Config.from_dict({"mooncake": {"buffer": 0}})
    with pytest.raises(ConfigError, match="mooncake.protocol"):
        Config.from_dict({"mooncake": {"protocol": "udp"}})
    with pytest.raises(ConfigError, match="mooncake.timeout_s"):
        Config.from_dict({"mooncake": {"timeout_s": 0}})


# ---- the shared tier contract (tests/tier_contract.py) -----------------------------------------------------
class TestMooncakeContract(TierContract):
    """The master evicts at its own watermark and a client cannot pin an object (honors_capacity and honors_pins
    False, checked in that form); objects live in the segments of live clients, so a closed tier's objects are
    gone (is_persistent False) while every other client sees them (is_shared True)."""
    declared = dict(is_trusted=False, is_read_only=False, is_persistent=False, is_shared=True, honors_capacity=False,
                    honors_pins=False, is_zero_copy=False)

    @pytest.fixture(autouse=True)
    def _master(self, shared_mooncake_master: MooncakeMaster) -> None:
        self.master = shared_mooncake_master

    def make_tier(self, capacity_bytes):
        tier = make_tier(self.master, capacity_bytes=capacity_bytes)
        tier.clear()  # one master serves the whole module
        return tier

    def reopen(self, tier):
        return make_tier(self.master, capacity_bytes=tier.capacity_bytes)


def test_engines_share_chunks_through_mooncake(mooncake_master: MooncakeMaster) -> None:
    import torch

    from kvfabric import KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
    section = MooncakeTierConfig(master=mooncake_master.address, metadata_url=mooncake_master.metadata_url,
                                 metrics_url=mooncake_master.metrics_url, segment=64 * 2**20, buffer=16 * 2**20)
    tokens = list(range(100))
    kv = torch.randn(layout.shape(100), generator=torch.Generator().manual_seed(0)).to(torch.float16)
    with build_engine(Config(chunk_size=16, tiers=("cpu", "mooncake"), mooncake=section), layout, "m") as writer:
        assert writer.store(tokens, kv) == 6
        writer.flush()
        with build_engine(Config(chunk_size=16, tiers=("mooncake",), mooncake=section), layout, "m") as reader:
            assert reader.lookup(tokens) == 96
            assert torch.equal(reader.retrieve(tokens), kv[:, :, :, :96])


def _child(master: MooncakeMaster, mode: str, seed: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.Popen([sys.executable, "-m", "tests.mooncake_child", master.address, master.metadata_url,
                             master.metrics_url, mode, str(seed)], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


@pytest.mark.slow
def test_two_processes_share_chunks_through_the_store(mooncake_master: MooncakeMaster) -> None:
    """Process A stores a prompt's chunks (they may land in its own segment or in ours), process B, started
    later, reads them all back exactly; and the other way round."""
    writer = _child(mooncake_master, "store", seed=3)
    try:
        assert writer.stdout.readline().strip() == "stored 6"
        reader = _child(mooncake_master, "check", seed=3)
        out, _ = reader.communicate(timeout=120)
        assert out.strip() == "hit 96 equal"
    finally:
        writer.communicate("done\n", timeout=60)
    assert writer.returncode == 0

    from tests.mooncake_child import LAYOUT, prompt
    section = MooncakeTierConfig(master=mooncake_master.address, metadata_url=mooncake_master.metadata_url,
                                 metrics_url=mooncake_master.metrics_url, segment=64 * 2**20, buffer=16 * 2**20)
    tokens, kv = prompt(4)
    with build_engine(Config(chunk_size=16, tiers=("mooncake",), mooncake=section), LAYOUT, "shared") as engine:
        assert engine.store(tokens, kv) == 6
        engine.flush()
        reader = _child(mooncake_master, "check", seed=4)
        out, _ = reader.communicate(timeout=120)
        assert out.strip() == "hit 96 equal"


@pytest.mark.slow
def test_bench_rows() -> None:
    """`kvfabric bench tiers --mooncake` rows: the fields every tier row has, bytes checked; no speed asserted."""
    from kvfabric.bench.tiers_mooncake import bench_mooncake
    rows = bench_mooncake(repeats=1, sizes={"1 MB": 1_000_000})
    assert [(r["tier"], r["op"]) for r in rows] == [("mooncake", "store"), ("mooncake", "retrieve")] * 2
    assert all(r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["ratio"] > 0 for r in rows)
    assert [r.get("target") for r in rows] == [0.9, 0.9, None, None]
