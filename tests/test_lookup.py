"""The lookup channel (connectors/lookup.py): a scheduler asks the worker's real CacheEngine over a real Unix socket.

It answers with the cache's own rule (window parts included), tells how much of the prefix process memory holds,
survives malformed requests, and a worker that is gone or silent is a miss within the client's deadline."""
from __future__ import annotations

import os
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch

from kvfabric import CacheEngine, Config, KVLayout
from kvfabric.cache.protocol import KeyLookup
from kvfabric.config import DiskTierConfig
from kvfabric.connectors.lookup import (
    MAX_SOCKET_PATH,
    EveryRank,
    LookupClient,
    LookupService,
    lookup_path,
    start_lookup_service,
)
from kvfabric.kv.hashing import KeySpace
from kvfabric.tiers.cpu import CpuTier
from kvfabric.tiers.disk import DiskTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")
CHUNK = 16


@pytest.fixture
def folder():
    path = tempfile.mkdtemp(prefix="kvf-lk-")  # short: a Unix socket path has at most 107 bytes
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engine(tmp_path):
    cpu, disk = CpuTier(1 << 24), DiskTier(tmp_path / "disk", 1 << 26)
    with CacheEngine(Config(chunk_size=CHUNK, tiers=("cpu", "disk"), disk=DiskTierConfig(path=str(tmp_path / "disk"))),
                     LAYOUT, "m", tiers=[cpu, disk]) as engine:
        engine.cpu, engine.disk = cpu, disk
        yield engine


