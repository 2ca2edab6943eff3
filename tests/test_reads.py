"""kvfabric.cache.reads and the retrieve read-ahead: every read by key gives verified KV or a miss, from every tier.

For each tier a chunk is read from (disk, shm read in place, Redis, a peer over P2P) and each read operation
(`read_into`, `read_chunk`, `open_chunk` of a token-major chunk, `open_chunk` of a block-layout chunk copied slab by
slab and by the native placer, `read_many`, `retrieve`), a chunk whose payload has a flipped byte, or whose blob was
truncated, never reaches the caller as KV: the operation answers a miss, or the source's `with` raises ChunkFailed,
so the caller throws away what it copied. The damaged chunk is dropped from the tier (a peer's copy is the peer's)
and counted. A view of shared memory that a writer reuses while the caller copies it raises ChunkFailed("torn"),
counted and not dropped. The cpu tier is process memory and trusted (no check, by declaration): it is the control
that every operation returns exactly what was stored.

The callers here do what the connectors do, and nothing more: no hashing, no discard.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvfabric.cache.builder import build_engine
from kvfabric.cache.engine import CacheEngine
from kvfabric.cache.placer import ChunkPlacer
from kvfabric.cache.protocol import BlockSource, ChunkFailed, ChunkMiss, Read, TokenSource
from kvfabric.cluster.controller_app import create_app
from kvfabric.cluster.index_memory import MemoryIndex
from kvfabric.codec.format import HEADER_BYTES
from kvfabric.config import Config
from kvfabric.host.pages import Scratch
from kvfabric.kv.blocks import BlockLayout, as_words
from kvfabric.kv.layout import KVLayout
from kvfabric.tiers.base import Tier
from kvfabric.tiers.factory import build_tiers
from kvfabric.tiers.shm.tier import ShmTier
from tests.cluster_scripts.helpers import ControllerThread
from tests.redis_fixtures import needs_redis, redis_server, redis_url  # noqa: F401

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float16")
CHUNK = 32
BLOCKS = BlockLayout(16, False, True)  # vLLM's CPU cache: K token-major, V dim-major regions
TOKENS = list(range(7, 7 + 2 * CHUNK))
BLOCK_TOKENS = list(range(5000, 5000 + CHUNK))  # the block-layout chunk's prompt
TOKEN = "reads-token"
DAMAGES = ["flip", "truncate"]


@dataclass
class Bench:
    """A reader's engine whose reads come from one tier, the tier holding the chunks (the serving peer's disk for
    "peer"), and the tier's name in the reader's counters."""
    reader: CacheEngine
    holder: Tier
    name: str
    close: Callable[[], None]
    writer: CacheEngine | None = None  # stores the chunks (the reader itself, or the serving peer)


def _local(config: Config, name: str) -> Bench:
    (tier,) = build_tiers(config, (name,))
    engine = CacheEngine(config, LAYOUT, "m", tiers=[tier])
    return Bench(engine, tier, name, engine.close)


@pytest.fixture
def bench(request, tmp_path) -> Iterator[Bench]:
    name = request.param
    if name in ("disk", "cpu"):
        made = _local(Config.from_dict({"chunk_size": CHUNK, "disk": {"path": str(tmp_path / "chunks")}}), name)
    elif name == "shm":
        pool = f"test-{uuid.uuid4().hex[:12]}"
        made = _local(Config.from_dict({"chunk_size": CHUNK, "shm": {"name": pool, "capacity": 8 << 20}}), name)
        close = made.close
        made.close = lambda: (close(), ShmTier.destroy(pool))
    elif name == "redis":
        url = request.getfixturevalue("redis_url")
        made = _local(Config.from_dict({"chunk_size": CHUNK, "redis": {"url": url}}), name)
    else:
        made = _peers(tmp_path)
    try:
        yield made
    finally:
        made.close()


def _peers(tmp_path) -> Bench:
    """Engine A stores on its disk and serves it over P2P; engine B (an empty cpu tier, then the peer tier) reads."""
    controller = ControllerThread(create_app(MemoryIndex(), token=TOKEN, instance_ttl_s=30, sweep_interval_s=0.2))
    controller.start()

    def config(name: str, tiers: tuple[str, ...]) -> Config:
        return Config.from_dict({
            "chunk_size": CHUNK, "tiers": list(tiers), "disk": {"path": str(tmp_path / name)},
            "cluster": {"controller_url": controller.url, "token": TOKEN, "instance_id": name,
                        "report_interval_s": 0.05, "heartbeat_interval_s": 0.2, "lookup_ttl_s": 0.2,
                        "fetch_timeout_s": 2.0}})

    a = build_engine(config("a", ("disk", "peer")), LAYOUT, "m")
    b = build_engine(config("b", ("cpu", "peer")), LAYOUT, "m")
    assert isinstance(a, CacheEngine) and isinstance(b, CacheEngine)

    def close() -> None:
        b.close()
        a.close()
        controller.stop()

    return Bench(b, a.stack.tiers[0], "peer", close, writer=a)


def _writer(bench: Bench) -> CacheEngine:
    return bench.writer or bench.reader


def _kv(num_tokens: int = 2 * CHUNK, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(num_tokens), generator=torch.Generator().manual_seed(seed)).half()


def _published(bench: Bench) -> None:
    """The writer's stores landed, and a peer can find them."""
    writer = _writer(bench)
    writer.flush(to_peers=True)
    if writer is not bench.reader:
        assert writer.node is not None and writer.node.flush_reports()


