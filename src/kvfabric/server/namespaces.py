"""Key namespaces the server serves: one CacheEngine per (model, layout, chunk size, hash, tenant salt), all over
the server's one set of tiers.

Contract:
- The tiers are built once from the server's config (`build_tiers`; with tier "peer", a ClusterNode over them
  serves peers and adds the peer tier). Every namespace's CacheEngine uses those same tier objects, so one chunk
  cache serves every engine on the host; keys never collide across namespaces (the root key names all of it).
- `get(hello)` returns the namespace a client's HELLO names, made on first use (at most MAX_NAMESPACES);
  a malformed or unsupported HELLO raises ProtocolError. The engine codec is the server's (`codec`, per tier).
- `close()` flushes every namespace, stops the cluster node, then closes the engines (and so the shared tiers).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from kvfabric.cache.engine import CacheEngine
from kvfabric.cache.remote import wire as P
from kvfabric.codec.base import Decoders
from kvfabric.config import Config, ConfigError
from kvfabric.kv.hashing import HASH_NAMES
from kvfabric.kv.layout import DTYPES, KVLayout
from kvfabric.net.framing import ProtocolError
from kvfabric.tiers.base import Tier
from kvfabric.tiers.factory import build_tiers

MAX_NAMESPACES = 16


@dataclass(frozen=True, slots=True)
class NamespaceId:
    model_id: str
    layout: KVLayout
    chunk_size: int
    hash: str
    salt: str


class Namespace:
    def __init__(self, ident: NamespaceId, engine: CacheEngine) -> None:
        self.ident = ident
        self.layout = ident.layout
        self.engine = engine
        self.decoders = Decoders()  # the server's decode path (into pool slots); the engine keeps its own


def parse_hello(body: dict[str, Any]) -> NamespaceId:
    layout = body.get("layout")
    if not (isinstance(layout, list) and len(layout) in (4, 5) and all(type(v) is int and 0 < v <= 1 << 16
                                                                        for v in layout[:3])
            and layout[3] in DTYPES and layout[4:] in ([], ["latent"])):
        raise ProtocolError('layout: expected [num_layers, num_kv_heads, head_dim, dtype] (and "latent" for MLA)')
    try:
        kv_layout = KVLayout(*layout[:4], is_latent=len(layout) == 5)
    except ValueError as exc:  # a latent layout with several head slots
        raise ProtocolError(f"layout: {exc}") from None
    hash_name = P.text_of(body, "hash", "sha256")
    if hash_name not in HASH_NAMES:
        raise ProtocolError(f"hash: one of {HASH_NAMES}")
    return NamespaceId(P.text_of(body, "model_id"), kv_layout, P.int_of(body, "chunk_size", upper=1 << 16),
                       hash_name, P.text_of(body, "salt", ""))


class Namespaces:
    def __init__(self, config: Config) -> None:
        self.config = config
        local = build_tiers(config, [name for name in config.tiers if name != "peer"])
        self.node = None
        if "peer" in config.tiers:
            from kvfabric.cluster.worker import ClusterNode
            self.node = ClusterNode(local, config.cluster, [])
        self.tiers: list[Tier] = self.node.tiers if self.node is not None else local
        self._by_id: dict[NamespaceId, Namespace] = {}
        self._lock = threading.Lock()

    def get(self, body: dict[str, Any]) -> Namespace:
        ident = parse_hello(body)
        with self._lock:
            found = self._by_id.get(ident)
            if found is not None:
                return found
            if len(self._by_id) >= MAX_NAMESPACES:
                raise ProtocolError(f"this server already serves {MAX_NAMESPACES} namespaces")
            if ident.chunk_size <= 0:
                raise ProtocolError("chunk_size must be positive")
            try:
                config = self.config.merged({"chunk_size": ident.chunk_size, "hash": ident.hash, "salt": ident.salt})
            except ConfigError as exc:
                raise ProtocolError(str(exc)) from None
            engine = CacheEngine(config, ident.layout, ident.model_id, tiers=self.tiers)
            if self.node is not None:
                from kvfabric.cluster.index import Namespace as Reported
                self.node.namespaces.append(Reported.of(engine.key_space))
                self.node.reporter.mark_all()
            found = self._by_id[ident] = Namespace(ident, engine)
            return found

    def all(self) -> list[Namespace]:
        with self._lock:
            return list(self._by_id.values())

    def close(self) -> None:
        spaces = self.all()
        for space in spaces:
            space.engine.flush()
        if self.node is not None:
            self.node.close()  # stop serving peers before the tiers close
        for space in spaces:
            space.engine.close()  # each closes the shared tiers; closing a closed tier is a no-op
        if not spaces:
            for tier in self.tiers:
                tier.close()