def test_the_scheduler_gets_the_caches_answer_with_what_memory_holds(engine, folder):
    tokens = list(range(5 * CHUNK))
    engine.store(tokens[:3 * CHUNK], torch.randn(LAYOUT.shape(3 * CHUNK)))
    engine.flush()
    keys = engine.keys(tokens)
    engine.cpu.delete(keys[2])  # chunk 2 only on disk now
    path = str(folder / "lookup.sock")
    with_service = LookupService(engine, path)
    client = LookupClient(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert client.lookup(keys, len(tokens)) == KeyLookup(3, 2) == engine.lookup_keys(keys, len(tokens))
        assert client.lookup([b"z" * 32, *keys]) == KeyLookup(0, 0)  # a prefix ends at the first chunk missing
        assert client.lookup([]) == KeyLookup()
        engine.cpu.delete(keys[1])  # chunk 1 evicted from both tiers
        engine.disk.delete(keys[1])
        assert client.lookup(keys) == KeyLookup(1, 1)  # asked anew each time: no stale mirror
        assert with_service.counters["lookups"] == 3
    finally:
        client.close()
        with_service.close()
    assert not os.path.exists(path)


def test_window_parts_rule_the_answer(tmp_path, folder):
    layout = KVLayout.from_layer_types(["sliding_attention", "full_attention"], 1, 4, 2 * CHUNK, "float32")
    disk = DiskTier(tmp_path / "disk", 1 << 26)
    tokens = list(range(4 * CHUNK))
    with CacheEngine(Config(chunk_size=CHUNK, tiers=("disk",)), layout, "m", tiers=[disk]) as engine:
        engine.store(tokens, torch.randn(layout.shape(4 * CHUNK)))
        engine.flush()
        keys = engine.keys(tokens)
        path = str(folder / "lookup.sock")
        service, client = LookupService(engine, path), LookupClient(path)
        try:
            assert client.lookup(keys, len(tokens)).num_chunks == 4
            assert disk.delete(engine.shape.window.key(keys[3]))
            assert client.lookup(keys, len(tokens)).num_chunks == 3 == engine.lookup(tokens) // CHUNK
        finally:
            client.close()
            service.close()


def _raw_call(path: str, body: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(struct.pack("<I", len(body)) + body)
        return sock.recv(1 << 16)  # b"" when the service drops the connection


@pytest.mark.parametrize("body", [
    b"\xc1\xc1\xc1",  # not msgpack
    msgpack.packb([1, 2, 3]),  # not a map
    msgpack.packb({"keys": "nope", "num_tokens": 1}),
    msgpack.packb({"keys": [b"x" * 65], "num_tokens": 1}),  # a key too long
    msgpack.packb({"keys": [b"k"], "num_tokens": -1}),
    msgpack.packb({"keys": [b"k"], "num_tokens": True}),
    msgpack.packb({"keys": [b"k"], "num_tokens": 1, "tails": [[b"t"]]}),  # a tail without its token count
    msgpack.packb({"keys": [b"k"], "num_tokens": 1, "tails": [[b"t", 0]]}),
    msgpack.packb({"keys": [b"k"], "num_tokens": 1, "tails": [[b"t", 2]] * 257}),  # more than MAX_TAILS
])
def test_a_malformed_request_drops_that_connection_and_the_service_keeps_serving(engine, folder, body):
    path = str(folder / "lookup.sock")
    service, client = LookupService(engine, path), LookupClient(path)
    try:
        assert _raw_call(path, body) == b""
        assert service.counters["bad_requests"] == 1
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # a frame longer than any request
            sock.connect(path)
            sock.sendall(struct.pack("<I", 1 << 31))
            sock.settimeout(5)
            assert sock.recv(16) == b""
        keys = engine.keys(list(range(CHUNK)))
        assert client.lookup(keys) == KeyLookup(0, 0)
        assert client.counters["lookups"] == 1 and not client.counters["lookup_errors"]
    finally:
        client.close()
        service.close()


def test_a_worker_that_is_gone_or_silent_is_a_miss_within_the_deadline(engine, folder):
    path = str(folder / "lookup.sock")
    keys = engine.keys(list(range(2 * CHUNK)))
    nobody = LookupClient(path, timeout_s=0.5, retry_s=60)
    assert nobody.lookup(keys) == KeyLookup()  # no worker yet
    assert nobody.lookup(keys) == KeyLookup() and nobody.counters["lookups_skipped"] == 1  # not asked again
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a worker that accepts and never answers
    listener.bind(path)
    listener.listen(1)
    silent = LookupClient(path, timeout_s=0.3, retry_s=0.0)
    try:
        started = time.monotonic()
        assert silent.lookup(keys) == KeyLookup()
        assert time.monotonic() - started < 2.0 and silent.counters["lookup_errors"] == 1
    finally:
        silent.close()
        listener.close()
    service = LookupService(engine, path)  # the worker's socket left behind is replaced
    try:
        engine.store(list(range(2 * CHUNK)), torch.randn(LAYOUT.shape(2 * CHUNK)))
        assert silent.lookup(keys) == KeyLookup(2, 2)  # reconnects after the failure
    finally:
        silent.close()
        service.close()


@pytest.mark.parametrize("where", ["no-such-folder/lookup.sock", "x" * 120 + ".sock"])
def test_a_socket_the_worker_cannot_create_is_one_line_and_lookups_miss(engine, folder, caplog, where):
    """A missing folder or a path past AF_UNIX's 107 bytes: one warning naming the path, no traceback, no service;
    the scheduler's client then misses."""
    path = str(folder / where)
    with caplog.at_level("WARNING", logger="kvfabric.connectors.lookup"):
        assert start_lookup_service(engine, path) is None
    (record,) = caplog.records
    assert path in record.getMessage() and "will miss" in record.getMessage() and record.exc_info is None
    assert "\n" not in record.getMessage()
    client = LookupClient(path, timeout_s=0.3, retry_s=0.0)
    try:
        assert client.lookup(engine.keys(list(range(CHUNK)))) == KeyLookup()
    finally:
        client.close()


def test_a_tail_is_found_after_every_key_longest_first(engine, folder):
    """find_tail: the first of the given partial chunks that the cache holds after all the keys; none when a key
    before it is missing; one rank without it makes EveryRank's answer none."""
    tokens = list(range(3 * CHUNK))
    partial = KeySpace.of("m", LAYOUT, CHUNK, include_partial=True)
    stored_tail = partial.keys(tokens[:CHUNK + 8])  # a prompt of one chunk and 8 tokens, stored whole
    engine.store_chunks([(key, engine.new_payload(n)) for key, n in zip(stored_tail, (CHUNK, 8))])
    engine.flush()
    keys = engine.keys(tokens)
    tails = engine.key_space.tail_keys(tokens, keys[0], CHUNK, 4)  # 4, 8 and 12 tokens
    asked = [(key, CHUNK + 4 * (i + 1)) for i, key in enumerate(tails)][::-1]
    path = str(folder / "lookup.sock")
    service, client = LookupService(engine, path), LookupClient(path)
    try:
        assert client.find_tail(keys[:1], CHUNK, asked) == 2  # 12 tokens: not stored; 8: stored
        assert client.find_tail([b"z" * 32], CHUNK, asked) == 0  # the chunk before it is missing
        assert client.find_tail(keys[:1], CHUNK, asked[:1]) == 0
        assert client.lookup(keys, len(tokens)) == KeyLookup(1, 1)  # plain lookups as before
        assert EveryRank([client]).find_tail(keys[:1], CHUNK, asked) == 2
    finally:
        client.close()
        service.close()


def test_many_schedulers_threads_share_one_client(engine, folder):
    path = str(folder / "lookup.sock")
    tokens = list(range(4 * CHUNK))
    engine.store(tokens, torch.randn(LAYOUT.shape(4 * CHUNK)))
    keys = engine.keys(tokens)
    service, client = LookupService(engine, path), LookupClient(path)
    answers: list[KeyLookup] = []
    try:
        threads = [threading.Thread(target=lambda: answers.extend(client.lookup(keys[:n]) for n in (1, 2, 3, 4)))
                   for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(a.num_chunks for a in answers) == sorted([1, 2, 3, 4] * 4)
    finally:
        client.close()
        service.close()


def test_the_meeting_point_is_named_by_vllms_engine_id():
    a, b = lookup_path("8a1f-uuid", 0), lookup_path("8a1f-uuid", 1)
    assert a != b and a.endswith(".sock") and len(a) < 108
    assert lookup_path("../../etc/x", 0) == lookup_path("etcx", 0)  # no path tricks in the name


def test_a_long_temp_folder_still_gives_a_socket_path_that_binds(folder, monkeypatch, engine):
    """A temp folder nested deep (a test run's, then a server's own): the engine id is hashed short, so the worker
    can still listen (a path past AF_UNIX's limit would leave every lookup a miss)."""
    # as deep as the short name still fits in, wherever the run's own temp folder is (xdist nests it)
    short = len("/kvfabric-lookup-0123456789abcdef-0.sock")
    deep = folder / ("d" * max(1, MAX_SOCKET_PATH - 1 - short - len(os.fsencode(folder))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    engine_id = "0c5b4a1e-5d2f-4c07-9a1b-3f2e8d7c6b5a"  # vLLM's engine ids are UUIDs
    assert len(os.fsencode(deep / f"kvfabric-lookup-{engine_id}-0.sock")) > 107  # spelled out, it would not bind
    path = lookup_path(engine_id, 0)
    assert len(os.fsencode(path)) <= 107 and Path(path).parent == deep
    assert path == lookup_path(engine_id, 0) != lookup_path("another-engine-id-of-the-same-length-00000", 0)
    service = LookupService(engine, path)
    try:
        assert LookupClient(path).lookup(engine.keys(list(range(CHUNK)))) == KeyLookup()  # it answers: a miss
    finally:
        service.close()


def test_a_starting_service_removes_dead_workers_sockets_and_keeps_live_ones(engine, folder):
    """vLLM ends its workers without their clean-up: each `vllm serve` left its socket in the temp folder."""
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(folder / "kvfabric-lookup-dead-0.sock"))  # bound, never listening, closed: what a killed worker
    dead.close()                                            # leaves
    (folder / "kvfabric-lookup-file-0.sock").write_text("")  # not a socket: not ours to judge
    (folder / "other.sock").touch()
    live = LookupService(engine, str(folder / "kvfabric-lookup-live-0.sock"))
    service = LookupService(engine, str(folder / "kvfabric-lookup-new-0.sock"))
    try:
        names = sorted(p.name for p in folder.iterdir())
        assert names == ["kvfabric-lookup-file-0.sock", "kvfabric-lookup-live-0.sock", "kvfabric-lookup-new-0.sock",
                         "other.sock"]
        client = LookupClient(str(folder / "kvfabric-lookup-live-0.sock"))
        try:  # the live one still answers
            assert client.lookup(engine.keys(list(range(CHUNK)))) == KeyLookup()
            assert live.counters.get("lookups") == 1
        finally:
            client.close()
    finally:
        service.close()
        live.close()


def test_every_rank_asks_all_at_once_and_answers_the_least(engine, tmp_path, folder):
    """EveryRank sends every rank its question before it reads any answer: two silent ranks cost one deadline
    between them, not one each; the answer is the least of the ranks' (a chunk counts when every share is there);
    and every client is free again for the next lookup."""
    from kvfabric.connectors.lookup import EveryRank

    tokens = list(range(4 * CHUNK))
    keys = engine.keys(tokens)
    engine.store(tokens, torch.randn(LAYOUT.shape(4 * CHUNK)))
    other = CacheEngine(Config(chunk_size=CHUNK, tiers=("cpu",)), LAYOUT, "m")
    other.store(tokens[:2 * CHUNK], torch.randn(LAYOUT.shape(2 * CHUNK)))
    paths = [str(folder / f"r{rank}.sock") for rank in range(4)]
    services = [LookupService(engine, paths[0]), LookupService(other, paths[1])]
    silent = []
    for path in paths[2:]:  # ranks that accept and never answer
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        silent.append(listener)
    every = EveryRank([LookupClient(path, timeout_s=0.6, retry_s=0.0) for path in paths])
    try:
        started = time.monotonic()
        assert every.lookup(keys, len(tokens)) == KeyLookup()
        assert time.monotonic() - started < 1.1  # one deadline for both silent ranks
        assert [c.counters["lookup_errors"] for c in every.clients] == [0, 0, 1, 1]
        for listener in silent:
            listener.close()
        every.clients[2:] = []
        assert every.lookup(keys, len(tokens)) == KeyLookup(2, 2)  # the least of 4 and 2
        assert every.lookup([], 0) == KeyLookup()
        assert [c.counters["lookups"] for c in every.clients] == [2, 2]
    finally:
        every.close()
        for service in services:
            service.close()
        other.close()
