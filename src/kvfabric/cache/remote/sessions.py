"""A RemoteCache's connections to `kvfabric server`: who gets one for a call, what a failure does, and leases whose
holder let go.

Contract:
- `session(conn=None)` is a context manager giving a connection for one call (up to MAX_CONNECTIONS, each used by
  one thread at a time; `conn`: the one that holds a lease the call is about). A server that is down, refuses us or
  misbehaves raises `Down` out of it, and for `retry_s` every session raises `Down` at once without trying; then the
  next one reconnects (a restarted server's new pool is mapped then). A timeout leaves the connection in sync.
- `orphan(conn, slot)`: a lease its holder let go (a source's exit, a payload garbage-collected); it rides on that
  connection's next request.
- `pool` is the server's shared-memory slot pool, mapped at first contact.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvfabric.cache.remote import wire as P
from kvfabric.cache.remote.connection import Connection, RemoteError
from kvfabric.cache.remote.pool import PoolError, SlotPool
from kvfabric.config import ServerConfig
from kvfabric.net.framing import ProtocolError
from kvfabric.observe.counters import Counters

MAX_CONNECTIONS = 4


class Down(Exception):
    """The server cannot serve this call: the caller answers a miss."""


class Sessions:
    def __init__(self, settings: ServerConfig, hello: dict[str, Any], counters: Counters,
                 slot_layout: list[Any]) -> None:
        self.settings = settings
        self.counters = counters
        self._hello = hello
        self._slot_layout = slot_layout  # what this client's pool slots must hold (wire.slot_layout)
        self._conns: list[Connection] = []
        self._lock = threading.Lock()
        self.pool: SlotPool | None = None
        self._down_until = 0.0
        self._orphans: list[tuple[Connection, int]] = []  # leases whose holder let go

    @contextlib.contextmanager
    def session(self, conn: Connection | None = None) -> Iterator[Connection]:
        if conn is None and time.monotonic() < self._down_until:
            self.counters.add("server_down_calls")
            raise Down
        started = time.perf_counter_ns()
        held: Connection | None = None
        try:
            held = self._take(conn)
            self._release_orphans(held)
            yield held
        except RemoteError as exc:
            self.counters.add("server_refusals")
            raise Down from exc
        except (OSError, ProtocolError, PoolError, ValueError) as exc:  # TimeoutError is an OSError
            self._failed(held, exc)
            raise Down from exc
        finally:
            if held is not None:
                held.lock.release()
            self.counters.add("client_ns", time.perf_counter_ns() - started)

    def _take(self, wanted: Connection | None) -> Connection:
        if wanted is not None:
            if wanted not in self._conns:
                raise ProtocolError("the connection holding this lease is gone")
            wanted.lock.acquire()
            return wanted
        with self._lock:
            for conn in self._conns:
                if conn.lock.acquire(blocking=False):
                    return conn
            if len(self._conns) < MAX_CONNECTIONS:
                conn = self._open()
                conn.lock.acquire()
                self._conns.append(conn)
                return conn
            conn = self._conns[len(self._conns) - 1]
        conn.lock.acquire()
        return conn

    def _open(self) -> Connection:
        conn = Connection.open(self.settings, self._hello)
        try:
            if conn.info.get("slot_layout", self._hello["layout"]) != self._slot_layout:
                raise ProtocolError(f"the server's slots hold {conn.info.get('slot_layout', 'the whole model')}, "
                                    f"not this client's {self._slot_layout}")
            pool_id = P.bytes_of(conn.info, "pool_id", 16)
            if self.pool is None or self.pool.pool_id != pool_id:  # first contact or a restarted server
                for old in self._conns:
                    old.close()
                self._conns.clear()
                self.pool = SlotPool.open(P.text_of(conn.info, "pool", max_len=4096), pool_id)
                self.counters.add("server_connects")
        except BaseException:
            conn.close()
            raise
        return conn

    def _failed(self, conn: Connection | None, exc: BaseException) -> None:
        self.counters.add("server_errors")
        self._down_until = time.monotonic() + self.settings.retry_s
        if conn is not None and not isinstance(exc, TimeoutError):  # a timeout leaves the stream in sync
            conn.close()
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)

    def _release_orphans(self, conn: Connection) -> None:
        with self._lock:
            mine = [slot for c, slot in self._orphans if c is conn]
            self._orphans = [(c, slot) for c, slot in self._orphans if c is not conn and c in self._conns]
        conn.release(mine)

    def orphan(self, conn: Connection, slot: int) -> None:
        with self._lock:
            self._orphans.append((conn, slot))

    @staticmethod
    def room(conn: Connection) -> int:
        """Slots this connection may still lease (the server's per-client cap)."""
        return max(0, int(conn.info.get("max_slots", 1)) - conn.num_leased)

    def close(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
            self._orphans.clear()
        for conn in conns:
            conn.close()  # the server reclaims every slot these connections leased
        if self.pool is not None:
            self.pool.close()
