"""Peer-to-peer chunk transfer, client side: `PeerClient`, `PeerPool`, `PeerError`, the receive buffer allocator.

Client (`PeerClient`): one per peer address, thread safe, keeps up to `pool_size` idle connections. With `tls`
(an ssl client context from kvfabric.net.tls) each connection is TLS, the server's certificate checked against the
CA and the address; a refused handshake is a PeerError naming the reason ("certificate verify failed: ...").
`fetch(keys)` streams (key, blob | None) in request order, each blob a memoryview of its own new buffer; any
failure raises `PeerError` (after yielding what did arrive), never hangs past the timeouts.
`PeerPool`: one `PeerClient` per (host, port), made on first use with the pool's settings; `close` closes them all.

The server side is `p2p_server`.
"""
from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

from kvfabric.cluster import protocol as p
from kvfabric.net.framing import no_delay, recv_into
from kvfabric.net.tls import handshake_error


def new_buffer(size: int) -> memoryview:
    """A writable buffer for one received chunk, left uninitialized (numpy.empty): a bytearray would first
    zero every page, doubling the cost of the page faults a fresh multi-MB allocation takes anyway."""
    return memoryview(np.empty(size, dtype=np.uint8))


class PeerError(Exception):
    """A fetch or control call to a peer failed (unreachable, timed out, refused, or spoke nonsense)."""


class PeerClient:
    def __init__(self, host: str, port: int, token: str | None = None, *, connect_timeout_s: float = 1.0,
                 io_timeout_s: float = 5.0, max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES,
                 pool_size: int = 4, tls: ssl.SSLContext | None = None) -> None:
        self.host, self.port = host, int(port)
        self.tls = tls
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.pool_size = pool_size
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"PeerClient({self.host}:{self.port})"

    # ---- connections ---------------------------------------------------------------------------------------
    def _connect(self) -> tuple[socket.socket, bool]:
        """A connection and whether it came from the pool (a pooled one may have been closed by the server)."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        except OSError as exc:
            raise PeerError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        no_delay(sock)
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)  # handshake within connect_timeout_s
            except (ssl.SSLError, OSError) as exc:
                sock.close()
                raise PeerError(f"TLS handshake with {self.host}:{self.port} refused: {handshake_error(exc)}") \
                    from None
        return sock, False

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.pool_size:
                self._idle.append(sock)
                return
        sock.close()

    # ---- calls ---------------------------------------------------------------------------------------------
    def fetch(self, keys: Sequence[bytes], tier: str = "", timeout_s: float | None = None,
              ) -> Iterator[tuple[bytes, memoryview | None]]:
        """Yield (key, blob or None if the peer lacks it) for each key, in order, as they arrive. At most
        `protocol.MAX_KEYS` keys per call. `timeout_s`: an overall deadline (the inactivity timeout is
        `io_timeout_s`). Raises PeerError on any failure; what arrived before it was already yielded."""
        request = p.encode_get(self.token, keys, tier)
        frame = p.pack_header(p.FrameType.GET, len(request)) + request
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for attempt in range(2):
            sock, pooled = self._connect()
            received = 0
            ok = False
            try:
                sock.settimeout(self.io_timeout_s)
                sock.sendall(frame)
                for key in keys:
                    kind, flags, length = p.recv_header(sock, self.io_timeout_s, deadline)
                    received += 1
                    if kind == p.FrameType.ERROR:
                        raise self._error(sock, length, deadline)
                    if kind != p.FrameType.CHUNK or length < p.KEY_BYTES or length - p.KEY_BYTES > self.max_frame_bytes:
                        raise p.ProtocolError(f"unexpected {kind.name} frame of {length} bytes")
                    got_key = bytearray(p.KEY_BYTES)
                    recv_into(sock, memoryview(got_key), self.io_timeout_s, deadline)
                    if got_key != key:
                        raise p.ProtocolError("chunk frames out of order")
                    if flags == p.Status.MISSING and length == p.KEY_BYTES:
                        yield key, None
                        continue
                    if flags != p.Status.OK:
                        raise p.ProtocolError(f"bad chunk status {flags}")
                    blob = new_buffer(length - p.KEY_BYTES)
                    recv_into(sock, blob, self.io_timeout_s, deadline)
                    yield key, blob
                kind, _, length = p.recv_header(sock, self.io_timeout_s, deadline)
                if kind != p.FrameType.END or length != 4:
                    raise p.ProtocolError(f"expected END, got {kind.name}")
                recv_into(sock, memoryview(bytearray(4)), self.io_timeout_s, deadline)
                ok = True
                self._release(sock)
                return
            except (OSError, p.ProtocolError) as exc:
                if pooled and received == 0 and attempt == 0 and not isinstance(exc, (TimeoutError, p.RemoteError)):
                    continue  # a stale pooled connection: retry once on a fresh one
                raise PeerError(f"fetch from {self.host}:{self.port} failed: {exc}") from None
            finally:
                if not ok:
                    sock.close()

    def fetch_all(self, keys: Sequence[bytes], tier: str = "", timeout_s: float | None = None,
                  ) -> dict[bytes, memoryview | None]:
        return dict(self.fetch(keys, tier, timeout_s))

    def control(self, message: dict, timeout_s: float | None = None) -> dict:
        """Send one JSON control message; return the peer's JSON reply. Raises PeerError."""
        request = p.encode_control(self.token, message)
        if len(request) > p.MAX_REQUEST_BYTES:
            raise PeerError(f"control message of {len(request)} bytes is over {p.MAX_REQUEST_BYTES}")
        timeout = timeout_s or self.io_timeout_s
        deadline = time.monotonic() + timeout
        for attempt in range(2):
            sock, pooled = self._connect()
            ok = False
            try:
                sock.settimeout(timeout)
                sock.sendall(p.pack_header(p.FrameType.CONTROL, len(request)) + request)
                kind, _, length = p.recv_header(sock, timeout, deadline)
                if kind == p.FrameType.ERROR:
                    raise self._error(sock, length, deadline)
                if kind != p.FrameType.REPLY or length > p.MAX_REQUEST_BYTES * 16:
                    raise p.ProtocolError(f"unexpected {kind.name} frame of {length} bytes")
                body = bytearray(length)
                recv_into(sock, memoryview(body), timeout, deadline)
                reply = p.decode_json(body)
                ok = True
                self._release(sock)
                return reply
            except (OSError, p.ProtocolError) as exc:
                if pooled and attempt == 0 and not isinstance(exc, (TimeoutError, p.RemoteError)):
                    continue
                raise PeerError(f"control call to {self.host}:{self.port} failed: {exc}") from None
            finally:
                if not ok:
                    sock.close()
        raise PeerError("unreachable")  # pragma: no cover

    def _error(self, sock: socket.socket, length: int, deadline: float | None) -> p.RemoteError:
        body = bytearray(min(length, 4096))
        try:
            recv_into(sock, memoryview(body), self.io_timeout_s, deadline)
        except OSError:
            return p.RemoteError(0, "truncated error frame")
        return p.decode_error(body)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


class PeerPool:
    """One PeerClient per peer address, thread safe."""

    def __init__(self, token: str | None, **client_kw) -> None:
        self.token = token
        self.client_kw = client_kw  # PeerClient's keywords (timeouts, pool_size, tls), for clients made from now on
        self._clients: dict[tuple[str, int], PeerClient] = {}
        self._lock = threading.Lock()

    def client(self, host: str, port: int) -> PeerClient:
        with self._lock:
            client = self._clients.get((host, port))
            if client is None:
                client = self._clients[(host, port)] = PeerClient(host, port, self.token, **self.client_kw)
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
