"""Peer-to-peer chunk transfer: a threaded TCP server that serves chunks from local tiers, and its client.

Server (`PeerServer`):
- Binds 127.0.0.1 unless told otherwise; binding elsewhere needs a token. At most `max_connections`
  connections are served at once (one thread each; extra ones get ERROR 503 and are closed).
- A connection waits at most `idle_timeout_s` for the next request and `io_timeout_s` for the rest of a frame;
  any protocol violation (bad magic, oversize or truncated body, bad token) gets an ERROR frame and the
  connection is closed. Nothing a client sends can raise out of the server or stop it.
- GET: each key is read from the served tiers (or the one named); blobs go out as they are stored, with
  scatter-gather writes (no copy in user space); chunks kept as files (disk tier) go out with sendfile. A key
  no tier holds (or a tier that raises) gives Status.MISSING and `on_missing(key)` is called (the worker then
  corrects what the controller believes).
- CONTROL: the JSON message goes to the `control` callback; its dict (or {"ok": false, "error": ...}) is the
  REPLY.
Threads rather than asyncio: tier reads block (files), and a blocking `sendmsg` of the stored blob sends it
without first copying it into a transport buffer.

Client (`PeerClient`): one per peer address, thread safe, keeps up to `pool_size` idle connections.
`fetch(keys)` streams (key, blob | None) in request order, each blob a memoryview of its own new buffer; any
failure raises `PeerError` (after yielding what did arrive), never hangs past the timeouts.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvfabric.cluster import protocol as p
from kvfabric.tiers.base import Blob, Tier

log = logging.getLogger(__name__)


def new_buffer(size: int) -> memoryview:
    """A writable buffer for one received chunk, left uninitialized (numpy.empty): a bytearray would first
    zero every page, doubling the cost of the page faults a fresh multi-MB allocation takes anyway."""
    return memoryview(np.empty(size, dtype=np.uint8))


class PeerError(Exception):
    """A fetch or control call to a peer failed (unreachable, timed out, refused, or spoke nonsense)."""


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PeerServer:
    def __init__(self, tiers: Sequence[Tier], *, token: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 control: Callable[[dict], dict] | None = None, on_missing: Callable[[bytes], None] | None = None,
                 max_connections: int = 64, io_timeout_s: float = 10.0, idle_timeout_s: float = 60.0,
                 max_keys: int = p.MAX_KEYS, max_request_bytes: int = p.MAX_REQUEST_BYTES) -> None:
        if not token and not is_loopback(host):
            raise ValueError(f"the peer server binds {host!r}, beyond loopback: a token is required")
        self.tiers = list(tiers)
        self._token = token.encode() if token else None
        self.control = control
        self.on_missing = on_missing
        self.max_keys = min(max_keys, p.MAX_KEYS)
        self.max_request_bytes = max_request_bytes
        self.io_timeout_s = io_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closing = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {"requests": 0, "chunks_sent": 0, "bytes_sent": 0, "missing": 0,
                                         "errors": 0, "rejected": 0, "sendfile": 0}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self._sock.settimeout(0.2)  # the accept loop checks for close() this often
        self.host, self.port = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name="kvfabric-p2p-accept", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def start(self) -> PeerServer:
        self._thread.start()
        return self

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    # ---- connections ---------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closing.is_set():
                    return
                time.sleep(0.05)  # e.g. out of file descriptors: back off, keep serving
                continue
            p.tune(conn)
            if not self._slots.acquire(blocking=False):
                self._count("rejected")
                self._reject(conn, 503, "too many connections")
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvfabric-p2p-conn", daemon=True).start()

    def _reject(self, conn: socket.socket, code: int, message: str) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(p.encode_error(code, message))
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closing.is_set():
                try:
                    kind, _, length = p.recv_header(conn, self.idle_timeout_s)
                except (OSError, p.ProtocolError) as exc:
                    if isinstance(exc, p.ProtocolError):
                        self._count("errors")
                        conn.settimeout(1.0)
                        conn.sendall(p.encode_error(400, str(exc)))
                    return
                if kind not in (p.FrameType.GET, p.FrameType.CONTROL):
                    self._count("errors")
                    conn.sendall(p.encode_error(400, f"unexpected frame {kind.name}"))
                    return
                if length > self.max_request_bytes:
                    self._count("errors")
                    conn.sendall(p.encode_error(413, f"request of {length} bytes is over {self.max_request_bytes}"))
                    return
                body = bytearray(length)
                p.recv_exact(conn, memoryview(body), self.io_timeout_s,
                             time.monotonic() + self.io_timeout_s)
                self._count("requests")
                try:
                    if kind == p.FrameType.GET:
                        ok = self._get(conn, body)
                    else:
                        ok = self._control(conn, body)
                except p.ProtocolError as exc:
                    self._count("errors")
                    conn.sendall(p.encode_error(400, str(exc)))
                    return
                if not ok:
                    return
        except OSError:
            pass  # the client went away or stalled: drop the connection
        except Exception:  # never let a handler bug take the server down
            log.exception("peer connection failed")
            self._count("errors")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    def _authorized(self, token: bytes) -> bool:
        return self._token is None or hmac.compare_digest(token, self._token)

    # ---- requests ------------------------------------------------------------------------------------------
    def _get(self, conn: socket.socket, body: bytearray) -> bool:
        token, tier_name, keys = p.decode_get(body)
        if not self._authorized(token):
            self._count("errors")
            conn.sendall(p.encode_error(401, "bad token"))
            return False
        if len(keys) > self.max_keys:
            conn.sendall(p.encode_error(413, f"at most {self.max_keys} keys per request"))
            return False
        tiers = [t for t in self.tiers if not tier_name or t.name == tier_name]
        conn.settimeout(self.io_timeout_s)
        for key in keys:
            if self._send_file(conn, tiers, key):
                continue
            blob = self._read(tiers, key)
            if blob is None:
                self._count("missing")
                conn.sendall(p.pack_header(p.FrameType.CHUNK, p.KEY_BYTES, p.Status.MISSING) + key)
                if self.on_missing is not None:
                    try:
                        self.on_missing(key)
                    except Exception:
                        log.exception("on_missing callback failed")
                continue
            p.send_all(conn, [p.pack_header(p.FrameType.CHUNK, p.KEY_BYTES + len(blob), p.Status.OK), key, blob])
            with self._lock:
                self.counters["chunks_sent"] += 1
                self.counters["bytes_sent"] += len(blob)
        conn.sendall(p.pack_header(p.FrameType.END, 4) + len(keys).to_bytes(4, "little"))
        return True

    def _send_file(self, conn: socket.socket, tiers: Sequence[Tier], key: bytes) -> bool:
        """Serve a chunk kept as a file (a disk tier exposing `path(key)`) with sendfile: no copy through this
        process, no buffer to allocate. Only when no faster tier before it holds the key. True if sent."""
        for tier in tiers:
            path_of = getattr(tier, "path", None)
            if path_of is None:
                if tier.contains_many([key])[0]:
                    return False  # a memory tier has it: the normal path
                continue
            try:
                f = open(path_of(key), "rb")
            except OSError:
                continue
            with f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    continue
                conn.sendall(p.pack_header(p.FrameType.CHUNK, p.KEY_BYTES + size, p.Status.OK) + key)
                # socket.sendfile: os.sendfile, waiting within the socket's timeout when its buffer is full.
                # The file is immutable once renamed into place (the disk tier's contract).
                if conn.sendfile(f, 0, size) != size:
                    raise ConnectionError("file shrank while being sent")  # the client sees a failure
            with self._lock:
                self.counters["chunks_sent"] += 1
                self.counters["bytes_sent"] += size
                self.counters["sendfile"] += 1
            return True
        return False

    @staticmethod
    def _read(tiers: Sequence[Tier], key: bytes) -> Blob | None:
        for tier in tiers:
            try:
                blob = tier.get(key)
            except Exception:
                log.exception("tier %s failed to read a chunk", tier.name)
                continue
            if blob is not None:
                return blob
        return None

    def _control(self, conn: socket.socket, body: bytearray) -> bool:
        token, message = p.decode_control(body)
        if not self._authorized(token):
            self._count("errors")
            conn.sendall(p.encode_error(401, "bad token"))
            return False
        if self.control is None:
            reply = {"ok": False, "error": "no control handler"}
        else:
            try:
                reply = self.control(message)
            except Exception as exc:
                log.exception("control message failed")
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        data = p.encode_json(reply)
        conn.settimeout(self.io_timeout_s)
        conn.sendall(p.pack_header(p.FrameType.REPLY, len(data)) + data)
        return True

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:  # wake handlers blocked in recv
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class PeerClient:
    def __init__(self, host: str, port: int, token: str | None = None, *, connect_timeout_s: float = 1.0,
                 io_timeout_s: float = 5.0, max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES,
                 pool_size: int = 4) -> None:
        self.host, self.port = host, int(port)
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
        p.tune(sock)
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
                    p.recv_exact(sock, memoryview(got_key), self.io_timeout_s, deadline)
                    if got_key != key:
                        raise p.ProtocolError("chunk frames out of order")
                    if flags == p.Status.MISSING and length == p.KEY_BYTES:
                        yield key, None
                        continue
                    if flags != p.Status.OK:
                        raise p.ProtocolError(f"bad chunk status {flags}")
                    blob = new_buffer(length - p.KEY_BYTES)
                    p.recv_exact(sock, blob, self.io_timeout_s, deadline)
                    yield key, blob
                kind, _, length = p.recv_header(sock, self.io_timeout_s, deadline)
                if kind != p.FrameType.END or length != 4:
                    raise p.ProtocolError(f"expected END, got {kind.name}")
                p.recv_exact(sock, memoryview(bytearray(4)), self.io_timeout_s, deadline)
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
                p.recv_exact(sock, memoryview(body), timeout, deadline)
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
            p.recv_exact(sock, memoryview(body), self.io_timeout_s, deadline)
        except OSError:
            return p.RemoteError(0, "truncated error frame")
        return p.decode_error(body)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
