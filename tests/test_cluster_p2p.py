"""The P2P protocol: frames, PeerServer / PeerClient round trips, auth, bounds, timeouts, hostile input."""
from __future__ import annotations

import socket
import struct
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.cluster import protocol as p
from kvfabric.cluster.p2p_client import PeerClient, PeerError
from kvfabric.cluster.p2p_server import PeerServer
from kvfabric.codec.format import parse
from kvfabric.net.framing import ProtocolError
from kvfabric.tiers.cpu import CpuTier
from kvfabric.tiers.disk import DiskTier
from tests.cluster_scripts.helpers import finishes, key, make_blob, wait_for

TOKEN = "t0ken"


@pytest.fixture
def tiers(tmp_path):
    cpu, disk = CpuTier(1 << 24), DiskTier(tmp_path / "disk", 1 << 24)
    for i in range(4):
        cpu.put(key(i), make_blob(key(i), seed=i))
    for i in range(4, 8):
        disk.put(key(i), make_blob(key(i), seed=i))
    return cpu, disk


@pytest.fixture
def server(tiers):
    srv = PeerServer(list(tiers), token=TOKEN, io_timeout_s=2.0, idle_timeout_s=5.0).start()
    yield srv
    srv.close()


def client_for(srv: PeerServer, token: str | None = TOKEN, **kw) -> PeerClient:
    return PeerClient(srv.host, srv.port, token, **kw)


def alive(srv: PeerServer) -> bool:
    client = client_for(srv)
    try:
        return client.fetch_all([key(0)])[key(0)] == make_blob(key(0), seed=0)
    finally:
        client.close()


def test_header_round_trip_and_rejects():
    assert p.parse_header(p.pack_header(p.FrameType.CHUNK, 123, 1)) == (p.FrameType.CHUNK, 1, 123)
    with pytest.raises(ProtocolError):
        p.parse_header(b"XXXX" + p.pack_header(1, 0)[4:])
    with pytest.raises(ProtocolError):
        p.parse_header(p.HEADER.pack(p.MAGIC, 9, 1, 0, 0))
    with pytest.raises(ProtocolError):
        p.parse_header(p.HEADER.pack(p.MAGIC, p.VERSION, 77, 0, 0))


def test_get_body_round_trip_and_bounds():
    keys = [key(i) for i in range(5)]
    assert p.decode_get(p.encode_get("tok", keys, "disk")) == (b"tok", "disk", keys)
    body = bytearray(p.encode_get("tok", keys))
    with pytest.raises(ProtocolError):
        p.decode_get(body[:-1])  # key list shorter than the count
    with pytest.raises(ProtocolError):
        p.decode_get(b"\xff\xff" + b"x" * 10)  # token length beyond the body
    huge_count = p.encode_get("", []) [:-4] + struct.pack("<I", p.MAX_KEYS + 1)
    with pytest.raises(ProtocolError):
        p.decode_get(huge_count)
    with pytest.raises(ValueError):
        p.encode_get("", [b"short"])


def test_fetch_streams_blobs_in_order_from_every_served_tier(server):
    client = client_for(server)
    keys = [key(7), key(1), key(99), key(4)]
    got = list(client.fetch(keys))
    assert [k for k, _ in got] == keys
    assert got[2][1] is None  # missing key: a clean MISSING, not an error
    for k, blob in got:
        if blob is not None:
            parse(blob, k)  # the core chunk format, checksums intact
            assert bytes(blob) == make_blob(k, seed=int.from_bytes(k[:4], "little"))
    # the connection is pooled and reused
    assert client.fetch_all([key(0)])[key(0)] is not None
    assert len(client._idle) == 1
    client.close()


def test_tier_filter(server):
    client = client_for(server)
    assert client.fetch_all([key(1), key(5)], tier="disk") == {key(1): None, key(5): make_blob(key(5), seed=5)}
    assert client.fetch_all([key(1), key(5)], tier="cpu") == {key(1): make_blob(key(1), seed=1), key(5): None}
    assert server.counters["sendfile"] == 1  # the disk chunk went out with sendfile
    client.close()


