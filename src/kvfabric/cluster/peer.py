"""Peer tier: chunks held by other kvfabric instances, found through the controller, fetched peer-to-peer.

Put it last in a TierStack (after the local tiers). Then "on a local miss, fetch from a peer and keep a copy
locally" is the stack's read-through with promotion: a chunk served from here is verified (this tier is not
trusted, so the stack checks both checksums and the key) and written into the faster local tiers.

Contract:
- `contains_many(keys)`: one HTTP call to the controller per batch (`lookup` with per-chunk detail, excluding
  this instance and peers that recently failed), bounded by `lookup_timeout_s`; answers are cached for
  `lookup_ttl_s` (misses for `miss_ttl_s`). An unreachable controller is a miss, and a circuit breaker stops
  asking it for a while (backoff), so a dead controller costs nothing per request.
- `get(key)`: the blob from the peer holding it (the one with the longest prefix first), over the P2P protocol
  (kvfabric.cluster.protocol). `prefetch(keys)` (called by the stack before a retrieve) streams all of them in
  one request per peer in the background; `get` then waits at most `fetch_timeout_s` of peer silence for each.
  (Timeouts and cache lifetimes come from the `ClusterConfig` given at construction.)
  A dead, slow or lying peer is a miss, never an exception, and is avoided for `suspect_s`.
- Read-only (`is_read_only`): `put` stores nothing (returns False; the fleet learns of this instance's chunks
  from its own reports); `delete` only forgets where a chunk was; pin/unpin are no-ops; `keys()` is empty.
- It owns its controller client and peer connections (closed by `close`), nothing else: the cluster node that
  made it owns the node's lifetime.
- Thread safe.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvfabric.cluster.client import ControllerClient, ControllerError
from kvfabric.cluster.p2p_client import PeerError, PeerPool
from kvfabric.cluster.protocol import MAX_KEYS
from kvfabric.config import ClusterConfig
from kvfabric.net.breaker import CircuitBreaker
from kvfabric.net.tls import TLSFiles, client_context
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob, TierBase, TierUsage

log = logging.getLogger(__name__)

LOOKUP_BATCH = 4096
SLOT_TTL_S = 60.0
MAX_SLOTS = 8192


@dataclass(frozen=True, slots=True)
class Holder:
    instance_id: str
    host: str
    port: int
    prefix_chunks: int
    tier: str


@dataclass(slots=True)
class _Slot:
    """A prefetched chunk on its way: set once, with the blob or None."""
    holder: Holder
    created: float = field(default_factory=time.monotonic)
    event: threading.Event = field(default_factory=threading.Event)
    blob: memoryview | None = None


class PeerTier(TierBase):
    name = "peer"
    capacity_bytes = 0
    is_trusted = False
    is_read_only = True  # the stack never writes it
    is_persistent = False  # it holds nothing of its own
    is_shared = False
    honors_capacity = False
    honors_pins = False

    def __init__(self, settings: ClusterConfig, instance_id: str | None = None, *, miss_ttl_s: float = 0.5,
                 suspect_s: float = 10.0, max_cached_keys: int = 65536, fetch_threads: int = 4) -> None:
        """`settings`: the controller's URL, the token, and the lookup and fetch timeouts (ClusterConfig)."""
        self.settings = settings
        tls = client_context(TLSFiles.of(settings.tls))
        self.controller = ControllerClient(settings.controller_url, settings.token or None, settings.lookup_timeout_s,
                                           tls)
        self.instance_id = instance_id
        self.miss_ttl_s = miss_ttl_s
        self.suspect_s = suspect_s
        self.max_cached_keys = max_cached_keys
        self.counters = Counters()
        self.breaker = CircuitBreaker(failures=2, backoff_max_s=10.0, backoff_start_s=0.5)
        self._located: OrderedDict[bytes, tuple[float, list[Holder]]] = OrderedDict()
        self._suspects: dict[str, float] = {}
        self._slots: dict[bytes, _Slot] = {}
        self.peers = PeerPool(settings.token or None, connect_timeout_s=settings.connect_timeout_s,
                              io_timeout_s=settings.fetch_timeout_s, tls=tls)
        self._fetched: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=fetch_threads, thread_name_prefix="kvfabric-peer-fetch")
        self._closed = False

    # ---- where chunks are --------------------------------------------------------------------------------------
    def _is_suspect(self, instance_id: str, now: float) -> bool:
        until = self._suspects.get(instance_id)
        return until is not None and until > now

    def suspect(self, holder: Holder) -> None:
        """Avoid this peer for `suspect_s` (it failed a fetch)."""
        with self._lock:
            self._suspects[holder.instance_id] = time.monotonic() + self.suspect_s
            self.counters.add("suspected")

    def _holders(self, key: bytes, now: float) -> list[Holder]:
        entry = self._located.get(key)
        if entry is None:
            return []
        return [h for h in entry[1] if not self._is_suspect(h.instance_id, now)]

    def _locate(self, keys: Sequence[bytes]) -> None:
        if not self.breaker.allow():
            self.counters.add("lookups_skipped")
            return
        now = time.monotonic()
        exclude = [self.instance_id] if self.instance_id else []
        with self._lock:
            exclude += [i for i, until in self._suspects.items() if until > now]
        found: dict[bytes, list[Holder]] = {}
        try:
            for start in range(0, len(keys), LOOKUP_BATCH):
                batch = keys[start:start + LOOKUP_BATCH]
                reply = self.controller.lookup(keys=batch, detail=True, exclude=exclude[:64],
                                               timeout_s=self.settings.lookup_timeout_s)
                for hit in reply.get("instances", []):
                    tiers = hit.get("chunk_tiers") or []
                    for key, held in zip(batch, tiers):
                        if held:
                            found.setdefault(key, []).append(Holder(hit["instance_id"], hit["host"], int(hit["port"]),
                                                                    int(hit.get("prefix_chunks", 0)), held[0]))
        except (ControllerError, KeyError, TypeError, ValueError) as exc:
            self.breaker.failure()
            self.counters.add("lookup_errors")
            log.debug("controller lookup failed: %s", exc)
            return
        self.breaker.success()
        self.counters.add("lookups")
        now = time.monotonic()
        with self._lock:
            for key in keys:
                holders = sorted(found.get(key, []), key=lambda h: (-h.prefix_chunks, h.tier != "cpu", h.instance_id))
                self._located[key] = (now + (self.settings.lookup_ttl_s if holders else self.miss_ttl_s), holders)
                self._located.move_to_end(key)
            while len(self._located) > self.max_cached_keys:
                self._located.popitem(last=False)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if self._closed or not keys:
            return [False] * len(keys)
        now = time.monotonic()
        stale = [k for k in dict.fromkeys(keys) if (e := self._located.get(k)) is None or e[0] < now]
        if stale:
            self._locate(stale)
            now = time.monotonic()
        with self._lock:
            return [bool(self._holders(k, now)) for k in keys]

    # ---- fetching ----------------------------------------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Start streaming these chunks from their peers (one request per peer); `get` picks them up."""
        if self._closed:
            return
        now = time.monotonic()
        groups: dict[Holder, list[tuple[bytes, _Slot]]] = {}
        with self._lock:
            for key, slot in list(self._slots.items()):  # drop what nobody came for
                if now - slot.created > SLOT_TTL_S:
                    del self._slots[key]
            for key in keys:
                if key in self._slots or len(self._slots) >= MAX_SLOTS:
                    continue
                holders = self._holders(key, now)
                if not holders:
                    continue
                # keep one peer per retrieve when possible: the first holder of the first key wins ties
                group = next((h for h in groups if h in holders), holders[0])
                slot = self._slots[key] = _Slot(group)
                groups.setdefault(group, []).append((key, slot))
        for holder, items in groups.items():
            for start in range(0, len(items), MAX_KEYS):
                self._pool.submit(self._stream, holder, dict(items[start:start + MAX_KEYS]))

    def _stream(self, holder: Holder, slots: dict[bytes, _Slot]) -> None:
        try:
            for key, blob in self.peers.client(holder.host, holder.port).fetch(list(slots)):
                self._arrived(key, blob, holder)
                slot = slots[key]
                slot.blob = blob
                slot.event.set()
        except PeerError as exc:
            log.info("prefetch from %s failed: %s", holder.instance_id, exc)
            self.counters.add("fetch_errors")
            self.suspect(holder)
        except Exception:  # never leave a waiter hanging
            log.exception("prefetch from %s failed", holder.instance_id)
            self.counters.add("fetch_errors")
        finally:
            for slot in slots.values():
                slot.event.set()

    def _arrived(self, key: bytes, blob: memoryview | None, holder: Holder) -> None:
        with self._lock:
            if blob is None:
                self.counters.add("peer_missing")
                entry = self._located.get(key)
                if entry is not None:  # that peer no longer has it
                    self._located[key] = (entry[0], [h for h in entry[1] if h.instance_id != holder.instance_id])
                return
            self.counters.add("chunks_fetched")
            self.counters.add("bytes_fetched", len(blob))
            self._fetched[key] = time.monotonic()
            self._fetched.move_to_end(key)
            while len(self._fetched) > MAX_SLOTS:
                self._fetched.popitem(last=False)

    def get(self, key: bytes) -> Blob | None:
        if self._closed:
            return None
        with self._lock:
            slot = self._slots.pop(key, None)
        tried: set[str] = set()
        if slot is not None:
            if slot.event.wait(self.settings.fetch_timeout_s + self.settings.connect_timeout_s) and slot.blob is not None:
                self.counters.add("hits")
                return slot.blob
            tried.add(slot.holder.instance_id)
        now = time.monotonic()
        with self._lock:
            holders = self._holders(key, now)
        if not holders and key not in self._located:
            self._locate([key])
            with self._lock:
                holders = self._holders(key, time.monotonic())
        for holder in [h for h in holders if h.instance_id not in tried][:2]:
            try:
                client = self.peers.client(holder.host, holder.port)
                blob = client.fetch_all([key], timeout_s=self.settings.fetch_timeout_s)[key]
            except PeerError as exc:
                log.info("fetch from %s failed: %s", holder.instance_id, exc)
                self.counters.add("fetch_errors")
                self.suspect(holder)
                continue
            self._arrived(key, blob, holder)
            if blob is not None:
                self.counters.add("hits")
                return blob
        self.counters.add("misses")
        return None

    def was_fetched(self, key: bytes, within_s: float = 30.0) -> bool:
        """True if `key` arrived from a peer in the last `within_s` seconds (used to not keep copies)."""
        at = self._fetched.get(key)
        return at is not None and time.monotonic() - at < within_s

    # ---- the rest of the Tier protocol --------------------------------------------------------------------------
    def put(self, key: bytes, blob: Blob) -> bool:
        return False  # read-only: peers learn of local chunks from this instance's reports

    def delete(self, key: bytes) -> bool:
        with self._lock:
            self._located.pop(key, None)
            self._slots.pop(key, None)
        return False

    def keys(self) -> list[bytes]:
        return []

    def usage(self) -> TierUsage:
        return TierUsage(self.name, 0, 0, 0)

    def pin(self, keys: Iterable[bytes]) -> None:
        pass

    def unpin(self, keys: Iterable[bytes]) -> None:
        pass

    def clear(self) -> None:
        with self._lock:
            self._located.clear()
            self._slots.clear()
            self._suspects.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for slot in self._slots.values():
                slot.event.set()
            self._slots.clear()
        self.peers.close()
        self.controller.close()
