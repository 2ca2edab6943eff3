"""The worker side of the cluster: what an engine instance adds to take part in the fleet.

`ClusterNode(local_tiers, controller_url, ...)` builds, for one CacheEngine:
- `ObservedTier` wrappers around the served local tiers (default cpu and disk): the Tier protocol unchanged,
  plus a "this tier changed" mark on every put / delete / clear. No core change: the wrapper forwards
  everything else (get_into, prefetch, ...) to the tier it wraps.
- a `Reporter` thread: registers the instance, sends heartbeats with tier usage, and every `report_interval_s`
  diffs each changed tier's key set against what the controller was told and sends the admits / evicts in
  batches. Diffing key sets also catches LRU evictions inside a tier (which no put/delete hook sees), chunks
  another process wrote into a shared disk directory (a full reconcile every `reconcile_interval_s`), and
  recovers from anything lost: if the controller forgets the instance (restart with an in-memory index, missed
  heartbeats) the reporter registers again and re-sends everything.
- a `PeerServer` serving the served tiers to peers, with control messages from the controller (pin, unpin,
  delete, clear, fetch-from-a-peer for `move`, ping);
- a `PeerTier` (`node.peer`) that reads from the other instances.
`node.tiers` = the local tiers (served ones wrapped) + the peer tier: pass it as `CacheEngine(tiers=...)`, then
`node.bind_engine(engine)` (or let the engine call `PeerTier.bind_engine`) so that token lookups can be keyed
with this engine's namespace. Closing the PeerTier (the stack closes every tier) closes the node.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvfabric.cluster.client import ControllerClient, ControllerError
from kvfabric.cluster.index import Namespace
from kvfabric.cluster.p2p import PeerClient, PeerError, PeerServer
from kvfabric.codec.format import ChunkFormatError, parse
from kvfabric.hashing import KEY_BYTES, root_key
from kvfabric.tiers.base import Blob, Tier, TierUsage
from kvfabric.tiers.peer import PeerTier

log = logging.getLogger(__name__)

EVENT_BATCH = 4096  # keys per events request (the controller accepts up to 16384 per tier)


def default_instance_id() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def namespace_of(engine: Any) -> Namespace:
    """The key namespace of a CacheEngine (public attributes only)."""
    config = engine.config
    root = root_key(engine.model_id, engine.layout, engine.chunk_size, config.salt, config.hash)
    return Namespace(model_id=engine.model_id, root=root.hex(), chunk_size=engine.chunk_size, hash=config.hash,
                     partial=bool(config.save_partial_chunk))


class ObservedTier:
    """A tier that tells `on_change(name)` when its contents may have changed. With `refuse`, puts of the keys
    it names are declined (used to not keep copies of chunks fetched from peers)."""

    def __init__(self, inner: Tier, on_change: Callable[[str], None],
                 refuse: Callable[[bytes], bool] | None = None) -> None:
        self.inner = inner
        self._on_change = on_change
        self.refuse = refuse
        self.name = inner.name
        self.is_trusted = inner.is_trusted
        self.capacity_bytes = inner.capacity_bytes

    def __getattr__(self, attr: str) -> Any:  # optional methods (get_into, prefetch, path, counters, ...)
        return getattr(self.inner, attr)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.contains_many(keys)

    def get(self, key: bytes) -> Blob | None:
        return self.inner.get(key)

    def put(self, key: bytes, blob: Blob) -> bool:
        if self.refuse is not None and self.refuse(key):
            return False
        ok = self.inner.put(key, blob)
        self._on_change(self.name)
        return ok

    def delete(self, key: bytes) -> bool:
        ok = self.inner.delete(key)
        if ok:
            self._on_change(self.name)
        return ok

    def keys(self) -> list[bytes]:
        return self.inner.keys()

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def pin(self, keys: Iterable[bytes]) -> None:
        self.inner.pin(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        self.inner.unpin(keys)

    def clear(self) -> None:
        self.inner.clear()
        self._on_change(self.name)

    def close(self) -> None:
        self.inner.close()


class Reporter:
    """Background thread keeping the controller's view of this instance's served tiers up to date."""

    def __init__(self, client: ControllerClient, instance_id: str, info: Callable[[], dict],
                 tiers: Mapping[str, Tier], *, interval_s: float = 0.25, heartbeat_interval_s: float = 2.0,
                 reconcile_interval_s: float = 10.0) -> None:
        self.client = client
        self.instance_id = instance_id
        self.info = info
        self.tiers = dict(tiers)
        self.interval_s = interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.reconcile_interval_s = reconcile_interval_s
        self.registered = False
        self.counters: dict[str, int] = {"registers": 0, "heartbeats": 0, "admits": 0, "evicts": 0, "errors": 0}
        self._reported: dict[str, set[bytes]] = {name: set() for name in self.tiers}
        self._dirty: set[str] = set(self.tiers)
        self._update_info = False
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ticks_started = 0
        self._ticks_done = 0
        self._last_heartbeat = 0.0
        self._last_reconcile = 0.0
        self._thread = threading.Thread(target=self._loop, name="kvfabric-reporter", daemon=True)

    def start(self) -> Reporter:
        self._thread.start()
        return self

    def mark(self, tier_name: str) -> None:
        with self._lock:
            self._dirty.add(tier_name)

    def mark_all(self) -> None:
        with self._lock:
            self._dirty.update(self.tiers)

    def update_info(self) -> None:
        """Send the registration again (keeping entries): e.g. a namespace was added."""
        with self._lock:
            self._update_info = True
        self._wake.set()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Run a report now and wait for it; True if the controller is up to date with this instance."""
        with self._cond:
            target = self._ticks_started + 1
            self._wake.set()
            done = self._cond.wait_for(lambda: self._ticks_done >= target or self._stop.is_set(), timeout_s)
            return done and self.registered and not self._dirty

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                self._ticks_started += 1
                tick = self._ticks_started
            try:
                self._tick()
            except Exception:
                log.exception("cluster report failed")
                self.counters["errors"] += 1
            with self._cond:
                self._ticks_done = tick
                self._cond.notify_all()
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def _tick(self) -> None:
        now = time.monotonic()
        try:
            with self._lock:
                soft, self._update_info = self._update_info, False
            if not self.registered or soft:
                body = self.info()
                body["reset"] = not self.registered
                self.client.register(body)
                self.counters["registers"] += 1
                if not self.registered:
                    self._reported = {name: set() for name in self.tiers}
                    self.mark_all()
                self.registered = True
                self._last_heartbeat = now
            if now - self._last_reconcile >= self.reconcile_interval_s:
                self._last_reconcile = now
                self.mark_all()
            with self._lock:
                dirty, self._dirty = self._dirty, set()
            try:
                for name in sorted(dirty):
                    self._sync(name)
            except BaseException:
                with self._lock:
                    self._dirty |= dirty  # try again next tick
                raise
            if dirty or now - self._last_heartbeat >= self.heartbeat_interval_s:  # usage changed, or due
                reply = self.client.heartbeat(self.instance_id, self.info()["tiers"])
                self.counters["heartbeats"] += 1
                self._last_heartbeat = now
                if not reply.get("known", False):
                    self.registered = False  # the controller forgot us: register and re-send everything
                    self._wake.set()
        except ControllerError as exc:
            self.counters["errors"] += 1
            log.debug("controller unreachable: %s", exc)
            if exc.status == 404:
                self.registered = False

    def _sync(self, name: str) -> None:
        tier = self.tiers[name]
        current = set(tier.keys())
        reported = self._reported[name]
        admit, evict = list(current - reported), list(reported - current)
        for start in range(0, max(len(admit), len(evict)), EVENT_BATCH):
            a, e = admit[start:start + EVENT_BATCH], evict[start:start + EVENT_BATCH]
            reply = self.client.events(self.instance_id, {name: [k.hex() for k in a]} if a else {},
                                       {name: [k.hex() for k in e]} if e else {})
            if not reply.get("known", False):
                self.registered = False
                self._wake.set()
                raise ControllerError("the controller does not know this instance")
            reported.update(a)
            reported.difference_update(e)
            self.counters["admits"] += len(a)
            self.counters["evicts"] += len(e)

    def close(self, unregister: bool = True) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._cond:
            self._cond.notify_all()
        if unregister and self.registered:
            try:
                self.client.unregister(self.instance_id, timeout_s=1.0)
            except ControllerError:
                pass
        self.client.close()