def test_missing_key_calls_back(tiers):
    missing: list[bytes] = []
    srv = PeerServer(list(tiers), on_missing=missing.append).start()
    try:
        client = PeerClient(srv.host, srv.port)
        assert client.fetch_all([key(50)]) == {key(50): None}
        assert missing == [key(50)]
    finally:
        srv.close()


@pytest.mark.parametrize("token", [None, "", "wrong", "t0ken-but-longer"])
def test_bad_token_is_refused_and_server_keeps_serving(server, token):
    client = client_for(server, token=token)
    with pytest.raises(PeerError, match="401"):
        client.fetch_all([key(0)])
    with pytest.raises(PeerError, match="401"):
        client.control({"op": "ping"})
    assert alive(server)


def test_binding_beyond_loopback_needs_a_token(tiers):
    with pytest.raises(ValueError, match="token"):
        PeerServer(list(tiers), host="0.0.0.0")
    PeerServer(list(tiers), host="0.0.0.0", token="x", insecure=True).close()  # a token (and TLS, tests/test_cluster_tls)


def test_control_messages(tiers):
    seen = []

    def handler(message):
        seen.append(message)
        if message.get("op") == "boom":
            raise RuntimeError("handler bug")
        return {"ok": True, "echo": message}

    srv = PeerServer(list(tiers), token=TOKEN, control=handler).start()
    try:
        client = client_for(srv)
        assert client.control({"op": "ping", "x": [1, 2]}) == {"ok": True, "echo": {"op": "ping", "x": [1, 2]}}
        reply = client.control({"op": "boom"})
        assert reply["ok"] is False and "handler bug" in reply["error"]
        assert alive(srv)
    finally:
        srv.close()


def raw_exchange(srv: PeerServer, data: bytes, timeout_s: float = 3.0) -> bytes:
    """Send raw bytes, half-close, and return everything the server sends back before closing."""
    with socket.create_connection((srv.host, srv.port), timeout=timeout_s) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = bytearray()
        while True:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        return bytes(out)


@pytest.mark.parametrize("data,code", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 400),  # not our protocol
    (p.pack_header(p.FrameType.GET, p.MAX_REQUEST_BYTES + 1), 413),  # oversize request
    (p.pack_header(p.FrameType.GET, 1 << 62), 413),  # absurd length
    (p.pack_header(p.FrameType.CHUNK, 0), 400),  # a response frame sent as a request
    (p.pack_header(p.FrameType.CONTROL, 5) + b"\x00\x00[1]", 400),  # control that is not an object
    (p.pack_header(p.FrameType.CONTROL, 4) + b"\x00\x00{\"", 400),  # bad JSON
])
def test_hostile_frames_get_an_error_frame(server, data, code):
    reply = raw_exchange(server, data)
    kind, _, length = p.parse_header(reply[:p.HEADER_BYTES])
    assert kind == p.FrameType.ERROR
    assert p.decode_error(reply[p.HEADER_BYTES:p.HEADER_BYTES + length]).code == code
    assert alive(server)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.one_of(
    st.binary(max_size=200),
    st.builds(lambda t, f, body: p.HEADER.pack(p.MAGIC, p.VERSION, t, f, len(body)) + body,
              st.integers(0, 255), st.integers(0, 65535), st.binary(max_size=300)),
    st.builds(lambda n, body: p.pack_header(p.FrameType.GET, len(body)) + body,
              st.integers(0, 3), st.binary(max_size=300)),
))
def test_fuzzed_input_never_breaks_the_server(fuzz_server, data):
    raw_exchange(fuzz_server, data, timeout_s=3.0)
    assert fuzz_server._thread.is_alive()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    cpu = CpuTier(1 << 20)
    cpu.put(key(0), make_blob(key(0)))
    srv = PeerServer([cpu], token=TOKEN, io_timeout_s=0.5, idle_timeout_s=0.5).start()
    yield srv
    assert alive(srv)
    srv.close()


