"""kvfabric.cache.ranged (and the head table of kvfabric.codec.heads / codec.format under it): a rank reading part of
a stored chunk (its KV heads of a whole chunk, its layers of a share another shape stored) reads and checks only
those rows, from a disk file, shared memory or process memory, token-major or in a paged engine's block layout.
Damage in the rows it reads is a miss that drops the chunk; damage in rows it does not read is another rank's
business; a chunk written before the head table (format version 2) is read whole."""
from __future__ import annotations

import struct
import uuid

import numpy as np
import pytest
import torch
import xxhash

from kvfabric import CacheEngine, Config
from kvfabric.cache.protocol import ChunkHit, ChunkMiss
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, fill_checksums, parse
from kvfabric.codec.heads import STREAM_ROWS, digest_table, head_axis, head_rows, payload_words, rows_digest
from kvfabric.codec.raw import RawCodec
from kvfabric.kv.blocks import BlockLayout, as_words, from_tokens
from kvfabric.kv.layout import KVLayout
from kvfabric.kv.shares import rank_share
from kvfabric.tiers.shm import ShmTier
from tests.redis_fixtures import needs_redis, redis_server, redis_url  # noqa: F401  (fixtures)

MODEL = KVLayout(num_layers=4, num_kv_heads=4, head_dim=8, dtype="bfloat16")
CHUNK = 16
TOKENS = list(range(50, 50 + 2 * CHUNK))
BLOCKS = {"token-major": None, "vllm-cpu": BlockLayout(8, key_dt=True), "vllm-HND": BlockLayout(4, family="vllm"),
          "vllm-NHD": BlockLayout(4, family="vllm", token_major=True)}


def _kv(seed: int) -> torch.Tensor:
    return torch.randn(MODEL.shape(len(TOKENS)), generator=torch.Generator().manual_seed(seed)).bfloat16()


def _config(tmp_path, tier: str) -> Config:
    return Config.from_dict({"chunk_size": CHUNK, "tiers": [tier], "disk": {"path": str(tmp_path / "disk")},
                             "shm": {"name": f"test-{uuid.uuid4().hex[:12]}", "capacity": 8 << 20}})


def _store_whole(engine: CacheEngine, kv: torch.Tensor, blocks: BlockLayout | None) -> list[bytes]:
    keys = [bytes(k) for k in engine.keys(TOKENS)]
    for i, key in enumerate(keys):
        part = kv[:, :, :, i * CHUNK:(i + 1) * CHUNK].contiguous()
        payload = engine.new_payload(CHUNK, blocks)
        if blocks is None:
            payload.kv.copy_(part)
        else:
            from_tokens(as_words(part), blocks, as_words(payload.kv))
        assert engine.store_chunks([(key, payload)]) == [True]
    engine.flush()
    return keys


@pytest.mark.parametrize("blocks", list(BLOCKS), ids=list(BLOCKS))
def test_head_digests_are_one_hash_of_the_head_rows_however_taken(blocks):
    """A head's digest is xxh3-64 of its rows one after another: hashed row by row or gathered, the same value; the
    table a raw blob carries is that of its payload."""
    layout = BLOCKS[blocks]
    kv = _kv(0)[:, :, :, :CHUNK].contiguous()
    blob = RawCodec().encode(kv, b"k" * 32, MODEL) if layout is None else None
    if blob is None:
        words = np.empty(layout.payload_shape(4, 4, CHUNK, 8), dtype=np.int16)
        from_tokens(as_words(kv), layout, words)
    else:
        header = parse(blob, b"k" * 32)
        assert header.table_len == 4 * 4 * 8 and header.kv_len == MODEL.num_bytes(CHUNK)
        words = payload_words(memoryview(blob)[HEADER_BYTES:HEADER_BYTES + header.kv_len], header.shape, 2, None)
        stored = np.frombuffer(memoryview(blob)[HEADER_BYTES + header.kv_len:], "<u8").reshape(4, 4)
        assert np.array_equal(stored, digest_table(words, head_axis(None)))
    axis = head_axis(layout)
    for layer in range(4):
        for head in range(4):
            rows = head_rows(words[layer], axis, head)
            one = xxhash.xxh3_64_intdigest(np.ascontiguousarray(rows).tobytes())
            streamed = xxhash.xxh3_64()
            for row in rows:
                streamed.update(row.tobytes())
            assert rows_digest(rows) == one == streamed.intdigest()
            assert rows.shape[0] > STREAM_ROWS or rows.base is not None  # few rows: views, no copy