class ClusterNode:
    def __init__(self, local_tiers: Sequence[Tier], controller_url: str, *, token: str | None = None,
                 instance_id: str | None = None, p2p_host: str = "127.0.0.1", p2p_port: int = 0,
                 advertise_host: str | None = None, serve_tiers: Sequence[str] = ("cpu", "disk"),
                 keep_fetched: bool = True, report_interval_s: float = 0.25, heartbeat_interval_s: float = 2.0,
                 reconcile_interval_s: float = 10.0, lookup_timeout_s: float = 0.5, lookup_ttl_s: float = 2.0,
                 connect_timeout_s: float = 0.5, fetch_timeout_s: float = 5.0, start: bool = True) -> None:
        self.instance_id = instance_id or default_instance_id()
        self.token = token or None
        self.keep_fetched = keep_fetched
        self.connect_timeout_s = connect_timeout_s
        self.fetch_timeout_s = fetch_timeout_s
        self.namespaces: list[Namespace] = []
        self._closed = False
        self._clients: dict[tuple[str, int], PeerClient] = {}
        self._lock = threading.Lock()
        refuse = None if keep_fetched else self._refuse
        self.local: list[Tier] = [ObservedTier(t, self._changed, refuse) if t.name in serve_tiers else t
                                  for t in local_tiers]
        self.served: dict[str, ObservedTier] = {t.name: t for t in self.local if isinstance(t, ObservedTier)}
        self.server = PeerServer(list(self.served.values()), token=self.token, host=p2p_host, port=p2p_port,
                                 control=self.control, on_missing=self._missing)
        self.advertise_host = advertise_host or _advertised(p2p_host)
        self.peer = PeerTier(ControllerClient(controller_url, self.token, lookup_timeout_s),
                             instance_id=self.instance_id, token=self.token, lookup_timeout_s=lookup_timeout_s,
                             lookup_ttl_s=lookup_ttl_s, connect_timeout_s=connect_timeout_s,
                             fetch_timeout_s=fetch_timeout_s, on_close=self.close, on_bind=self.bind_engine)
        self.reporter = Reporter(ControllerClient(controller_url, self.token, max(2.0, lookup_timeout_s)),
                                 self.instance_id, self.info, self.served, interval_s=report_interval_s,
                                 heartbeat_interval_s=heartbeat_interval_s, reconcile_interval_s=reconcile_interval_s)
        self.tiers: list[Tier] = [*self.local, self.peer]
        if start:
            self.start()

    @classmethod
    def from_config(cls, cluster: Any, local_tiers: Sequence[Tier]) -> ClusterNode:
        """From a `cluster` config section (attributes named like this constructor's keywords)."""
        names = ("token", "instance_id", "p2p_host", "p2p_port", "advertise_host", "serve_tiers", "keep_fetched",
                 "report_interval_s", "heartbeat_interval_s", "reconcile_interval_s", "lookup_timeout_s",
                 "lookup_ttl_s", "connect_timeout_s", "fetch_timeout_s")
        kwargs = {n: getattr(cluster, n) for n in names if getattr(cluster, n, None) not in (None, "")}
        return cls(local_tiers, cluster.controller_url, **kwargs)

    def start(self) -> ClusterNode:
        self.server.start()
        self.reporter.start()
        return self

    @property
    def address(self) -> tuple[str, int]:
        return self.advertise_host, self.server.port

    def info(self) -> dict:
        tiers = []
        for tier in self.served.values():
            usage = tier.usage()
            tiers.append({"name": tier.name, "capacity_bytes": int(usage.capacity_bytes),
                          "num_chunks": int(usage.num_chunks), "num_bytes": int(usage.num_bytes)})
        return {"instance_id": self.instance_id, "host": self.advertise_host, "port": self.server.port,
                "tiers": tiers, "namespaces": [
                    {"model_id": n.model_id, "root": n.root, "chunk_size": n.chunk_size, "hash": n.hash,
                     "partial": n.partial} for n in self.namespaces]}

    def bind_engine(self, engine: Any) -> None:
        self.add_namespace(namespace_of(engine))

    def add_namespace(self, namespace: Namespace) -> None:
        if namespace not in self.namespaces:
            self.namespaces.append(namespace)
            self.reporter.update_info()

    def flush_reports(self, timeout_s: float = 10.0) -> bool:
        """Report now (blocking); True once the controller knows everything the served tiers hold."""
        return self.reporter.flush(timeout_s)

    def _changed(self, tier_name: str) -> None:
        self.reporter.mark(tier_name)

    def _refuse(self, key: bytes) -> bool:
        return self.peer.was_fetched(key)

    def _missing(self, key: bytes) -> None:
        self.reporter.mark_all()  # a peer asked for a chunk the controller thinks we hold: re-diff

    # ---- control messages from the controller ------------------------------------------------------------------
    def control(self, message: dict) -> dict:
        op = message.get("op")
        if op == "ping":
            return {"ok": True, "instance_id": self.instance_id}
        try:
            keys = _keys(message.get("keys", []))
            tiers = self._select(message.get("tier"))
        except ValueError as exc:
            return {"ok": False, "error": str(exc), "code": 400}
        if op in ("pin", "unpin"):
            for tier in tiers:
                (tier.pin if op == "pin" else tier.unpin)(keys)
            return {"ok": True, "chunks": len(keys)}
        if op == "delete":
            return {"ok": True, "chunks": sum(any([t.delete(k) for t in tiers]) for k in keys)}
        if op == "clear":
            num = 0
            for tier in tiers:
                num += tier.usage().num_chunks
                tier.clear()
            return {"ok": True, "chunks": num}
        if op == "fetch":
            if len(tiers) != 1 or not message.get("tier"):
                return {"ok": False, "error": "fetch needs one destination tier", "code": 400}
            return self._fetch(keys, tiers[0], message.get("source") or {}, str(message.get("source_tier") or ""))
        return {"ok": False, "error": f"unknown op {op!r}", "code": 400}

    def _select(self, tier: Any) -> list[ObservedTier]:
        if tier is None or tier == "":
            return list(self.served.values())
        if not isinstance(tier, str) or tier not in self.served:
            raise ValueError(f"no served tier {tier!r} on {self.instance_id}")
        return [self.served[tier]]

    def _fetch(self, keys: list[bytes], dst: ObservedTier, source: dict, source_tier: str) -> dict:
        """Copy chunks into `dst` from a peer (or from another local tier when the source is this instance)."""
        stored, num_bytes, missing = [], 0, 0
        if source.get("instance_id") == self.instance_id:
            tiers = [t for t in self.served.values() if t is not dst and (not source_tier or t.name == source_tier)]
            found: Iterable[tuple[bytes, Blob | None]] = ((k, self.server._read(tiers, k)) for k in keys)
        else:
            try:
                client = self._client(str(source["host"]), int(source["port"]))
            except (KeyError, TypeError, ValueError):
                return {"ok": False, "error": "fetch needs source host and port", "code": 400}
            found = client.fetch(keys, source_tier)
        try:
            for key, blob in found:
                if blob is None:
                    missing += 1
                    continue
                try:
                    parse(blob, key)  # never store a damaged chunk
                except ChunkFormatError:
                    missing += 1
                    continue
                if dst.put(key, blob):
                    stored.append(key.hex())
                    num_bytes += len(blob)
        except PeerError as exc:
            return {"ok": False, "error": str(exc), "code": 502, "stored": stored, "bytes": num_bytes}
        return {"ok": True, "stored": stored, "chunks": len(stored), "bytes": num_bytes, "missing": missing}

    def _client(self, host: str, port: int) -> PeerClient:
        with self._lock:
            client = self._clients.get((host, port))
            if client is None:
                client = PeerClient(host, port, self.token, connect_timeout_s=self.connect_timeout_s,
                                    io_timeout_s=max(self.fetch_timeout_s, 10.0))
                self._clients[(host, port)] = client
            return client

    def close(self) -> None:
        """Stop serving and reporting, and tell the controller this instance is gone. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        self.reporter.close(unregister=True)
        self.server.close()
        for client in clients:
            client.close()
        self.peer.close()


def _keys(raw: Any) -> list[bytes]:
    if not isinstance(raw, list) or len(raw) > 65536:
        raise ValueError("keys must be a list of hex chunk keys")
    keys = []
    for item in raw:
        if not isinstance(item, str) or len(item) != KEY_BYTES * 2:
            raise ValueError("keys must be 64-character hex strings")
        keys.append(bytes.fromhex(item))
    return keys


def _advertised(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        raise ValueError("p2p_host binds every interface: set advertise_host to the address peers should use")
    try:
        import ipaddress
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return socket.gethostbyname(host)