def test_client_times_out_on_a_silent_peer():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)  # accepts (kernel backlog) but never answers
    try:
        client = PeerClient("127.0.0.1", listener.getsockname()[1], connect_timeout_s=0.5, io_timeout_s=0.3)
        with pytest.raises(PeerError, match="timed out"):
            finishes(lambda: client.fetch_all([key(0)]))
        with pytest.raises(PeerError, match="timed out"):
            finishes(lambda: client.control({"op": "ping"}, timeout_s=0.3))
    finally:
        listener.close()


def test_client_connect_refused_is_a_peer_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PeerError):
        PeerClient("127.0.0.1", port, connect_timeout_s=0.5).fetch_all([key(0)])


def refused(srv: PeerServer) -> str:
    """The error a fresh client gets from `srv`, or "" if its fetch succeeds."""
    client = PeerClient(srv.host, srv.port)
    try:
        client.fetch_all([key(0)])
    except PeerError as exc:
        return str(exc)
    finally:
        client.close()
    return ""


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:  # open, nothing to read
        return False


def test_stalled_client_is_dropped_and_its_slot_freed(tiers):
    srv = PeerServer(list(tiers), max_connections=1, io_timeout_s=0.3, idle_timeout_s=0.3).start()
    try:
        stall = socket.create_connection((srv.host, srv.port))
        stall.sendall(p.pack_header(p.FrameType.GET, 100)[:5])  # half a header, then silence
        wait_for(lambda: "503" in refused(srv))  # once accepted, it holds the only slot: others get 503
        stall.settimeout(30)
        assert stall.recv(1024) == b""  # the server gives up on the stalled client and closes it...
        wait_for(lambda: refused(srv) == "")  # ...which frees the slot
        stall.close()
    finally:
        srv.close()


def test_stale_pooled_connection_is_retried(tiers):
    srv = PeerServer(list(tiers), idle_timeout_s=0.2).start()
    try:
        client = PeerClient(srv.host, srv.port)
        assert client.fetch_all([key(0)])[key(0)] is not None
        (pooled,) = client._idle
        wait_for(lambda: closed_by_peer(pooled))  # the server closed our idle pooled connection
        assert client.fetch_all([key(1)])[key(1)] is not None  # retried on a fresh connection
    finally:
        srv.close()


class LyingServer:
    """Answers any request with the given raw bytes."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(65536)
                    conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("reply", [
    p.pack_header(p.FrameType.CHUNK, 32 + 10) + key(5) + b"x" * 10,  # a chunk for another key
    p.pack_header(p.FrameType.CHUNK, 32 + (1 << 40)) + key(0),  # over the frame bound
    p.pack_header(p.FrameType.CHUNK, 32 + 100) + key(0) + b"x" * 10,  # truncated, then closed
    p.pack_header(p.FrameType.REPLY, 2) + b"{}",  # wrong frame type
    b"\x00" * 16,  # garbage
    p.pack_header(p.FrameType.CHUNK, 32, 7) + key(0),  # unknown status
])
def test_client_rejects_lying_peers(reply):
    liar = LyingServer(reply)
    try:
        client = PeerClient("127.0.0.1", liar.port, io_timeout_s=1.0, max_frame_bytes=1 << 20)
        with pytest.raises(PeerError):
            client.fetch_all([key(0)])
    finally:
        liar.close()


def test_concurrent_clients(server):
    errors = []

    def worker(n):
        client = client_for(server)
        try:
            for _ in range(20):
                got = client.fetch_all([key(i) for i in range(8)])
                if any(got[key(i)] != make_blob(key(i), seed=i) for i in range(8)):
                    errors.append("wrong bytes")
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert server.counters["chunks_sent"] >= 4 * 20 * 8
