"""The Mooncake client behind the Mooncake Store tier (tiers/mooncake.py): `MooncakeClient`, set up lazily, every
call under a deadline and a circuit breaker.

Contract:
- Deadlines: every client call, the client's set-up included, runs on a small pool of worker threads
  (`NUM_THREADS`) and is waited for at most `timeout_s`, so no call hangs its caller. `call(op, fn)` runs
  `fn(client)`, which answers the client's return code or a list of them.
- Breaker: an expired wait, or a code in `FAULTS` (an RPC or transfer failure: the master or a peer is gone),
  counts `<op>.timeouts` / `<op>.errors` and a failure toward a circuit breaker (kvfabric.net.breaker), as in the
  Redis tier, and `call` raises; while the breaker is open (and after `close`) `call` raises at once, counting
  `<op>.skipped`, without touching the network. The breaker's opening and closing are counted
  (`breaker.opened` / `breaker.closed`) and logged. The tier turns every raise into a miss / False / [False, ...].
- Lazy connect: the client is set up by the first call, so a master that is down at start costs misses, not an
  error; a failed set-up is tried again by the next call. The Mooncake client reconnects to a restarted master by
  itself. It is named `<local_host>:<free port>`.
- A call that gave up waiting may still be inside the client and land in its buffers later: its callers keep
  those buffers referenced (the call's closure holds them) and never hand them out again.
- Registered memory: `keep_registered(bufs)` tells a call which of its buffers to register with the client (first
  seen) and which to unregister (pushed out of the `MAX_REGISTERED` most recent); this object references every
  buffer still registered, so registered memory is never freed under the client. `transient` registers a call's
  other buffers for that call only, and only with RDMA (the TCP transport reads and writes any memory of this
  process).
- Thread safe: the Mooncake client is; this object's own state (the set-up, the registered buffers) has a lock.
- `close` unmounts the client's segment (its objects leave the store) and stops the workers. Calls that gave up
  waiting may still be inside the client: closing it under them crashes the process (seen in CI), so close first
  waits for them; if they are still stuck after `CLOSE_TIMEOUT_S` (or `timeout_s`, if longer), the client is
  left open.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np

from kvfabric.net.breaker import CircuitBreaker
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob

log = logging.getLogger("kvfabric.tiers.mooncake")  # the tier's logger: its warnings keep the name they had

OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600  # INVALID_PARAMS: what get_into answers when the object is larger than the buffer
FAULTS = frozenset({-1, -800, -900})  # internal error, transfer failed, RPC failed: the master or a peer is gone
MAX_REGISTERED = 8
NUM_THREADS = 4
CLOSE_TIMEOUT_S = 10.0  # the client's close takes seconds (it stops its heartbeat); unmounting must finish
T = TypeVar("T")


class _Unavailable(Exception):
    """Internal: the call was not made or did not answer in time (breaker open, deadline passed, fault)."""


class _Fault(Exception):
    """Internal: the client answered with a code meaning the master or a peer could not be reached."""


def address_of(buf: Blob) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def _checked(codes: T) -> T:
    """The client's return code(s), unless one says the master or a peer could not be reached."""
    for code in codes if isinstance(codes, list) else [codes]:
        if code in FAULTS:
            raise _Fault(code)
    return codes


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MooncakeClient:
    def __init__(self, master: str, metadata_url: str, *, protocol: str, rdma_devices: str, local_host: str,
                 segment_bytes: int, buffer_bytes: int, timeout_s: float, breaker: CircuitBreaker,
                 counters: Counters) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError("the mooncake tier needs the Mooncake client: pip install 'kvfabric[mooncake]' "
                              "(mooncake-transfer-engine-non-cuda) and Debian's libibverbs1") from exc
        self._make_store = MooncakeDistributedStore
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_host)  # read by the transfer engine at client set-up
        self.master, self.metadata_url = master, metadata_url
        self.protocol, self.rdma_devices, self.local_host = protocol, rdma_devices, local_host
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self.timeout_s = timeout_s  # read at each call: a change applies to the next one
        self.breaker = breaker
        self.counters = counters  # the tier's: one set of counters per tier
        self._pool = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="kvfabric-mooncake")
        self._lock = threading.Lock()
        self._store: Any = None
        self._setup: Future | None = None
        self._registered: OrderedDict[int, bytearray] = OrderedDict()  # address -> the scratch buffer there
        self._inflight: set[Future] = set()  # calls that may still be inside the client: close waits for them
        self._is_closed = False

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future:
        future = self._pool.submit(fn, *args)
        self._inflight.add(future)  # no lock: callers may hold self._lock; set.add and discard are atomic
        future.add_done_callback(self._inflight.discard)
        return future

    def _connect(self) -> Any:
        """Runs on a worker: make and set up the client (talks to the master; seconds to fail when it is down)."""
        store = self._make_store()
        hostname = f"{self.local_host}:{_free_port(self.local_host)}"
        try:
            code = store.setup(hostname, self.metadata_url, self.segment_bytes, self.buffer_bytes, self.protocol,
                               self.rdma_devices, self.master)
        except BaseException:
            store.close()
            raise
        with self._lock:
            if code == 0 and not self._is_closed:
                self._store = store
                return store
        store.close()
        raise _Fault(code)

    def _client(self, deadline: float) -> Any:
        store = self._store
        if store is not None:
            return store
        with self._lock:
            if self._setup is None or self._setup.done():  # the first try, or the last one failed
                self._setup = self._submit(self._connect)
            setup = self._setup
        return setup.result(timeout=max(0.0, deadline - time.monotonic()))

    def call(self, op: str, fn: Callable[[Any], T]) -> T:
        """fn(client) on a worker, waited for until the deadline; raise _Unavailable after counting a failure.
        fn answers the client's return code or a list of them; a code in FAULTS is a failure."""
        if self._is_closed or not self.breaker.allow():
            self.counters.add(f"{op}.skipped")
            raise _Unavailable
        deadline = time.monotonic() + self.timeout_s
        future: Future | None = None
        try:
            future = self._submit(lambda store: _checked(fn(store)), self._client(deadline))
            result = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except (FutureTimeout, _Fault) as exc:
            if future is not None:
                future.cancel()  # still queued behind stuck calls: never run it
            self.counters.add(f"{op}.{'timeouts' if isinstance(exc, FutureTimeout) else 'errors'}")
            if self.breaker.failure():
                self.counters.add("breaker.opened")
                log.warning("mooncake master %s unreachable (%s %s); circuit open", self.master,
                            type(exc).__name__, exc)
            raise _Unavailable from exc
        if self.breaker.success():
            self.counters.add("breaker.closed")
            log.warning("mooncake master %s reachable again; circuit closed", self.master)
        return result

    @contextmanager
    def transient(self, store: Any, addresses: Sequence[int], sizes: Sequence[int]) -> Iterator[None]:
        """Buffers registered for one call where the transport needs it (RDMA); nothing to do over TCP."""
        if self.protocol == "tcp":
            yield
            return
        for address, size in zip(addresses, sizes):
            store.register_buffer(address, size)
        try:
            yield
        finally:
            for address in addresses:
                store.unregister_buffer(address)

    def keep_registered(self, bufs: Sequence[bytearray]) -> tuple[list[int], list[int], list[int]]:
        """Each buffer's address; the addresses for the call to register with the client (first seen) and to
        unregister (pushed out of the MAX_REGISTERED most recent)."""
        addresses = [address_of(buf) for buf in bufs]
        new: list[int] = []
        with self._lock:
            for buf, address in zip(bufs, addresses):
                if address in self._registered:
                    self._registered.move_to_end(address)
                else:
                    self._registered[address] = buf
                    new.append(address)
                    self.counters.add("buffers.registered")
            old = [self._registered.popitem(last=False)[0] for _ in range(len(self._registered) - MAX_REGISTERED)]
        return addresses, new, old

    def close(self) -> None:
        """Unmount the segment and stop the workers, once the calls still inside the client are done (see the
        module docstring)."""
        with self._lock:
            self._is_closed = True
            store, self._store = self._store, None
            registered, self._registered = list(self._registered), OrderedDict()
            inflight = list(self._inflight)
        timeout = max(self.timeout_s, CLOSE_TIMEOUT_S)
        if store is not None and wait(inflight, timeout=timeout).not_done:
            log.warning("mooncake calls still running after %.1f s; the client is left open", timeout)
            store = None

        def run() -> None:
            for address in registered:
                store.unregister_buffer(address)
            store.close()

        if store is not None:
            try:
                self._pool.submit(run).result(timeout=timeout)
            except FutureTimeout:
                log.warning("mooncake client did not close within %.1f s", timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
