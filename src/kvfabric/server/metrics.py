"""Prometheus metrics of `kvfabric server`, on an opt-in port (127.0.0.1 only), in a private registry.

Per client (the name it gave in its HELLO): requests by op, bytes moved through the pool (`out` to engines on
retrieve, `in` from engines on store), hit tokens served. Server-wide: decode seconds (into pool slots), fetch
seconds (a tier read, or a stream's whole receive), connected clients, slots referenced. Names start with
`kvfabric_server_`; served by kvfabric.observe.metrics.MetricsEndpoint like every other registry.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfabric.observe.metrics import MetricsEndpoint

TIME_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvfabric_server_requests", "Requests, by client and op", ["client", "op"],
                                registry=r)
        self.bytes = Counter("kvfabric_server_bytes", "KV bytes moved through the pool, by client and direction",
                             ["client", "direction"], registry=r)
        self.hit_tokens = Counter("kvfabric_server_hit_tokens", "Prompt tokens served from the cache, by client",
                                  ["client"], registry=r)
        self.decode_seconds = Histogram("kvfabric_server_decode_seconds", "Decoding one chunk into a pool slot",
                                        buckets=TIME_BUCKETS, registry=r)
        self.fetch_seconds = Histogram("kvfabric_server_fetch_seconds", "Fetching one chunk from a tier, or one "
                                       "stream", ["source"], buckets=TIME_BUCKETS, registry=r)
        self.clients = Gauge("kvfabric_server_clients", "Connected client connections", registry=r)
        self.slots_referenced = Gauge("kvfabric_server_slots_referenced", "Pool slots leased or held", registry=r)
        self._endpoint: MetricsEndpoint | None = None

    def serve(self, port: int) -> int:
        """Expose /metrics on 127.0.0.1:port (0: any free port); returns the port."""
        self._endpoint = MetricsEndpoint(self.registry, "127.0.0.1", port)
        return self._endpoint.port

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
