"""One client connection to `kvfabric server`: the hello, request/answer exchanges under a deadline, lease bookkeeping.

Contract:
- `Connection.open(settings, hello)` connects to the Unix socket, sends HELLO (token, namespace, client name) and
  returns the connection with the server's answer (`info`: pool path and id, slot size, the per-client slot cap).
  A refusal (bad token, unknown namespace, too many clients) raises Refused.
- `call(op, body, on_chunk)` sends one request with the settings' deadline and returns the final REPLY body;
  CHUNK frames of that request go to `on_chunk` as they arrive. An ERROR answer raises RemoteError (the
  connection stays usable). A timeout raises TimeoutError and leaves the connection usable: answers of an abandoned
  request are recognised by their request id and skipped later (slots they leased are released), so only a dead
  or misbehaving server (EOF, a bad frame) ends a connection.
- Leases belong to the connection that made them (the server reclaims them when it closes). `release(slots)`
  queues slots; they ride on the next request (`release` field) or go out now with `flush_releases()` (one-way).
- A connection is used by one thread at a time (`lock`).
"""
from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvfabric.cache.remote import wire as P
from kvfabric.config import ServerConfig
from kvfabric.net.framing import ProtocolError


class Refused(ProtocolError):
    """The server refused this client (token, namespace, capacity)."""


class RemoteError(Exception):
    """The server answered ERROR to one request (busy, bad argument); the connection is fine."""


class Connection:
    def __init__(self, sock: socket.socket, settings: ServerConfig, info: dict[str, Any]) -> None:
        self.sock = sock
        self.settings = settings
        self.info = info
        self.lock = threading.Lock()
        self.num_leased = 0  # slots this connection holds (for the per-client cap)
        self._pending: list[int] = []  # slots to release with the next request
        self._ids = itertools.count(1)

    @classmethod
    def open(cls, settings: ServerConfig, hello: dict[str, Any]) -> Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(settings.timeout_s)
            sock.connect(str(settings.resolved_socket()))
            conn = cls(sock, settings, {})
            conn.info = conn.call(P.HELLO, {**hello, "token": settings.token})
        except RemoteError as exc:
            sock.close()
            raise Refused(str(exc)) from None
        except BaseException:
            sock.close()
            raise
        return conn

    def call(self, op: int, body: dict[str, Any], on_chunk: Callable[[dict[str, Any]], None] | None = None,
             timeout_s: float | None = None) -> dict[str, Any]:
        timeout_s = timeout_s or self.settings.timeout_s
        request_id = next(self._ids) & 0xFFFFFFFF
        if self._pending:
            body = {**body, "release": self._pending}
            self.num_leased -= len(self._pending)
            self._pending = []
        deadline = time.monotonic() + timeout_s
        self.sock.settimeout(timeout_s)
        P.send(self.sock, op, request_id, body, budget_ms=int(timeout_s * 1000))
        while True:
            frame = P.read_frame(self.sock, P.ANSWERS, deadline=deadline)
            if frame.request_id != request_id:  # a late answer to a request we gave up on
                if frame.op == P.CHUNK and type(frame.body.get("slot")) is int:
                    self.num_leased += 1
                    self._pending.append(frame.body["slot"])
                continue
            if frame.op == P.CHUNK:
                self.num_leased += 1
                if on_chunk is not None:
                    on_chunk(frame.body)
                continue
            if frame.op == P.ERROR:
                raise RemoteError(str(frame.body.get("error", "error")))
            return frame.body

    def release(self, slots: list[int]) -> None:
        self._pending.extend(slots)

    def flush_releases(self) -> None:
        """Send the queued releases now (one-way: no answer)."""
        if self._pending:
            self.sock.settimeout(self.settings.timeout_s)
            P.send(self.sock, P.RELEASE, 0, {"release": self._pending}, flags=P.NO_REPLY)
            self.num_leased -= len(self._pending)
            self._pending = []

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

