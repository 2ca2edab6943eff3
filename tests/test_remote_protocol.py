"""The control protocol's framing and field checks, and the shared slot pool file."""
from __future__ import annotations

import os
import socket
import stat

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.cache.remote import wire as P
from kvfabric.cache.remote.pool import PoolError, SlotPool
from kvfabric.kv.layout import KVLayout
from kvfabric.net.framing import ProtocolError


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def test_frame_round_trip() -> None:
    a, b = _pair()
    with a, b:
        P.send(a, P.RETRIEVE, 7, {"keys": [b"k" * 32], "tokens": [256]}, budget_ms=1500)
        frame = P.read_frame(b, P.REQUESTS, timeout_s=1)
    assert (frame.op, frame.request_id, frame.budget_ms) == (P.RETRIEVE, 7, 1500)
    assert P.keys_of(frame.body) == [b"k" * 32] and P.ints_of(frame.body, "tokens") == [256]


@pytest.mark.parametrize("raw", [
    b"XXXX" + bytes(16),  # bad magic
    P.HEADER.pack(P.MAGIC, 9, P.PING, 0, 1, 0, 0),  # bad version
    P.HEADER.pack(P.MAGIC, P.VERSION, 0x55, 0, 1, 0, 0),  # unknown op
    P.HEADER.pack(P.MAGIC, P.VERSION, P.PING, 0, 1, 0, P.MAX_BODY + 1),  # body too large: rejected unread
    P.HEADER.pack(P.MAGIC, P.VERSION, P.PING, 0, 1, 0, 3) + msgpack.packb([1, 2]),  # not a map
    P.HEADER.pack(P.MAGIC, P.VERSION, P.PING, 0, 1, 0, 3) + b"\xc1\xc1\xc1",  # not msgpack
])
def test_bad_frames_are_protocol_errors(raw: bytes) -> None:
    a, b = _pair()
    with a, b:
        a.sendall(raw)
        with pytest.raises(ProtocolError):
            P.read_frame(b, P.REQUESTS, timeout_s=1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_unpack_raises_only_protocol_errors(data: bytes) -> None:
    try:
        body = P.unpack(data)
    except ProtocolError:
        return
    assert isinstance(body, dict)
    for accessor in (P.keys_of, lambda b: P.ints_of(b, "tokens"), lambda b: P.int_of(b, "port", 0)):
        try:
            accessor(body)
        except ProtocolError:
            pass


def test_field_checks() -> None:
    with pytest.raises(ProtocolError):
        P.keys_of({"keys": [b""]})
    with pytest.raises(ProtocolError):
        P.keys_of({"keys": ["text"]})
    with pytest.raises(ProtocolError):
        P.ints_of({"tokens": [True]}, "tokens")  # a bool is not an int here
    with pytest.raises(ProtocolError):
        P.int_of({"slot": -1}, "slot")
    with pytest.raises(ProtocolError):
        P.same_length([1], [1, 2])


def test_pool_is_private_shared_and_checked(tmp_path) -> None:
    path = tmp_path / "pool"
    pool = SlotPool.create(path, 4096, 3)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        other = SlotPool.open(path, pool.pool_id)
        layout = KVLayout(1, 1, 16, "float16")
        pool.tensor(2, layout, 8).fill_(3.0)
        assert torch.equal(other.tensor(2, layout, 8), torch.full(layout.shape(8), 3.0, dtype=torch.float16))
        with pytest.raises(ValueError):
            pool.tensor(3, layout, 8)  # no such slot
        with pytest.raises(PoolError):
            SlotPool.open(path, bytes(16))  # another server's pool
        other.close()
    finally:
        pool.unlink()
        pool.close()


def _make_pool_and_wait(path: str, ready) -> None:  # a server process, killed by the test
    SlotPool.create(path, 4096, 2)
    ready.set()
    import time
    time.sleep(600)


def test_a_killed_servers_pool_is_reclaimed_and_a_live_ones_is_not(tmp_path) -> None:
    """A server holds a flock on its pool until it closes it (the kernel drops it when the process dies, even by
    SIGKILL): the next server's `reclaim` removes a dead server's pool and its leftover temporary file, and
    never a live server's, nor files that are not pools."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    ready = ctx.Event()
    dead = tmp_path / "kvfabric-server-dead"
    proc = ctx.Process(target=_make_pool_and_wait, args=(str(dead), ready), daemon=True)
    proc.start()
    assert ready.wait(30)
    live = SlotPool.create(tmp_path / "kvfabric-server-live", 4096, 2)
    leftover = tmp_path / ".kvfabric-server-old.123.tmp"
    leftover.write_bytes(b"\0" * 64)
    other = tmp_path / "kvfabric-other"
    other.write_bytes(b"x")
    try:
        assert SlotPool.reclaim(tmp_path) == [leftover]  # the dead-to-be server is still alive
        proc.kill()
        proc.join(10)
        assert SlotPool.reclaim(tmp_path) == [dead]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kvfabric-other", "kvfabric-server-live"]
    finally:
        live.unlink()
        live.close()
    assert SlotPool.reclaim(tmp_path) == []
