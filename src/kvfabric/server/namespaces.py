"""Key namespaces the server serves: one CacheEngine per (model, layout, chunk size, hash, tenant salt, rank share),
all over the server's one set of tiers.

Contract:
- The tiers are built once from the server's config (`build_tiers`; with tier "peer", a ClusterNode over them
  serves peers and adds the peer tier). Every namespace's CacheEngine uses those same tier objects, so one chunk
  cache serves every engine on the host; keys never collide across namespaces (the root key names all of it).
- `get(hello)` returns the namespace a client's HELLO names, made on first use (at most MAX_NAMESPACES);
  a malformed or unsupported HELLO raises ProtocolError. The engine codec is the server's (`codec`, per tier).
- A parallel engine's rank names its share (`share`: [first layer, last layer, first head, last head, is_writer],
  ranges half-open, of the model's `layout`) and its engine's `parallel` shape ([pp_size, tp_size]): its namespace
  is a CacheEngine of that share (kvfabric.kv.shares), whose tensors (`Namespace.layout`, the pool slots' shape)
  hold the share's layers and heads; keys stay the model's, so every rank of an engine, and every other parallel
  shape of the model, reads what the others stored. In the pool, a share's slot is named by the share's own key
  (`slot_key`), never by the chunk's: a slot holds what its name says to every namespace.
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
from kvfabric.kv.shares import Share
from kvfabric.net.framing import ProtocolError
from kvfabric.tiers.base import Tier
from kvfabric.tiers.factory import build_tiers

MAX_NAMESPACES = 64  # e.g. four models at TP=8 with two tenants each


@dataclass(frozen=True, slots=True)
class NamespaceId:
    model_id: str
    layout: KVLayout
    chunk_size: int
    hash: str
    salt: str
    share: Share | None = None  # a parallel engine rank's (None: the whole model)
    parallel: tuple[int, int] = (1, 1)  # its engine's (pp_size, tp_size)


class Namespace:
    def __init__(self, ident: NamespaceId, engine: CacheEngine) -> None:
        self.ident = ident
        self.layout = engine.layout  # what the namespace's tensors hold: the model's KV, or the rank's share of it
        self.engine = engine
        # a rank share's slots are named by its part's key: the chunk's key names the whole chunk, in the pool too
        self._part = engine.shape.parts[0] if ident.share is not None and not ident.share.is_whole(ident.layout) \
            else None
        self.decoders = Decoders()  # the server's decode path (into pool slots); the engine keeps its own

    def slot_key(self, key: bytes) -> bytes:
        """What names chunk `key` of this namespace in the server's pool (shared by every namespace)."""
        return key if self._part is None else self._part.key(key)


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
    share, parallel = _share_of(body, kv_layout)
    return NamespaceId(P.text_of(body, "model_id"), kv_layout, P.int_of(body, "chunk_size", upper=1 << 16),
                       hash_name, P.text_of(body, "salt", ""), share, parallel)


def _share_of(body: dict[str, Any], layout: KVLayout) -> tuple[Share | None, tuple[int, int]]:
    """A HELLO's rank share and parallel shape, checked against the model's layout (absent: the whole model)."""
    share, parallel = body.get("share"), body.get("parallel", [1, 1])
    if not (isinstance(parallel, list) and len(parallel) == 2 and all(type(v) is int and 0 < v <= 1024
                                                                         for v in parallel)):
        raise ProtocolError("parallel: expected [pp_size, tp_size]")
    if share is None:
        return None, (parallel[0], parallel[1])
    if not (isinstance(share, list) and len(share) == 5 and all(type(v) is int for v in share[:4])
            and type(share[4]) is bool and 0 <= share[0] < share[1] <= layout.num_layers
            and 0 <= share[2] < share[3] <= layout.num_kv_heads):
        raise ProtocolError("share: expected [first layer, last layer, first head, last head, is_writer] within "
                            "the layout")
    return Share((share[0], share[1]), (share[2], share[3]), share[4]), (parallel[0], parallel[1])


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
            try:
                engine = CacheEngine(config, ident.layout, ident.model_id, tiers=self.tiers, share=ident.share,
                                     parallel=ident.parallel)
            except ValueError as exc:  # e.g. a share of a model with window layers
                raise ProtocolError(str(exc)) from None
            if self.node is not None:
                from kvfabric.cluster.index import Namespace as Reported
                reported = Reported.of(engine.key_space)
                if reported not in self.node.namespaces:  # the ranks' shares of one model share its key space
                    self.node.namespaces.append(reported)
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
