"""The server's socket side: the Unix-domain control socket, one thread per client connection, admission.

Contract:
- The socket file is created with mode 0600 (umask set around bind, then chmod): only the server's user (and
  root) can connect. A stale socket file is replaced; a live server on the same path is an error.
- Admission, at HELLO (which must come within HELLO_TIMEOUT_S): the peer's uid (SO_PEERCRED) must be the
  server's or root's; with `server.token` set, the HELLO must carry it (compared in constant time). At most
  `server.max_clients` connections; beyond, a new one gets an ERROR answer and is closed.
- Each connection is served by its own thread, one request at a time, so a client can never queue more work than
  one request (the rest waits in its own socket buffer); answers are sent under a timeout, so a client that stops
  reading only stalls its own thread until the timeout closes it. A request's deadline is its arrival plus
  its budget.
- A malformed frame, a bad field, or any I/O error closes that connection only; a Refusal is an ERROR answer and
  the connection stays. When a connection closes, for whatever reason (kill -9 of the client included), every
  slot it leased is reclaimed (`Service.disconnect`).
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from pathlib import Path

from kvfabric.cache.remote import wire as P
from kvfabric.config import ServerConfig
from kvfabric.net.framing import PeerClosed, ProtocolError
from kvfabric.server.service import Client, Refusal, Service

log = logging.getLogger("kvfabric.server")

HELLO_TIMEOUT_S = 5.0
NO_BUDGET_S = 60.0  # the deadline of a request that names none (one-way requests)


class ServerError(RuntimeError):
    """The server cannot start (e.g. another one already serves this socket)."""


def bind_socket(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(0.5)
            probe.connect(str(path))
            raise ServerError(f"a server is already listening on {path}")
        except OSError:
            path.unlink()  # stale: nobody listens
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


class Listener:
    def __init__(self, service: Service, path: Path, settings: ServerConfig) -> None:
        self.service = service
        self.path = path
        self.settings = settings
        self._sock = bind_socket(path)
        self._inode = os.stat(path).st_ino
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False

    def serve_forever(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            with self._lock:
                full = len(self._conns) >= self.settings.max_clients
                if not full:
                    thread = threading.Thread(target=self._serve, args=(sock,), name="kvfabric-server-conn",
                                              daemon=True)
                    self._conns[sock] = thread
            if full:
                self.service.counters.add("refused.max_clients")
                self._refuse(sock, 0, "too many clients")
                continue
            thread.start()

    def stop(self) -> None:
        """Stop accepting (safe from a signal handler: no locks)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self, timeout_s: float = 5.0) -> None:
        self.stop()
        self._sock.close()
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._inode:  # never remove a successor's socket
                self.path.unlink()
        with self._lock:
            conns = dict(self._conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        until = time.monotonic() + timeout_s
        for thread in conns.values():
            thread.join(max(0.0, until - time.monotonic()))

    # ---- one connection ----------------------------------------------------------------------------------
    def _send(self, sock: socket.socket, op: int, request_id: int, body: dict) -> None:
        sock.settimeout(max(1.0, self.settings.timeout_s))
        P.send(sock, op, request_id, body)

    def _refuse(self, sock: socket.socket, request_id: int, why: str) -> None:
        with contextlib.suppress(OSError):
            self._send(sock, P.ERROR, request_id, {"error": f"refused: {why}"})
        sock.close()

    def _admit(self, sock: socket.socket) -> Client | None:
        pid, uid = peer_credentials(sock)
        frame = P.read_frame(sock, frozenset({P.HELLO}), timeout_s=HELLO_TIMEOUT_S)
        token = P.text_of(frame.body, "token", "", max_len=4096)
        why = ""
        if uid not in (os.geteuid(), 0):
            why = "another user"
        elif self.settings.token and not hmac.compare_digest(token.encode(), self.settings.token.encode()):
            why = "bad token"
        if not why:
            try:
                client, info = self.service.connect(frame.body, f"pid-{pid}")
            except ProtocolError as exc:
                why = str(exc)
        if why:
            self.service.counters.add("refused")
            log.warning("kvfabric server: refused a client (pid %d, uid %d): %s", pid, uid, why)
            self._refuse(sock, frame.request_id, why)
            return None
        self._send(sock, P.REPLY, frame.request_id, info)
        return client

    def _serve(self, sock: socket.socket) -> None:
        client: Client | None = None
        try:
            client = self._admit(sock)
            if client is None:
                return
            self.service.metrics.clients.inc()
            while True:
                sock.settimeout(None)  # an idle client may wait as long as it likes
                frame = P.read_frame(sock, P.REQUESTS - {P.HELLO})
                deadline = time.monotonic() + (frame.budget_ms / 1000 if frame.budget_ms else NO_BUDGET_S)

                def chunk(body: dict, request_id: int = frame.request_id) -> None:
                    self._send(sock, P.CHUNK, request_id, body)

                try:
                    op, body = P.REPLY, self.service.handle(client, frame.op, frame.body, deadline, chunk)
                except Refusal as exc:
                    op, body = P.ERROR, {"error": str(exc)}
                if not frame.flags & P.NO_REPLY:
                    self._send(sock, op, frame.request_id, body)
        except PeerClosed:
            pass
        except (ProtocolError, OSError) as exc:  # a malformed frame or a dead / stuck peer: this connection only
            self.service.counters.add("connections_dropped")
            log.info("kvfabric server: closing a connection: %s", exc)
        except Exception:  # a bug must cost one connection, never the server
            self.service.counters.add("handler_errors")
            log.exception("kvfabric server: request failed")
        finally:
            if client is not None:
                self.service.disconnect(client)
                self.service.metrics.clients.dec()
            sock.close()
            with self._lock:
                self._conns.pop(sock, None)
