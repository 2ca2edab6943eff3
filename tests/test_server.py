"""RemoteCache against the server's parts running in a thread of the test process (fast): exact round trips between
clients, leases, refusals, a malformed connection, a server that goes away and comes back. The same server in its
own process, with kill -9 of either side and fuzzed frames: test_server_processes.py."""
from __future__ import annotations

import contextlib
import gc
import os
import socket
import stat
import time
import urllib.request

import pytest
import torch

from kvfabric.cache.protocol import ChunkHit, ChunkMiss, TokenSource
from kvfabric.cache.remote import RemoteCache
from kvfabric.cache.remote import wire as P
from kvfabric.host.pages import Scratch
from tests.server_fixtures import CHUNK, LAYOUT, client_config, random_kv, server_config, server_in_thread, tokens_of


def _client(data: dict, name: str = "t") -> RemoteCache:
    return RemoteCache(client_config(data), LAYOUT, "model-a", name=name)


def test_two_clients_share_exact_kv(tmp_path) -> None:
    data = server_config(tmp_path)
    tokens, kv = tokens_of(1000, 1), random_kv(1000, 1)
    with server_in_thread(tmp_path, data) as service, _client(data, "a") as a, _client(data, "b") as b:
        assert b.lookup(tokens) == 0
        assert a.store(tokens, kv) == 3  # whole chunks only
        assert b.lookup(tokens) == 3 * CHUNK
        out = torch.zeros(LAYOUT.shape(1024), dtype=torch.float32)  # another dtype: cast on the one copy
        got = b.retrieve(tokens, out=out)
        assert got.shape[3] == 3 * CHUNK and torch.equal(got.half(), kv[:, :, :, :3 * CHUNK])
        assert torch.equal(b.retrieve(tokens[:600]), kv[:, :, :, :512])  # a shorter prompt: its whole chunks
        assert b.store(tokens, kv) == 0  # already held
        b.flush()
        assert service.counters.get("chunks_persisted") == 3
        assert [t.num_chunks for t in b.stats().tiers] == [3, 3]  # cpu and disk, written in the background
        timed = {name for name, _ in b.histograms.snapshot()} | {name for name, _ in a.histograms.snapshot()}
        assert timed == {"kvfabric_lookup_seconds", "kvfabric_retrieve_seconds", "kvfabric_store_seconds"}
        assert service.slots.usage()["referenced"] == 0


def test_read_chunk_view_is_leased_until_the_sources_exit(tmp_path) -> None:
    data = server_config(tmp_path)
    tokens, kv = tokens_of(512, 2), random_kv(512, 2)
    with server_in_thread(tmp_path, data) as service, _client(data) as c:
        c.store(tokens, kv)
        c.flush()  # the background encodes hold their slots until persisted
        keys = c.keys(tokens)
        scratch = Scratch()
        hit = c.read_chunk(keys[0], scratch=scratch)
        assert isinstance(hit, TokenSource) and hit.tier == "pool"
        with hit:
            assert torch.equal(hit.kv, kv[:, :, :, :CHUNK])
            assert service.slots.usage()["referenced"] == 1  # the view's lease, held until the exit
        hit = c.read_chunk(keys[1], scratch=scratch)  # the first view was given up: released with this request
        assert isinstance(hit, TokenSource)
        with hit:
            assert torch.equal(hit.kv, kv[:, :, :, CHUNK:])
            assert service.slots.usage()["referenced"] == 1
        opened = c.open_chunk(keys[1])  # the same read: the server verified it, the slot is the fastest view
        assert isinstance(opened, TokenSource)
        with opened:
            assert torch.equal(opened.kv, kv[:, :, :, CHUNK:]) and service.slots.usage()["referenced"] == 1
        out = torch.empty(LAYOUT.shape(CHUNK), dtype=torch.float32)
        got = c.read_into(keys[0], out)
        assert isinstance(got, ChunkHit) and torch.equal(out, kv[:, :, :, :CHUNK].float())
        assert c.is_connected()  # a request after read_into's one-way release: the server has handled it
        assert service.slots.usage()["referenced"] == 0  # read_into let its slot go, and the last view's too
        assert c.read_chunk(b"x" * 32) == ChunkMiss("missing")
        assert c.read_into(b"x" * 32, out) == ChunkMiss("missing")
        held = c.read_chunk(keys[0])
        assert isinstance(held, TokenSource) and service.slots.usage()["referenced"] == 1
    assert service.slots.usage()["referenced"] == 0  # closing the client reclaimed the view


