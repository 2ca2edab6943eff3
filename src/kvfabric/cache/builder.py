"""build_engine: the one place a cache is composed from its configuration.

Contract:
- `build_engine(config, layout, model_id)` returns what an engine process uses as its KV cache (`KVCache`): with
  `mode: server`, a RemoteCache to the host's `kvfabric server` (a parallel engine's rank: of its `share`, as
  in process); else a CacheEngine over the configured tiers,
  composed here with what the config asks for around it (both satisfy `kvfabric.cache.protocol.KVCache`):
  - tier "peer": a cluster node (kvfabric.cluster) that serves the local tiers to peers and reports them to the
    controller under this engine's key namespace; the peer tier is last in the stack;
  - `kv_events.enabled`: the engine's event queue (or the caller's `events`), with `kv_events.endpoint` published
    on ZMQ;
  - `metrics.port`: a /metrics endpoint over the engine's counters and histograms.
  An endpoint that cannot bind (a port taken) is logged and left out: observability never fails the cache.
- `tiers`: the local tiers to use instead of the config's (tests, the server's shared tiers).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from kvfabric.cache.engine import CacheEngine
from kvfabric.cache.protocol import KVCache
from kvfabric.cache.remote.client import RemoteCache
from kvfabric.config import Config
from kvfabric.kv.hashing import KeySpace
from kvfabric.kv.layout import KVLayout
from kvfabric.kv.shares import Share
from kvfabric.observe.events import ChunkEvents, EventPublisher
from kvfabric.observe.metrics import EngineCollector, MetricsEndpoint, engine_registry
from kvfabric.tiers.base import Tier
from kvfabric.tiers.factory import build_tiers

log = logging.getLogger(__name__)


def build_engine(config: Config | None, layout: KVLayout, model_id: str, *, name: str | None = None,
                 tiers: Sequence[Tier] | None = None, events: ChunkEvents | None = None, share: Share | None = None,
                 parallel: tuple[int, int] = (1, 1)) -> KVCache:
    config = config or Config()
    if config.mode == "server":
        return RemoteCache(config, layout, model_id, name=name, share=share, parallel=parallel)
    local = list(tiers) if tiers is not None else build_tiers(config, [t for t in config.tiers if t != "peer"])
    node = None
    if "peer" in config.tiers:
        from kvfabric.cluster.index import Namespace
        from kvfabric.cluster.worker import ClusterNode
        space = KeySpace.of(model_id, layout, config.chunk_size, config.salt, config.hash, config.save_partial_chunk)
        node = ClusterNode(local, config.cluster, [Namespace.of(space)])
        local = node.tiers
    ev = config.kv_events
    if events is None and ev.enabled:
        events = ChunkEvents(config.chunk_size, max_tracked=ev.max_tracked)
    engine = CacheEngine(config, layout, model_id, local, node=node, events=events, share=share, parallel=parallel)
    publisher = endpoint = None
    if events is not None and ev.enabled and ev.endpoint:
        try:
            publisher = EventPublisher(events, engine.holds, ev.endpoint, topic=ev.topic,
                                       replay_endpoint=ev.replay_endpoint, buffer_steps=ev.buffer_steps,
                                       interval_s=ev.interval_s)
        except Exception as exc:  # noqa: BLE001 - e.g. the port is taken: events are optional
            log.warning("kv events: cannot publish on %s: %s", ev.endpoint, exc)
    metrics = config.metrics
    if metrics.port:
        collector = EngineCollector(engine.stats, engine.histograms, model=model_id, codec=config.codec,
                                    chunk_size=config.chunk_size)
        try:
            endpoint = MetricsEndpoint(engine_registry(collector), metrics.host, metrics.port)
        except OSError as exc:
            log.warning("metrics: cannot serve on %s:%d: %s", metrics.host, metrics.port, exc)
    engine.attach_observers(endpoint, publisher)
    return engine