def test_the_table_is_checked_and_an_unsealed_blob_gets_it_when_sealed():
    kv = _kv(1)[:, :, :, :CHUNK].contiguous()
    key = b"q" * 32
    sealed = RawCodec().encode(kv, key, MODEL)
    unsealed = RawCodec().encode(kv, key, MODEL, with_checksums=False)
    assert bytes(unsealed[-128:]) == bytes(128)  # no table until it leaves the process
    fill_checksums(unsealed)
    assert bytes(unsealed) == bytes(sealed)
    sealed[-3] ^= 1  # in the table: the KV is intact, the blob is not
    with pytest.raises(ChunkFormatError, match="head table"):
        parse(sealed, key)


def test_a_version_2_blob_reads_whole(tmp_path):
    """A chunk stored before the head table (version 2: the same header, no table) is still a hit: read whole."""
    kv = _kv(2)
    config = _config(tmp_path, "disk")
    with CacheEngine(config, MODEL, "m") as whole:
        keys = _store_whole(whole, kv, None)
        paths = [whole.stack.tiers[0].file_of(key) for key in keys]
    for i, (key, path) in enumerate(zip(keys, paths)):  # each file as the previous version wrote it
        header = parse(path.read_bytes(), key)
        payload = kv[:, :, :, i * CHUNK:(i + 1) * CHUNK].contiguous().view(torch.int16).numpy().tobytes()
        head = struct.pack("<4sBBBB8s5I32s16s20xQQ", b"KVFC", 2, 0, header.dtype_code, 0, header.fingerprint,
                           *header.shape, key, bytes(16), len(payload), xxhash.xxh3_64_intdigest(payload))
        path.write_bytes(head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + payload)
        assert parse(path.read_bytes(), key).table_len == 0
    with CacheEngine(config, MODEL, "m", share=rank_share(MODEL, 0, 1, 1, 2), parallel=(1, 2)) as reader:
        assert torch.equal(reader.retrieve(TOKENS), kv[:, :, 2:4])
        counters = reader.stats().counters
        assert counters.get("share_ranged_reads", 0) == 0 and counters["share_assembled_chunks"] == 2