def test_payloads_lease_slots_and_a_dropped_payload_is_released(tmp_path) -> None:
    data = server_config(tmp_path)
    tokens, kv = tokens_of(512, 3), random_kv(512, 3)
    with server_in_thread(tmp_path, data) as service, _client(data) as c:
        keys = c.keys(tokens)
        payload = c.new_payload()
        payload.kv.copy_(kv[:, :, :, :CHUNK])
        assert service.slots.usage()["referenced"] == 1
        assert c.store_chunks([(keys[0], payload)]) == [True]
        assert c.store_chunks([(keys[0], c.new_payload())]) == [False]  # held already
        assert c.holds([keys[0], keys[1]]) == [True, False]
        dropped = c.new_payload()
        del dropped, payload
        gc.collect()
        c.flush()  # the next request carries the release
        assert service.slots.usage()["referenced"] == 0
        assert torch.equal(c.retrieve(tokens[:CHUNK]), kv[:, :, :, :CHUNK])


def test_a_client_holds_at_most_its_slot_cap(tmp_path) -> None:
    data = server_config(tmp_path, max_slots_per_client=3)
    tokens, kv = tokens_of(6 * CHUNK, 4), random_kv(6 * CHUNK, 4)
    with server_in_thread(tmp_path, data) as service, _client(data) as c:
        assert c.store(tokens, kv) == 6  # in batches of at most 3 leases
        c.flush()
        scratches = [Scratch() for _ in range(6)]
        with contextlib.ExitStack() as sources:  # six sources open at once
            hits = [sources.enter_context(c.read_chunk(key, scratch=s)) for key, s in zip(c.keys(tokens), scratches)]
            assert all(isinstance(h, TokenSource) for h in hits)
            assert all(torch.equal(h.kv, kv[:, :, :, i * CHUNK:(i + 1) * CHUNK]) for i, h in enumerate(hits))
            assert service.slots.usage()["referenced"] <= 3  # past the cap, chunks are copied out instead
        assert torch.equal(c.retrieve(tokens), kv)


def test_a_stalled_client_cannot_block_another(tmp_path) -> None:
    data = server_config(tmp_path, pool_capacity="256KiB", max_slots_per_client=3)  # 4 slots in all
    tokens, kv = tokens_of(6 * CHUNK, 9), random_kv(6 * CHUNK, 9)
    with server_in_thread(tmp_path, data) as service, _client(data, "a") as a, _client(data, "b") as b:
        num_stored = a.store(tokens[:3 * CHUNK], kv[:, :, :, :3 * CHUNK])
        a.flush()  # committed slots stay held until persisted: store in pool-sized steps
        num_stored += a.store(tokens, kv)
        a.flush()
        assert num_stored == 6
        keys = a.keys(tokens)
        held = [Scratch(), Scratch()]
        with contextlib.ExitStack() as sources:  # a keeps its leases (sources open) and stalls
            views = [sources.enter_context(a.read_chunk(key, scratch=s)) for key, s in zip(keys, held)]
            assert service.slots.usage()["referenced"] == 2
            assert torch.equal(b.retrieve(tokens), kv)  # b gets all six chunks through the two slots left
            assert b.stats().counters.get("server.retrieve_stop.pool_full", 0) >= 1
            assert all(torch.equal(v.kv, kv[:, :, :, i * CHUNK:(i + 1) * CHUNK]) for i, v in enumerate(views))


def test_token_and_socket_mode_refuse_others(tmp_path) -> None:
    data = server_config(tmp_path, token="s3cret")
    tokens, kv = tokens_of(512, 5), random_kv(512, 5)
    with server_in_thread(tmp_path, data) as service:
        assert stat.S_IMODE(os.stat(data["server"]["socket"]).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(service.pool.path).st_mode) == 0o600
        wrong = {**data, "server": {**data["server"], "token": "guess"}}
        with _client(wrong) as intruder:
            assert intruder.store(tokens, kv) == 0 and intruder.lookup(tokens) == 0
            assert intruder.retrieve(tokens).shape[3] == 0
            assert not intruder.is_connected()
        assert service.counters.get("refused") >= 1
        with _client(data) as c:
            assert c.store(tokens, kv) == 2 and c.lookup(tokens) == 512


def test_a_malformed_frame_closes_that_connection_only(tmp_path) -> None:
    data = server_config(tmp_path)
    tokens, kv = tokens_of(512, 6), random_kv(512, 6)
    with server_in_thread(tmp_path, data) as service, _client(data) as good:
        good.store(tokens, kv)
        bad = socket.socket(socket.AF_UNIX)
        bad.connect(data["server"]["socket"])
        P.send(bad, P.HELLO, 1, {"model_id": "model-a", "chunk_size": CHUNK, "layout": [2, 2, 16, "float16"]})
        assert P.read_frame(bad, P.ANSWERS, timeout_s=5).op == P.REPLY
        bad.sendall(P.HEADER.pack(P.MAGIC, P.VERSION, P.RETRIEVE, 0, 2, 1000, 5) + b"\xc1junk")
        assert bad.recv(1) == b""  # closed by the server
        bad.close()
        assert torch.equal(good.retrieve(tokens), kv)
        assert service.counters.get("connections_dropped") == 1


