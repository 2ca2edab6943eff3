"""The worker side of the cluster: what an engine instance adds to take part in the fleet.

`ClusterNode(local_tiers, controller_url, ...)` builds, for one CacheEngine:
- `ObservedTier` wrappers around the served local tiers (default cpu and disk), which mark a tier changed on
  every put / delete / clear, and a `Reporter` thread that registers the instance, sends heartbeats and reports
  the chunks each served tier admits and evicts (both in `worker_reporting`, re-exported here);
- a `PeerServer` serving the served tiers to peers, with control messages from the controller (pin, unpin,
  delete, clear, fetch-from-a-peer for `move`, ping);
- a `PeerTier` (`node.peer`) that reads from the other instances.
`node.tiers` = the local tiers (served ones wrapped) + the peer tier: pass it as `CacheEngine(tiers=...)`, then
`node.bind_engine(engine)` (or let the engine call `PeerTier.bind_engine`) so that token lookups can be keyed
with this engine's namespace. Closing the PeerTier (the stack closes every tier) closes the node.
"""
from __future__ import annotations

import os
import re
import secrets
import socket
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from kvfabric.cluster.client import ControllerClient
from kvfabric.cluster.index import Namespace
from kvfabric.cluster.p2p import PeerClient, PeerError, PeerServer
from kvfabric.cluster.worker_reporting import EVENT_BATCH, ObservedTier, Reporter
from kvfabric.codec.format import ChunkFormatError, parse
from kvfabric.hashing import KEY_BYTES, root_key
from kvfabric.tiers.base import Blob, Tier
from kvfabric.tiers.peer import PeerTier

__all__ = ["EVENT_BATCH", "ClusterNode", "ObservedTier", "Reporter", "default_instance_id", "namespace_of"]


def default_instance_id() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def namespace_of(engine: Any) -> Namespace:
    """The key namespace of a CacheEngine (public attributes only)."""
    config = engine.config
    root = root_key(engine.model_id, engine.layout, engine.chunk_size, config.salt, config.hash)
    return Namespace(model_id=engine.model_id, root=root.hex(), chunk_size=engine.chunk_size, hash=config.hash,
                     partial=bool(config.save_partial_chunk))


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
