"""KV events (kvfabric.observe.events) from a real engine to a real ZMQ subscriber (pyzmq): BlockStored with the chunk keys
and tokens, BlockRemoved for deletes and for evictions found by the sweep, replay from a sequence number. Payloads
are decoded untyped (plain msgpack structure), so the test checks the wire format, not our own classes."""
from __future__ import annotations

import msgspec
import pytest
import torch
import zmq

from kvfabric import CacheEngine, Config, KVLayout
from kvfabric.cache.builder import build_engine
from kvfabric.config import CpuTierConfig, KVEventsConfig
from kvfabric.observe.events import ChunkEvents
from tests.cluster_scripts.helpers import free_port

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
CHUNK = 16
CHUNK_BYTES = 2 * 2 * 2 * CHUNK * 8 * 4


def kv(num_tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(num_tokens), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def engine_with_events(cpu_bytes: int = 1 << 24, replay: bool = False) -> CacheEngine:
    events = KVEventsConfig(enabled=True, endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kvf",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}" if replay else "", interval_s=0.05)
    config = Config(chunk_size=CHUNK, tiers=("cpu",), cpu=CpuTierConfig(capacity=cpu_bytes), kv_events=events)
    return build_engine(config, LAYOUT, "m")


def receive(sub: zmq.Socket, timeout_ms: int = 10_000) -> tuple[bytes, int, list]:
    assert sub.poll(timeout_ms), "no KV event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    ts, events, *rank = msgspec.msgpack.decode(payload)  # EventBatch is array-like: [ts, events, dp_rank]
    assert isinstance(ts, float) and isinstance(events, list)
    return topic, int.from_bytes(seq, "big"), events


def connected_subscriber(ctx: zmq.Context, engine: CacheEngine) -> zmq.Socket:
    """A SUB socket that has provably joined: PUB drops messages sent before a subscriber connects, so store
    probe prompts until one arrives (each probe is a new chunk, hence a new event)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvf")
    sub.connect(engine.config.kv_events.endpoint)
    for probe in range(200):
        engine.store([10**6 + probe] * CHUNK, kv(CHUNK, probe))
        if sub.poll(200):
            while sub.poll(300):  # drain the probes' batches
                sub.recv_multipart()
            return sub
    raise TimeoutError("the subscriber never received the probes")


def test_stored_and_removed_events_reach_a_zmq_subscriber(ctx):
    tokens = list(range(100))  # 6 whole chunks
    with engine_with_events() as engine:
        sub = connected_subscriber(ctx, engine)
        keys = engine.keys(tokens)
        assert engine.store(tokens[:48], kv(48)) == 3
        assert engine.store(tokens, kv(96)[:, :, :, 48:], start=48) == 3
        stored = []
        while len(stored) < 2:
            topic, seq, events = receive(sub)
            assert topic == b"kvf"
            stored += [e for e in events if e["type"] == "BlockStored"]
        first, second = stored
        assert first["block_hashes"] == [bytes(k) for k in keys[:3]] and first["parent_block_hash"] is None
        assert first["token_ids"] == tokens[:48] and first["block_size"] == CHUNK
        assert second["block_hashes"] == [bytes(k) for k in keys[3:6]]
        assert second["parent_block_hash"] == bytes(keys[2]) and second["token_ids"] == tokens[48:96]
        assert first["medium"] == "CPU" and first["lora_id"] is None

        assert engine.delete(tokens) == 6
        _, _, events = receive(sub)
        assert events == [{"type": "BlockRemoved", "block_hashes": [bytes(k) for k in keys[:6]], "medium": None}]
        assert engine.stats().kv_events["removed"] == 6


def test_evicted_chunks_are_announced_as_removed(ctx):
    with engine_with_events(cpu_bytes=4 * CHUNK_BYTES + 1000) as engine:
        sub = connected_subscriber(ctx, engine)
        gone_before = engine.stats().tier_counters["cpu"].get("evicted", 0)
        tokens = list(range(8 * CHUNK))
        engine.store(tokens, kv(len(tokens)))
        keys = [bytes(k) for k in engine.keys(tokens)]
        removed: set[bytes] = set()
        evicted = engine.stats().tier_counters["cpu"]["evicted"] - gone_before
        assert evicted >= 4
        present = set(k for k, hit in zip(keys, engine.stack.contains_many(keys)) if hit)
        while not (set(keys) - present) <= removed:
            _, _, events = receive(sub)
            for e in events:
                if e["type"] == "BlockRemoved":
                    removed.update(e["block_hashes"])
        assert not removed & present  # nothing still held was announced as gone
        assert engine.stats().kv_events["evicted"] >= len(set(keys) - present)


def test_replay_from_a_sequence_number(ctx):
    with engine_with_events(replay=True) as engine:
        for i in range(3):
            engine.store([i] * CHUNK * 2, kv(2 * CHUNK, i))
            engine.publisher.publish_now()  # one batch per store
        req = ctx.socket(zmq.DEALER)
        req.connect(engine.config.kv_events.replay_endpoint)
        req.send_multipart([b"", (1).to_bytes(8, "big")])
        seqs = []
        while True:
            assert req.poll(10_000)
            _, seq, payload = req.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            seqs.append(int.from_bytes(seq, "big"))
            assert msgspec.msgpack.decode(payload)[1][0]["type"] == "BlockStored"
        assert seqs and seqs[0] == 1 and seqs == sorted(seqs)


def test_events_queue_is_bounded_and_counts_drops():
    events = ChunkEvents(16, max_queued=3, max_tracked=2)
    for i in range(5):
        events.stored([bytes([i]) * 32], None, [])
    assert len(events.take()) == 3 and events.counters["dropped"] == 2
    assert events.num_tracked == 2  # the oldest keys were forgotten
    assert events.sweep(lambda keys: [False] * len(keys)) == 2
    assert events.take()[0].block_hashes == [bytes([3]) * 32, bytes([4]) * 32]


def test_sweep_fault_is_not_a_removal():
    events = ChunkEvents(16)
    events.stored([b"k" * 32], None, [])
    events.take()

    def broken(keys):
        raise ConnectionError("tier down")
    assert events.sweep(broken) == 0 and events.take() == []
    assert events.sweep(lambda keys: [False] * len(keys)) == 1