@pytest.mark.parametrize("tier", ["disk", "shm", pytest.param("redis", marks=needs_redis)])
@pytest.mark.parametrize("blocks", list(BLOCKS), ids=list(BLOCKS))
def test_each_tp_rank_reads_only_its_heads_of_a_whole_chunk(request, tmp_path, tier, blocks):
    """Disk: the file mapped, only the rank's rows touched; shm: read in place; redis: the blob as it came, only
    the rank's rows checked and copied."""
    kv = _kv(3)
    config = _config(tmp_path, tier)
    if tier == "redis":
        config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["redis"],
                                   "redis": {"url": request.getfixturevalue("redis_url")}})
    whole = CacheEngine(config, MODEL, "m")
    try:
        _store_whole(whole, kv, BLOCKS[blocks])
        for rank in range(2):
            share = rank_share(MODEL, 0, 1, rank, 2)
            with CacheEngine(config, MODEL, "m", share=share, parallel=(1, 2)) as reader:
                assert reader.lookup(TOKENS) == len(TOKENS)
                assert torch.equal(reader.retrieve(TOKENS), kv[:, :, 2 * rank:2 * rank + 2])
                counters = reader.stats().counters
                assert counters["share_ranged_reads"] == 2
                half = MODEL.num_bytes(CHUNK) // 2 if BLOCKS[blocks] is None else \
                    MODEL.num_bytes(-(-CHUNK // BLOCKS[blocks].block_size) * BLOCKS[blocks].block_size) // 2
                assert counters["share_ranged_bytes"] == 2 * (half + 4 * 4 * 8)  # its heads and the table
    finally:
        whole.close()
        if tier == "shm":
            ShmTier.destroy(config.shm.name)


def test_pp_stages_read_only_their_layers_of_another_shapes_share(tmp_path):
    kv = _kv(4)
    config = _config(tmp_path, "disk")
    for rank in range(2):  # TP=2 stores its head halves
        share = rank_share(MODEL, 0, 1, rank, 2)
        with CacheEngine(config, MODEL, "m", share=share, parallel=(1, 2)) as engine:
            engine.store(TOKENS, kv[:, :, 2 * rank:2 * rank + 2].contiguous())
    for stage in range(2):
        share = rank_share(MODEL, stage, 2, 0, 1)
        with CacheEngine(config, MODEL, "m", share=share, parallel=(2, 1)) as reader:
            assert torch.equal(reader.retrieve(TOKENS), kv[2 * stage:2 * stage + 2])
            assert reader.stats().counters["share_ranged_reads"] == 2 * 2  # two TP shares a chunk, their layers
            out = torch.empty(reader.layout.shape(CHUNK), dtype=torch.float32)  # any float dtype: converted
            assert reader.read_into(reader.keys(TOKENS)[1], out) == ChunkHit("disk", 2 * (2 * 2 * 2 * CHUNK * 8 * 2 + 4 * 2 * 8))
            assert torch.equal(out, kv[2 * stage:2 * stage + 2, :, :, CHUNK:].float())


def _flip(tmp_path, key: bytes, offset: int) -> None:
    (path,) = [p for p in (tmp_path / "disk").rglob(f"{key.hex()}*")]
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_damage_in_the_rows_read_is_a_miss_and_elsewhere_is_not_read(tmp_path):
    """A flipped byte in KV head 0 of chunk 1's whole blob on disk: rank 1 (heads 2-3) reads its rows, checked,
    and gets its KV; rank 0 finds the damage in its rows, drops the chunk and gets chunk 0 only, never wrong KV."""
    kv = _kv(5)
    config = _config(tmp_path, "disk")
    with CacheEngine(config, MODEL, "m") as whole:
        keys = _store_whole(whole, kv, None)
    _flip(tmp_path, keys[1], HEADER_BYTES + 5)  # layer 0, K, head 0
    with CacheEngine(config, MODEL, "m", share=rank_share(MODEL, 0, 1, 1, 2), parallel=(1, 2)) as rank1:
        assert torch.equal(rank1.retrieve(TOKENS), kv[:, :, 2:4])
        assert rank1.stats().counters.get("corrupt.disk", 0) == 0
    with CacheEngine(config, MODEL, "m", share=rank_share(MODEL, 0, 1, 0, 2), parallel=(1, 2)) as rank0:
        assert torch.equal(rank0.retrieve(TOKENS), kv[:, :, :2, :CHUNK])
        assert rank0.stats().counters["corrupt.disk"] == 1
        assert isinstance(rank0.read_chunk(rank0.keys(TOKENS)[1]), ChunkMiss)  # dropped: gone for every reader
    with CacheEngine(config, MODEL, "m") as whole:
        assert whole.lookup(TOKENS) == CHUNK


def test_a_damaged_table_is_a_miss_for_a_ranged_reader(tmp_path):
    kv = _kv(6)
    config = _config(tmp_path, "disk")
    with CacheEngine(config, MODEL, "m") as whole:
        keys = _store_whole(whole, kv, BLOCKS["vllm-cpu"])
    _flip(tmp_path, keys[0], -1)  # the table's last byte
    with CacheEngine(config, MODEL, "m", share=rank_share(MODEL, 0, 1, 1, 2), parallel=(1, 2)) as rank1:
        assert rank1.lookup(TOKENS) == len(TOKENS)
        assert rank1.retrieve(TOKENS).shape[3] == 0
        assert rank1.stats().counters["corrupt.disk"] == 1
