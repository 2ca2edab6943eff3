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
- Faults never reach the caller and never hang it: every call to the Mooncake client, its set-up included, is
  made under a deadline (`timeout_s`) and a circuit breaker (kvfabric.net.breaker), as in the Redis tier, by
  `MooncakeClient` (kvfabric.tiers.mooncake_client, whose docstring has the details); a call that fails or gives
  up is a miss / False / [False, ...]. The client is set up lazily, so a master that is down at start costs
  misses, not an error. A read that gave up waiting may still land in its buffer later: that scratch buffer is
  let go (`Scratch.discard`), never handed out again. Failed stores are dropped and counted.
- `keys()` and `usage()` ask the master's admin HTTP server (`metrics_url`: /get_all_keys, /metrics); when it
  cannot be reached they answer [] and zeros.
- Network: the client is named `<local_host>:<free port>`; the transfer engine advertises the address in
  MC_TCP_BIND_ADDRESS, which the tier sets to `local_host` when unset (otherwise Mooncake advertises the machine's
  external interface). Mooncake's own sockets (the transfer engine's ports, the master's metadata server) listen
  on all interfaces whatever is set: see the README's security notes.
- Thread safe: the Mooncake client is; `MooncakeClient`'s own state has a lock. The tier's only state, the size
  hint, needs none: a lost update costs a read again.
"""
from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvfabric.config import MooncakeTierConfig
from kvfabric.host.pages import Scratch
from kvfabric.net.breaker import CircuitBreaker
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob, TierBase, TierUsage
from kvfabric.tiers.mooncake_client import BUFFER_TOO_SMALL, OBJECT_NOT_FOUND, MooncakeClient, address_of

PREFIX = "kvf:"


def object_key(key: bytes) -> str:
    return PREFIX + key.hex()


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
        self.master, self.metadata_url = master, metadata_url
        self.metrics_url = (metrics_url or f"http://{master.rsplit(':', 1)[0]}:9003").rstrip("/")
        self.protocol, self.rdma_devices, self.local_host = protocol, rdma_devices, local_host
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self.capacity_bytes = capacity_bytes
        self.counters = Counters()
        breaker = CircuitBreaker(breaker_failures, backoff_max_s)
        self.client = MooncakeClient(master, metadata_url, protocol=protocol, rdma_devices=rdma_devices,
                                     local_host=local_host, segment_bytes=segment_bytes, buffer_bytes=buffer_bytes,
                                     timeout_s=float(timeout_s), breaker=breaker, counters=self.counters)
        self._size_hint = 0  # the largest object read so far: chunks of one tier are nearly all the same size

    @classmethod
    def from_config(cls, c: MooncakeTierConfig) -> MooncakeTier:
        return cls(c.master, c.metadata_url, metrics_url=c.metrics_url, protocol=c.protocol,
                   rdma_devices=c.rdma_devices, local_host=c.local_host, segment_bytes=c.segment,
                   buffer_bytes=c.buffer, timeout_s=c.timeout_s, capacity_bytes=c.capacity,
                   breaker_failures=c.breaker_failures, backoff_max_s=c.backoff_max_s)

    # The deadline and the breaker live in the client, which reads them at each call: setting them here (as the
    # tests do, and operators may) applies to the next call, as when they were the tier's own attributes.
    @property
    def timeout_s(self) -> float:
        return self.client.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.client.timeout_s = value

    @property
    def breaker(self) -> CircuitBreaker:
        return self.client.breaker

    @breaker.setter
    def breaker(self, value: CircuitBreaker) -> None:
        self.client.breaker = value

    # ---- Tier protocol -----------------------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        names = [object_key(key) for key in keys]
        try:
            return [code == 1 for code in self.client.call("contains", lambda s: s.batch_is_exist(names))]
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
        bufs = [scratch.view(size).obj for scratch in scratches]  # each scratch's whole buffer, >= size bytes
        if register:
            addresses, new, old = self.client.keep_registered(bufs)
        else:
            addresses, new, old = [address_of(buf) for buf in bufs], [], []
        sizes = [len(buf) for buf in bufs]

        def run(store: Any, bufs: list[bytearray] = bufs) -> list[int]:
            # holds `bufs`: a read that outlives its deadline still writes into live memory
            for address in old:
                store.unregister_buffer(address)
            for address in new:  # a failed registration is not fatal: TCP reads unregistered memory too
                store.register_buffer(address, sizes[addresses.index(address)])
            if len(names) == 1 and (register or self.protocol == "tcp"):  # the single call, nothing to register
                return [store.get_into(names[0], addresses[0], sizes[0])]
            with self.client.transient(store, [] if register else addresses, sizes):
                return store.batch_get_into(names, addresses, sizes)

        try:
            codes = self.client.call("get", run)
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
            size = self.client.call("size", lambda s: s.get_size(name))
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
            with self.client.transient(store, addresses, sizes):
                if len(names) == 1:
                    return [store.upsert_from(names[0], addresses[0], sizes[0])]
                return store.batch_upsert_from(names, addresses, sizes)

        try:
            codes = self.client.call("put", run)
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
            return self.client.call("delete", lambda s: s.remove(object_key(key), True)) == 0
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
            self.client.call("clear", lambda s: s.remove_by_regex(f"^{PREFIX}", True))
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """Unmount this client's segment (its objects leave the store) and stop the workers; calls still inside
        the client are waited for first, up to a timeout (kvfabric.tiers.mooncake_client)."""
        self.client.close()