def _store_tokens(bench: Bench) -> tuple[list[bytes], torch.Tensor]:
    kv = _kv()
    writer = _writer(bench)
    assert writer.store(TOKENS, kv) == 2
    _published(bench)
    return writer.keys(TOKENS), kv


def _store_blocks(bench: Bench) -> tuple[bytes, np.ndarray]:
    """A chunk in the block layout BLOCKS (what the vLLM connector saves): its key and its payload's words."""
    writer = _writer(bench)
    key = writer.keys(BLOCK_TOKENS)[0]
    payload = writer.new_payload(CHUNK, BLOCKS)
    assert payload.blocks == BLOCKS
    words = as_words(payload.kv)
    words[...] = np.random.default_rng(1).integers(-2**15, 2**15, words.shape, dtype=np.int16)
    expected = words.copy()
    assert writer.store_chunks([(key, payload)]) == [True]
    _published(bench)
    return key, expected


def _damage(bench: Bench, key: bytes, how: str) -> None:
    """Replace the stored blob of `key` in the holding tier by a damaged one: a payload byte flipped, or the blob
    cut short."""
    blob = bytearray(bytes(bench.holder.get(key)))
    if how == "flip":
        blob[HEADER_BYTES + len(blob) // 3] ^= 0x10
    else:
        del blob[-100:]
    path = getattr(bench.holder, "path", None)
    if path is not None:  # a chunk file, damaged where it lies (its tier's index, and a peer's controller, unaware)
        path(key).write_bytes(bytes(blob))
    else:
        assert bench.holder.delete(key)
        assert bench.holder.put(key, bytes(blob))


def _corrupt_count(bench: Bench) -> int:
    return bench.reader.stats().counters.get(f"corrupt.{bench.name}", 0)


def _copied(source: Read, placer: ChunkPlacer | None = None) -> object | None:
    """What a connector does with a read: copy the KV out inside the source's `with`; the copy counts only if the
    `with` ends cleanly. None: a miss, or the source failed (ChunkFailed)."""
    if isinstance(source, ChunkMiss):
        return None
    try:
        with source:
            if isinstance(source, TokenSource):
                return source.kv.clone()
            if placer is None:
                return np.stack([source.slab(i).copy() for i in range(source.num_layers)])
            runs = np.array([[0, 0, source.slab_shape[0], 0, BLOCKS.block_size]], dtype=np.int64)
            source.place(placer, runs)
            return np.stack([layer[:source.slab_shape[0]].copy() for layer in placer_layers(placer)])
    except ChunkFailed:
        return None


_PLACER_LAYERS: dict[int, list[np.ndarray]] = {}


def _placer(source_shape: tuple[int, ...]) -> ChunkPlacer:
    """A native placer into fresh block arrays [blocks, *block_shape] per layer (the vLLM loader's paged layers)."""
    num_blocks, *block = source_shape
    layers = [np.zeros((num_blocks + 2, *block), dtype=np.int16) for _ in range(LAYOUT.num_layers)]
    slab_bytes = num_blocks * int(np.prod(block)) * 2
    placer = ChunkPlacer(layers, BLOCKS, np.zeros(slab_bytes, dtype=np.uint8))
    _PLACER_LAYERS[id(placer)] = layers
    return placer


def placer_layers(placer: ChunkPlacer) -> list[np.ndarray]:
    return _PLACER_LAYERS[id(placer)]


TIERS = ["disk", "shm", pytest.param("redis", marks=needs_redis), "peer"]


# ---- intact chunks: every operation, every tier (cpu included), exactly what was stored ---------------------
@pytest.mark.parametrize("bench", ["cpu", *TIERS], indirect=True)
def test_every_read_gives_back_exactly_what_was_stored(bench):
    keys, kv = _store_tokens(bench)
    reader = bench.reader
    out = torch.empty(LAYOUT.shape(CHUNK), dtype=torch.float16)
    assert not isinstance(reader.read_into(keys[1], out), ChunkMiss) and torch.equal(out, kv[:, :, :, CHUNK:])
    assert torch.equal(_copied(reader.read_chunk(keys[0])), kv[:, :, :, :CHUNK])
    assert torch.equal(_copied(reader.open_chunk(keys[1])), kv[:, :, :, CHUNK:])
    (many,) = reader.read_many([keys[0]], [Scratch()])
    assert torch.equal(_copied(many), kv[:, :, :, :CHUNK])
    assert torch.equal(reader.retrieve(TOKENS), kv)
    key, words = _store_blocks(bench)
    for read in (reader.read_chunk, reader.open_chunk):
        source = read(key, CHUNK, blocks=BLOCKS)
        assert isinstance(source, BlockSource)
        assert np.array_equal(_copied(source), words)
    source = reader.open_chunk(key, CHUNK, blocks=BLOCKS)
    assert np.array_equal(_copied(source, _placer(words.shape[1:])), words)
    assert _corrupt_count(bench) == 0


# ---- damaged chunks: never handed over as KV ---------------------------------------------------------------
@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("op", ["read_into", "read_chunk", "open_chunk", "read_many", "retrieve"])
@pytest.mark.parametrize("bench", TIERS, indirect=True)
def test_a_damaged_token_chunk_is_a_miss_for_every_read(bench, op, how):
    keys, kv = _store_tokens(bench)
    _damage(bench, keys[0], how)
    reader = bench.reader
    if op == "read_into":
        got = reader.read_into(keys[0], torch.empty(LAYOUT.shape(CHUNK), dtype=torch.float16))
        assert isinstance(got, ChunkMiss)
    elif op == "retrieve":
        assert reader.retrieve(TOKENS).shape[3] == 0  # chunk 0 fails: the prefix ends before it
    elif op == "read_many":
        (source,) = reader.read_many([keys[0]], [Scratch()])
        assert _copied(source) is None
    else:
        assert _copied(getattr(reader, op)(keys[0])) is None
    assert _corrupt_count(bench) == 1
    if bench.name != "peer":  # a peer's copy is the peer's to drop
        assert not bench.holder.contains_many([keys[0]])[0]
    assert torch.equal(_copied(reader.read_chunk(keys[1])), kv[:, :, :, CHUNK:])  # the other chunk is fine


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("copy", ["slabs", "placer", "skipping"])
@pytest.mark.parametrize("op", ["read_chunk", "open_chunk"])
@pytest.mark.parametrize("bench", TIERS, indirect=True)
def test_a_damaged_block_chunk_is_never_handed_over(bench, op, copy, how):
    """The block-layout path, where open_chunk checks the payload while the caller copies it: whole slab by slab,
    by the native placer, or skipping layers (a window layer before vLLM's first block): the verdict still comes
    at the exit, the skipped slabs hashed there."""
    key, words = _store_blocks(bench)
    _damage(bench, key, how)
    source = getattr(bench.reader, op)(key, CHUNK, blocks=BLOCKS)
    if copy == "skipping" and isinstance(source, BlockSource):
        with pytest.raises(ChunkFailed) as failed:
            with source:
                source.slab(LAYOUT.num_layers - 1).copy()
        assert failed.value.miss == ChunkMiss("corrupt")
    else:
        assert _copied(source, _placer(words.shape[1:]) if copy == "placer" else None) is None
    assert _corrupt_count(bench) == 1
    if bench.name != "peer":
        assert not bench.holder.contains_many([key])[0]


# ---- torn views: shared memory reused while the caller copies ---------------------------------------------
@pytest.mark.parametrize("blocks", [None, BLOCKS])
@pytest.mark.parametrize("bench", ["shm"], indirect=True)
def test_a_view_reused_during_the_copy_fails_at_exit_and_stays(bench, blocks):
    if blocks is None:
        keys, _ = _store_tokens(bench)
        key = keys[0]
    else:
        key, _ = _store_blocks(bench)
    blob = bytes(bench.holder.get(key))
    source = bench.reader.open_chunk(key, CHUNK, blocks=blocks)
    assert isinstance(source, BlockSource if blocks else TokenSource)
    with pytest.raises(ChunkFailed) as failed:
        with source:
            assert bench.holder.delete(key) and bench.holder.put(key, blob)  # a writer reuses the slot meanwhile
    assert failed.value.miss == ChunkMiss("torn")
    counters = bench.reader.stats().counters
    assert counters["torn_reads"] == 1 and counters.get("corrupt.shm", 0) == 0
    assert bench.holder.contains_many([key])[0]  # not damage: the entry stays
    assert _copied(bench.reader.open_chunk(key, CHUNK, blocks=blocks)) is not None


@pytest.mark.parametrize("bench", ["shm"], indirect=True)
def test_read_chunk_never_reads_in_place(bench):
    """read_chunk's source is verified and copied before it is handed out: a writer reusing the slot later cannot
    tear it (for callers that use the KV before they could take it back: a layer-wise load)."""
    keys, kv = _store_tokens(bench)
    blob = bytes(bench.holder.get(keys[0]))
    source = bench.reader.read_chunk(keys[0])
    with source:
        assert bench.holder.delete(keys[0]) and bench.holder.put(keys[0], blob)
        assert torch.equal(source.kv, kv[:, :, :, :CHUNK])


def test_the_connectors_hold_no_hashing_and_no_discard():
    """The check lives in the cache: no connector hashes a payload, compares a checksum or drops a chunk itself
    (chunk keys are hashes too: hashlib stays allowed for those)."""
    from pathlib import Path

    import kvfabric.connectors
    root = Path(kvfabric.connectors.__file__).parent
    banned = ("import xxhash", "from xxhash", "xxhash.", "intdigest", "check_payload", "discard_chunk", "unchecked_sum",
              "payload_sum", ".discard(key")
    found = [f"{path.relative_to(root)}:{i}: {word}" for path in sorted(root.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) for word in banned if word in line]
    assert found == []