def test_server_down_is_a_miss_and_a_restart_is_found(tmp_path) -> None:
    data = server_config(tmp_path)
    tokens, kv = tokens_of(512, 7), random_kv(512, 7)
    with _client(data) as c:
        started = time.monotonic()
        assert c.lookup(tokens) == 0 and c.store(tokens, kv) == 0 and c.retrieve(tokens).shape[3] == 0
        assert time.monotonic() - started < 1.0  # no server: misses at once, no hang
        with server_in_thread(tmp_path, data):
            deadline = time.monotonic() + 10
            while not c.is_connected() and time.monotonic() < deadline:
                time.sleep(0.05)  # misses for retry_s after the failure, then reconnects
            assert c.store(tokens, kv) == 2
            first_pool = c._sessions.pool.pool_id
            assert torch.equal(c.retrieve(tokens), kv)
        assert c.lookup(tokens) == 0  # gone again
        with server_in_thread(tmp_path, data):  # a new server, a new pool; the disk tier kept the chunks
            deadline = time.monotonic() + 10
            while not c.is_connected() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert torch.equal(c.retrieve(tokens), kv)
            assert c._sessions.pool.pool_id != first_pool


def test_prometheus_metrics_per_client(tmp_path) -> None:
    data = server_config(tmp_path)
    tokens, kv = tokens_of(512, 8), random_kv(512, 8)
    with server_in_thread(tmp_path, data) as service, _client(data, "engine-x") as c:
        port = service.metrics.serve(0)
        c.store(tokens, kv)
        c.retrieve(tokens)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvfabric_server_hit_tokens_total{client="engine-x"} 512.0' in text
    assert 'kvfabric_server_requests_total{client="engine-x",op="retrieve"} 1.0' in text
    assert 'kvfabric_server_bytes_total{client="engine-x",direction="in"} ' + f"{LAYOUT.num_bytes(512)}.0" in text


@pytest.mark.parametrize("with_prefetch", [False, True])
def test_chunks_decode_from_the_tiers_into_slots(tmp_path, with_prefetch: bool) -> None:
    """After the pool forgot a chunk (another server), it is read from disk and decoded into a slot, once."""
    data = server_config(tmp_path, timeout_s=60.0)  # the codec's first use compiles it (numba): slow on a busy host
    data["codec"] = "cachegen:0"  # lossless: exact values through a real decode
    tokens, kv = tokens_of(768, 9), random_kv(768, 9)
    with server_in_thread(tmp_path, data), _client(data) as c:
        c.store(tokens, kv)
        c.flush()
    with server_in_thread(tmp_path, data) as service, _client(data) as c:
        if with_prefetch:
            assert c.prefetch(tokens) == 3
        assert torch.equal(c.retrieve(tokens), kv)
        assert service.counters.get("hit.disk") == 3 and service.counters.get("hit.pool") == 3 * with_prefetch


def test_an_mla_latent_namespace_is_its_own(tmp_path) -> None:
    """A client with a latent layout (MLA) names it in its hello: the server keeps its chunks apart from a K|V
    namespace of the same size, round trips them exactly, and refuses a latent layout with several heads."""
    from kvfabric.kv.layout import KVLayout

    data = server_config(tmp_path)
    latent = KVLayout(2, 1, 64, "float16", is_latent=True)  # a token's bytes equal LAYOUT's (2 x 2 x 16 halves)
    assert latent.num_bytes(1) == LAYOUT.num_bytes(1)
    tokens = tokens_of(512, 7)
    kv = torch.randn(latent.shape(512), generator=torch.Generator().manual_seed(7)).half()
    with server_in_thread(tmp_path, data), RemoteCache(client_config(data), latent, "model-a", name="m") as mla, \
            _client(data) as plain:
        assert mla.store(tokens, kv) == 2
        assert plain.lookup(tokens) == 0 and mla.lookup(tokens) == 2 * CHUNK
        assert torch.equal(mla.retrieve(tokens), kv)
        bad = socket.socket(socket.AF_UNIX)
        bad.connect(data["server"]["socket"])
        P.send(bad, P.HELLO, 1, {"model_id": "m", "chunk_size": CHUNK, "layout": [2, 2, 16, "float16", "latent"]})
        reply = P.read_frame(bad, P.ANSWERS, timeout_s=5)
        bad.close()
        assert reply.op == P.ERROR and "one head slot" in reply.body["error"]
