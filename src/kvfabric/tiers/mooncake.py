"""Mooncake Store tier: chunk blobs as objects in a Mooncake Store (a `mooncake_master` plus clients whose memory
segments hold the data; Mooncake's transfer engine moves it, over TCP or RDMA).

Contract:
- A chunk lives under the object key `kvf:<key hex>` (the chunk key already names model, layout and tenant).
  Writes are upserts (Mooncake's put keeps an existing object's old value) straight from the blob's memory
  (`upsert_from`: address and length, no staging copy). Reads go straight into the caller's scratch buffer
  (`get_into`), which is registered with the client the first time it is seen; the most recent
  `MAX_REGISTERED` scratch buffers stay registered and referenced, so registered memory is never freed under the
  client. `put_many` / `get_many_into` move many chunks in one batch call (`batch_upsert_from` / `batch_get_into`).
  `get` (no scratch) reads into a fresh buffer. Transient buffers (blobs being put, `get`'s fresh buffer) are
  registered for the call only with RDMA: the TCP transport reads and writes any memory of this process, and
  registering a buffer costs about as much as copying it (docs/design/measurements.md).
- Where objects live: in the memory segments that clients mount (this one lends `segment_bytes`). The master
  places each object, keeps its metadata in memory only, and drops the objects of a segment whose client leaves.
  So the tier is shared (every client of the master sees every object) and not persistent.
- The master bounds memory (it evicts at its high watermark) and leases objects being read: `capacity_bytes`
  only refuses a single larger blob, and pin/unpin are no-ops. `delete` and `clear` force removal past a lease;
  a read racing them gets bytes whose checksum fails upstream: a counted miss.
- Not trusted: the stack verifies every blob read from here (chunk format checksums); a damaged object is a miss.
- Faults never reach the caller and never hang it: every client call, the client's set-up included, runs on a
  small pool of worker threads and is waited for at most `timeout_s`. An expired wait, an RPC or transfer failure
  is a miss / False / [False, ...] and counts toward a circuit breaker (kvfabric.breaker), as in the Redis tier.
  The client is set up lazily, so a master that is down at start costs misses, not an error; the Mooncake client
  reconnects to a restarted master by itself. A read that gave up waiting may still land in its buffer later:
  that scratch buffer is let go (`Scratch.discard`), never handed out again. Failed stores are dropped and counted.
- `keys()` and `usage()` ask the master's admin HTTP server (`metrics_url`: /get_all_keys, /metrics); when it
  cannot be reached they answer [] and zeros.
- Network: the client is named `<local_host>:<free port>`; the transfer engine advertises the address in
  MC_TCP_BIND_ADDRESS, which the tier sets to `local_host` when unset (otherwise Mooncake advertises the machine's
  external interface). Mooncake's own sockets (the transfer engine's ports, the master's metadata server) listen
  on all interfaces whatever is set: see the README's security notes.
- Thread safe: the Mooncake client is; the tier's own state has a lock.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np

from kvfabric.breaker import CircuitBreaker
from kvfabric.config import MooncakeTierConfig
from kvfabric.counters import Counters
from kvfabric.pages import Scratch
from kvfabric.tiers.base import Blob, TierBase, TierUsage

log = logging.getLogger(__name__)

PREFIX = "kvf:"
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


def object_key(key: bytes) -> str:
    return PREFIX + key.hex()


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


class MooncakeTier(TierBase):
    name = "mooncake"
    is_trusted = False
    is_read_only = False
    is_persistent = False  # objects live in clients' memory segments; the master's metadata is in memory only
    is_shared = True
    honors_capacity = False  # the master evicts at its watermark; capacity_bytes only refuses larger blobs
    honors_pins = False  # a client cannot hold an object in the store beyond the master's read lease

    def __init__(self, master: str = "127.0.0.1:50051", metadata_url: str = "http://127.0.0.1:8080/metadata", *,
                 metrics_url: str = "", protocol: str = "tcp", rdma_devices: str = "", local_host: str = "127.0.0.1",
                 segment_bytes: int = 2**30, buffer_bytes: int = 64 * 2**20, timeout_s: float = 1.0,
                 capacity_bytes: int = 2**40, breaker_failures: int = 3, backoff_max_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError("the mooncake tier needs the Mooncake client: pip install 'kvfabric[mooncake]' "
                              "(mooncake-transfer-engine-non-cuda) and Debian's libibverbs1") from exc
        self._make_store = MooncakeDistributedStore
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_host)  # read by the transfer engine at client set-up
        self.master, self.metadata_url = master, metadata_url
        self.metrics_url = (metrics_url or f"http://{master.rsplit(':', 1)[0]}:9003").rstrip("/")
        self.protocol, self.rdma_devices, self.local_host = protocol, rdma_devices, local_host
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self.timeout_s = float(timeout_s)
        self.capacity_bytes = capacity_bytes
        self.counters = Counters()
        self.breaker = CircuitBreaker(breaker_failures, backoff_max_s)
        self._pool = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="kvfabric-mooncake")
        self._lock = threading.Lock()
        self._store: Any = None
        self._setup: Future | None = None
        self._registered: OrderedDict[int, bytearray] = OrderedDict()  # address -> the scratch buffer there
        self._size_hint = 0  # the largest object read so far: chunks of one tier are nearly all the same size
        self._inflight: set[Future] = set()  # calls that may still be inside the client: close waits for them
        self._closed = False

    @classmethod
    def from_config(cls, c: MooncakeTierConfig) -> MooncakeTier:
        return cls(c.master, c.metadata_url, metrics_url=c.metrics_url, protocol=c.protocol,
                   rdma_devices=c.rdma_devices, local_host=c.local_host, segment_bytes=c.segment,
                   buffer_bytes=c.buffer, timeout_s=c.timeout_s, capacity_bytes=c.capacity,
                   breaker_failures=c.breaker_failures, backoff_max_s=c.backoff_max_s)

    # ---- the client, and calls to it under a deadline and the breaker -------------------------------------
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
            if code == 0 and not self._closed:
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

    def _call(self, op: str, fn: Callable[[Any], T]) -> T:
        """fn(client) on a worker, waited for until the deadline; raise _Unavailable after counting a failure."""
        if self._closed or not self.breaker.allow():
            self.counters.add(f"{op}.skipped")
            raise _Unavailable
        deadline = time.monotonic() + self.timeout_s
        future: Future | None = None
        try:
            future = self._submit(fn, self._client(deadline))
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
    def _transient(self, store: Any, addresses: Sequence[int], sizes: Sequence[int]) -> Iterator[None]:
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

    def _scratch_buffers(self, scratches: Sequence[Scratch], size: int) -> tuple[list[bytearray], list[int], list[int],
                                                                                 list[int]]:
        """Each scratch's whole buffer (at least `size` bytes) and its address; the addresses to register with the
        client (first seen) and to unregister (pushed out of the MAX_REGISTERED most recent)."""
        bufs = [scratch.view(size).obj for scratch in scratches]
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
        return bufs, addresses, new, old

    # ---- Tier protocol -----------------------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        names = [object_key(key) for key in keys]
        try:
            return [code == 1 for code in self._call("contains", lambda s: _checked(s.batch_is_exist(names)))]
        except Exception:  # noqa: BLE001 - a fault is a miss, never an error for the caller
            return [False] * len(keys)

    def get(self, key: bytes) -> Blob | None:
        return self._read([key], [Scratch()], register=False)[0]

    def get_into(self, key: bytes, scratch: Scratch) -> Blob | None:
        return self._read([key], [scratch], register=True)[0]

    def get_many_into(self, keys: Sequence[bytes], scratches: Sequence[Scratch]) -> list[Blob | None]:
        if len(keys) != len(scratches):
            raise ValueError(f"{len(keys)} keys but {len(scratches)} scratch buffers")
        if not keys:
            return []
        first = {key: i for i, key in reversed(list(enumerate(keys)))}
        if len(first) == len(keys):
            return self._read(keys, scratches, register=True)
        # A key twice in one batch_get_into fills only one of its buffers (and reports both filled): read the
        # first occurrences, then the repeats in another batch.
        repeats = [i for i, key in enumerate(keys) if first[key] != i]
        out = dict(zip(first.values(), self._read(list(first), [scratches[i] for i in first.values()], True)))
        out.update(zip(repeats, self.get_many_into([keys[i] for i in repeats], [scratches[i] for i in repeats])))
        return [out[i] for i in range(len(keys))]

    def _read(self, keys: Sequence[bytes], scratches: Sequence[Scratch], register: bool) -> list[Blob | None]:
        """One batch_get_into of every key into its scratch; an object larger than the buffer is read again
        once its size is known."""
        names = [object_key(key) for key in keys]
        size = self._size_hint or next((n for n in map(self._size_of, names) if n > 0), -1)
        if size <= 0:
            return [None] * len(keys)
        if register:
            bufs, addresses, new, old = self._scratch_buffers(scratches, size)
        else:
            bufs = [scratch.view(size).obj for scratch in scratches]
            addresses, new, old = [address_of(buf) for buf in bufs], [], []
        sizes = [len(buf) for buf in bufs]

        def run(store: Any, bufs: list[bytearray] = bufs) -> list[int]:
            # holds `bufs`: a read that outlives its deadline still writes into live memory
            for address in old:
                store.unregister_buffer(address)
            for address in new:  # a failed registration is not fatal: TCP reads unregistered memory too
                store.register_buffer(address, sizes[addresses.index(address)])
            if len(names) == 1 and (register or self.protocol == "tcp"):  # the single call, nothing to register
                return _checked([store.get_into(names[0], addresses[0], sizes[0])])
            with self._transient(store, [] if register else addresses, sizes):
                return _checked(store.batch_get_into(names, addresses, sizes))

        try:
            codes = self._call("get", run)
        except Exception:  # noqa: BLE001
            for scratch in scratches:
                scratch.discard()  # a transfer that did not answer in time may still land there
            return [None] * len(keys)
        out: list[Blob | None] = []
        for key, scratch, buf, code in zip(keys, scratches, bufs, codes):
            if code == BUFFER_TOO_SMALL and self._size_of(object_key(key)) > len(buf):
                out.append(self._read([key], [scratch], register)[0])  # the hint is now large enough
            elif code < 0:
                self.counters.add("get.miss" if code == OBJECT_NOT_FOUND else "get.rejected")
                out.append(None)
            else:
                self._size_hint = max(self._size_hint, code)
                out.append(memoryview(buf)[:code])
        return out

    def _size_of(self, name: str) -> int:
        try:
            size = self._call("size", lambda s: _checked(s.get_size(name)))
        except Exception:  # noqa: BLE001
            return -1
        if size > 0:
            self._size_hint = max(self._size_hint, size)
        return size

    def put(self, key: bytes, blob: Blob) -> bool:
        return self.put_many([(key, blob)])[0]

    def put_many(self, items: Sequence[tuple[bytes, Blob]]) -> list[bool]:
        results = [False] * len(items)
        todo: list[tuple[int, str, np.ndarray]] = []
        for i, (key, blob) in enumerate(items):
            data = np.frombuffer(memoryview(blob).cast("B"), dtype=np.uint8)  # counts bytes of any buffer
            if not 0 < data.size <= self.capacity_bytes:
                self.counters.add("put.too_large" if data.size else "put.empty")
                continue
            todo.append((i, object_key(key), data))
        if not todo:
            return results
        names = [name for _, name, _ in todo]
        arrays = [data for _, _, data in todo]  # held by the closure: the blobs outlive a call that timed out
        sizes = [data.size for data in arrays]

        def run(store: Any) -> list[int]:
            addresses = [data.ctypes.data for data in arrays]
            with self._transient(store, addresses, sizes):
                if len(names) == 1:
                    return _checked([store.upsert_from(names[0], addresses[0], sizes[0])])
                return _checked(store.batch_upsert_from(names, addresses, sizes))

        try:
            codes = self._call("put", run)
        except Exception:  # noqa: BLE001 - dropped and counted, never retried
            self.counters.add("put.dropped", len(todo))
            return results
        for (i, _, _), code in zip(todo, codes):
            results[i] = code == 0
            if code != 0:
                self.counters.add("put.rejected")  # the store answered: full, or the object is leased
        return results

    def delete(self, key: bytes) -> bool:
        try:
            return self._call("delete", lambda s: _checked(s.remove(object_key(key), True))) == 0
        except Exception:  # noqa: BLE001
            return False

    def _admin(self, path: str) -> str:
        with urllib.request.urlopen(self.metrics_url + path, timeout=self.timeout_s) as response:  # noqa: S310
            return response.read().decode()

    def keys(self) -> list[bytes]:
        """Keys under the kvf: prefix, from the master's admin server ([] when it cannot be reached)."""
        try:
            names = self._admin("/get_all_keys").split()
        except OSError:
            return []
        out = []
        for name in names:
            if name.startswith(PREFIX):
                try:
                    out.append(bytes.fromhex(name[len(PREFIX):]))
                except ValueError:
                    continue  # a foreign object under our prefix
        return out

    def usage(self) -> TierUsage:
        """Our objects (by key) and the bytes allocated in the whole store (the master's metrics); zeros when
        the master cannot be reached."""
        try:
            match = re.search(r"^master_allocated_bytes (\d+)", self._admin("/metrics"), re.MULTILINE)
        except OSError:
            match = None
        return TierUsage(self.name, len(self.keys()), int(match.group(1)) if match else 0, self.capacity_bytes)

    def pin(self, keys: Iterable[bytes]) -> None:
        """No-op: the master evicts by its own watermark; a chunk evicted between lookup and read is a miss."""

    def unpin(self, keys: Iterable[bytes]) -> None:
        """No-op, see `pin`."""

    def clear(self) -> None:
        """Remove every kvf: object; other objects in the store are left alone."""
        try:
            self._call("clear", lambda s: _checked(s.remove_by_regex(f"^{PREFIX}", True)))
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """Unmount this client's segment (its objects leave the store) and stop the workers. Calls that gave up
        waiting may still be inside the client: closing it under them crashes the process (seen in CI), so close
        first waits for them; if they are still stuck after the close timeout, the client is left open."""
        with self._lock:
            self._closed = True
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
