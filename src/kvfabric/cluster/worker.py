"""The worker side of the cluster: what an engine instance adds to take part in the fleet.

`ClusterNode(local_tiers, settings, namespaces)` builds, for one CacheEngine (settings: a `ClusterConfig`):
- `ObservedTier` wrappers around the served local tiers (`serve_tiers`), which mark a tier changed on every put /
  delete / clear, and a `Reporter` thread that registers the instance with its key namespaces, sends heartbeats
  and reports the chunks each served tier admits and evicts (both in `worker_reporting`);
- a `PeerServer` serving the served tiers to peers, with control messages from the controller (pin, unpin,
  delete, clear, fetch-from-a-peer for `move`, ping);
- a `PeerTier` (`node.peer`) that reads from the other instances.
`node.tiers` = the local tiers (served ones wrapped) + the peer tier: the stack of the engine that made the node.
The node owns what it made (reporter, server, peer tier, peer connections) and `close()` ends them all; the local
tiers belong to the caller (the engine's stack closes them). The engine closes the node it created.
"""
from __future__ import annotations

import ipaddress
import os
import re
import secrets
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import Any

from kvfabric.cluster.client import ControllerClient
from kvfabric.cluster.index import Namespace
from kvfabric.cluster.p2p_client import PeerError, PeerPool
from kvfabric.cluster.p2p_server import PeerServer
from kvfabric.cluster.peer import PeerTier
from kvfabric.cluster.worker_reporting import ObservedTier, Reporter
from kvfabric.codec.format import ChunkFormatError, parse
from kvfabric.config import ClusterConfig
from kvfabric.kv.hashing import KEY_BYTES
from kvfabric.net.tls import TLSFiles, client_context, server_context
from kvfabric.tiers.base import Blob, Tier


def default_instance_id() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class ClusterNode:
    def __init__(self, local_tiers: Sequence[Tier], settings: ClusterConfig,
                 namespaces: Sequence[Namespace] = ()) -> None:
        if not settings.controller_url:
            raise ValueError("a cluster node needs the controller's URL (cluster.controller_url)")
        self.settings = settings
        self.instance_id = settings.instance_id or default_instance_id()
        self.token = settings.token or None
        self.namespaces = list(dict.fromkeys(namespaces))
        self.stats_source: Callable[[], dict[str, int]] | None = None  # set by the engine: heartbeat counts
        self._closed = False
        refuse = None if settings.keep_fetched else self._refuse
        self.local: list[Tier] = [ObservedTier(t, self._changed, refuse) if t.name in settings.serve_tiers else t
                                  for t in local_tiers]
        self.served: dict[str, ObservedTier] = {t.name: t for t in self.local if isinstance(t, ObservedTier)}
        tls = TLSFiles.of(settings.tls)
        self.server = PeerServer(list(self.served.values()), token=self.token, host=settings.p2p_host,
                                 port=settings.p2p_port, control=self.control, on_missing=self._missing,
                                 tls=server_context(tls), insecure=settings.insecure)
        self.advertise_host = settings.advertise_host or _advertised(settings.p2p_host)
        self.peers = PeerPool(self.token, connect_timeout_s=settings.connect_timeout_s,
                              io_timeout_s=max(settings.fetch_timeout_s, 10.0), tls=client_context(tls))
        self.peer = PeerTier(settings, self.instance_id)
        self.reporter = Reporter(ControllerClient(settings.controller_url, self.token,
                                                  max(2.0, settings.lookup_timeout_s), client_context(tls)),
                                 self.instance_id, self.info, self.served, interval_s=settings.report_interval_s,
                                 heartbeat_interval_s=settings.heartbeat_interval_s,
                                 reconcile_interval_s=settings.reconcile_interval_s, stats=self._stats)
        self.tiers: list[Tier] = [*self.local, self.peer]
        self.server.start()
        self.reporter.start()

    def info(self) -> dict:
        tiers = [asdict(tier.usage()) for tier in self.served.values()]  # name, num_chunks, num_bytes, capacity_bytes
        return {"instance_id": self.instance_id, "host": self.advertise_host, "port": self.server.port,
                "tiers": tiers, "namespaces": [asdict(n) for n in self.namespaces]}

    def _stats(self) -> dict[str, int]:
        return self.stats_source() if self.stats_source is not None else {}

    def p2p_counters(self) -> dict[str, int]:
        """The P2P server's counters (requests, bytes sent, errors)."""
        return self.server.counters.snapshot()

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
                client = self.peers.client(str(source["host"]), int(source["port"]))
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

    def close(self) -> None:
        """Stop serving and reporting, tell the controller this instance is gone, and close the peer tier and
        connections. Idempotent. The local tiers stay open (they belong to the caller)."""
        if self._closed:
            return
        self._closed = True
        self.reporter.close(unregister=True)
        self.server.close()
        self.peers.close()
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
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return socket.gethostbyname(host)
