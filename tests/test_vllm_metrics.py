"""The connector's metrics and KV events across ranks (no engine runs here; needs vllm importable, .venv-vllm):
each worker's stats carry its rank, vLLM's merge keeps the ranks apart and the summary sums them; with two writing
ranks a chunk is announced stored once both shares are, and removed once."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402

from kvfabric import CacheEngine, Config, KVLayout  # noqa: E402
from kvfabric.connectors.vllm.metrics import (  # noqa: E402
    SEP,
    EngineStatsSource,
    KVFabricKVEvents,
    KVFabricStats,
    LookupStats,
    SchedulerEvents,
)
from kvfabric.kv.shares import num_writers, rank_share  # noqa: E402

MODEL = KVLayout(4, 2, 8, "float32")


def _stats(rank: int) -> KVFabricStats:
    """Rank `rank` of a TP=2 engine stores two chunks: its stats as its worker hands them to vLLM."""
    config = Config.from_dict({"chunk_size": 16, "tiers": ["cpu"]})
    share = rank_share(MODEL, 0, 1, rank, 2)
    with CacheEngine(config, MODEL, "m", share=share, parallel=(1, 2)) as engine:
        source = EngineStatsSource(engine, interval_s=0.0, rank=rank)
        engine.store(list(range(32)), torch.zeros(engine.layout.shape(32)))
        engine.flush()
        return source.take()


def test_each_ranks_stats_carry_its_rank_and_the_summary_sums_them():
    merged = _stats(0).aggregate(_stats(1))  # as vLLM merges its workers' stats
    stored = {k: v for k, v in merged.data["counters"].items() if k.startswith("kvfabric_stored_chunks_total")}
    assert stored == {f"kvfabric_stored_chunks_total{SEP}0": 2, f"kvfabric_stored_chunks_total{SEP}1": 2}
    lookups = LookupStats()
    lookups.record(32, 16)
    merged.aggregate(lookups.take())
    summary = merged.reduce()
    assert summary["kvfabric stored chunks"] == 4 and summary["kvfabric lookup hit rate"] == 0.5


def _stored(events: SchedulerEvents, *batches: tuple[str, list[bytes]]) -> list:
    events.update(KVFabricKVEvents(list(batches)))
    return events.take()


def test_a_chunk_is_stored_once_every_writing_rank_stored_its_share():
    assert num_writers(MODEL, 1, 2) == 2 and num_writers(MODEL, 2, 2) == 4 and num_writers(MODEL, 1, 4) == 2
    events = SchedulerEvents(16, num_writers=2)
    tokens, keys = list(range(32)), [b"a" * 32, b"b" * 32]
    events.remember("r", tokens, keys)
    events.saving("r", 0, 32)
    assert _stored(events, ("BlockStored", keys)) == []  # rank 0's shares: the chunks are not whole yet
    out = _stored(events, ("BlockStored", keys[:1]))  # rank 1's share of chunk 0
    assert [type(e) for e in out] == [BlockStored] and out[0].token_ids == tokens[:16] and out[0].block_hashes == keys[:1]
    out = _stored(events, ("BlockStored", keys[1:]), ("BlockRemoved", keys[:1]), ("BlockRemoved", keys[:1]))
    assert [type(e) for e in out] == [BlockStored, BlockRemoved]  # a chunk goes with its first share, once
    assert out[0].parent_block_hash == keys[0] and out[0].token_ids == tokens[16:]


def test_one_writer_announces_every_event():
    events = SchedulerEvents(16)
    events.remember("r", list(range(16)), [b"a" * 32])
    events.saving("r", 0, 16)
    out = _stored(events, ("BlockStored", [b"a" * 32]), ("BlockRemoved", [b"a" * 32]))
    assert [type(e) for e in out] == [BlockStored, BlockRemoved]


def test_a_prompts_tail_is_not_announced_as_a_block():
    """A save that ends with the prompt's tail (a partial chunk): only its whole chunks are blocks of
    block_size tokens for vLLM's event consumers; the tail's key lands too and is not announced."""
    events = SchedulerEvents(16)
    events.remember("r", list(range(24)), [b"a" * 32])  # one whole chunk, then 8 tokens
    events.saving("r", 0, 24)
    out = _stored(events, ("BlockStored", [b"a" * 32, b"t" * 32]))
    assert [(type(e), e.block_hashes, e.token_ids) for e in out] == [(BlockStored, [b"a" * 32], list(range(16)))]
