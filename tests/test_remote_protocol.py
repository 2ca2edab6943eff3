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

from kvfabric.framing import ProtocolError
from kvfabric.layout import KVLayout
from kvfabric.remote import protocol as P
from kvfabric.remote.pool import PoolError, SlotPool


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
