"""`mode: server` for a parallel engine's ranks: each rank's RemoteCache names its share (kvfabric.kv.shares) at
HELLO and keeps it in a namespace of its own on one server, in the model's key space, so any parallel shape reads
what another stored. The server's parts run in a thread of the test process (tests.server_fixtures)."""
from __future__ import annotations

import socket

import pytest
import torch

from kvfabric.cache.protocol import ChunkHit, ChunkMiss
from kvfabric.cache.remote import RemoteCache
from kvfabric.cache.remote import wire as P
from kvfabric.kv.shares import Share, rank_share
from kvfabric.server.service import Service
from tests.server_fixtures import CHUNK, LAYOUT, client_config, random_kv, server_config, server_in_thread, tokens_of


def _rank(data: dict, share: Share | None, parallel: tuple[int, int], name: str) -> RemoteCache:
    return RemoteCache(client_config(data), LAYOUT, "model-a", name=name, share=share, parallel=parallel)


def _tp2(data: dict) -> list[RemoteCache]:
    return [_rank(data, rank_share(LAYOUT, 0, 1, r, 2), (1, 2), f"tp2-r{r}") for r in (0, 1)]


def test_tp2_ranks_store_their_heads_and_tp1_reads_them_whole(tmp_path) -> None:
    data = server_config(tmp_path)
    tokens, kv = tokens_of(2 * CHUNK, 1), random_kv(2 * CHUNK, 1)  # [L=2, 2, H=2, T, D]
    with server_in_thread(tmp_path, data) as service:
        ranks = _tp2(data)
        whole = _rank(data, None, (1, 1), "tp1")
        try:
            assert [r.layout.num_kv_heads for r in ranks] == [1, 1] and whole.layout == LAYOUT
            assert ranks[0].store(tokens, kv[:, :, 0:1]) == 2
            assert whole.lookup(tokens) == 0  # one share of two: nothing a whole read can use yet
            assert ranks[1].lookup(tokens) == 0
            assert ranks[1].store(tokens, kv[:, :, 1:2]) == 2
            ranks[1].flush()  # another namespace's read finds the shares in the tiers, once they are persisted
            assert whole.lookup(tokens) == 2 * CHUNK and ranks[1].lookup(tokens) == 2 * CHUNK
            assert torch.equal(whole.retrieve(tokens), kv)  # put together from both ranks' shares
            out = torch.empty(ranks[1].layout.shape(CHUNK), dtype=torch.float16)
            key = whole.keys(tokens)[1]
            assert isinstance(ranks[1].read_into(key, out), ChunkHit)
            assert torch.equal(out, kv[:, :, 1:2, CHUNK:])
            assert len(service.spaces.all()) == 3  # each rank's share and the whole model: one namespace each
        finally:
            for cache in (*ranks, whole):
                cache.close()


def test_stored_whole_is_read_by_each_rank_and_pipeline_stage(tmp_path) -> None:
    data = server_config(tmp_path)
    tokens, kv = tokens_of(2 * CHUNK + 10, 2), random_kv(2 * CHUNK + 10, 2)
    with server_in_thread(tmp_path, data):
        whole = _rank(data, None, (1, 1), "tp1")
        readers = {(1, r): _rank(data, rank_share(LAYOUT, 0, 1, r, 2), (1, 2), f"tp-r{r}") for r in (0, 1)}
        readers |= {(2, s): _rank(data, rank_share(LAYOUT, s, 2, 0, 1), (2, 1), f"pp-s{s}") for s in (0, 1)}
        try:
            assert whole.store(tokens, kv) == 2
            whole.flush()
            for (pp, i), reader in readers.items():
                got = reader.retrieve(tokens)
                want = kv[:, :, i:i + 1] if pp == 1 else kv[i:i + 1]
                assert torch.equal(got, want[:, :, :, :2 * CHUNK])
        finally:
            for cache in (whole, *readers.values()):
                cache.close()


def test_a_replica_reads_and_never_writes(tmp_path) -> None:
    """More ranks than KV heads: ranks 2r and 2r+1 hold head r at TP=4 of a 2-head model; only rank 2r writes."""
    data = server_config(tmp_path)
    tokens, kv = tokens_of(CHUNK, 3), random_kv(CHUNK, 3)
    with server_in_thread(tmp_path, data):
        writer = _rank(data, rank_share(LAYOUT, 0, 1, 0, 4), (1, 4), "tp4-r0")
        replica = _rank(data, rank_share(LAYOUT, 0, 1, 1, 4), (1, 4), "tp4-r1")
        try:
            assert replica.store(tokens, kv[:, :, 0:1]) == 0 and writer.lookup(tokens) == 0
            assert writer.store(tokens, kv[:, :, 0:1]) == 1
            assert torch.equal(replica.retrieve(tokens), kv[:, :, 0:1])
        finally:
            writer.close()
            replica.close()


@pytest.mark.parametrize("share", [[0, 2, 1, 3, True], [0, 3, 0, 1, True], [1, 1, 0, 1, True], [0, 2, 0, 1],
                                   [0, 2, 0, 1, 1], "0-2"])
def test_a_malformed_share_is_refused_at_hello(tmp_path, share) -> None:
    data = server_config(tmp_path)
    with server_in_thread(tmp_path, data) as service:
        bad = socket.socket(socket.AF_UNIX)
        bad.connect(data["server"]["socket"])
        P.send(bad, P.HELLO, 1, {"model_id": "m", "chunk_size": CHUNK, "layout": P.slot_layout(LAYOUT),
                                 "share": share, "parallel": [1, 2]})
        reply = P.read_frame(bad, P.ANSWERS, timeout_s=5)
        bad.close()
        assert reply.op == P.ERROR and "share: expected" in reply.body["error"]
        assert service.counters.get("refused") == 1 and not service.spaces.all()


def test_a_server_without_shares_is_not_used_by_a_rank(tmp_path, monkeypatch) -> None:
    """A server older than shares ignores `share` at hello and answers no `slot_layout`: its slots would hold
    the whole model's KV where this rank writes its share, so the rank treats it as down (every call a miss)."""
    data = server_config(tmp_path)
    tokens, kv = tokens_of(CHUNK, 4), random_kv(CHUNK, 4)
    connect = Service.connect

    def older(self: Service, body: dict, peer: str) -> tuple:
        client, info = connect(self, {k: v for k, v in body.items() if k not in ("share", "parallel")}, peer)
        return client, {k: v for k, v in info.items() if k != "slot_layout"}

    monkeypatch.setattr(Service, "connect", older)
    with server_in_thread(tmp_path, data):
        rank = _rank(data, rank_share(LAYOUT, 0, 1, 0, 2), (1, 2), "r0")
        whole = _rank(data, None, (1, 1), "tp1")  # the whole model's client still works with it
        try:
            assert rank.store(tokens, kv[:, :, 0:1]) == 0
            out = torch.empty(rank.layout.shape(CHUNK), dtype=torch.float16)
            assert isinstance(rank.read_into(rank.keys(tokens)[0], out), ChunkMiss)
            assert rank.stats().counters.get("server_errors") >= 1
            assert whole.store(tokens, kv) == 1 and whole.lookup(tokens) == CHUNK
        finally:
            rank.close()
            whole.close()
