"""One Prometheus naming scheme for every kvfabric process: latency histograms, the scrape-time collector of an
engine's snapshots, and the opt-in HTTP endpoint.

Contract:
- Names are `kvfabric_<what>_<unit>` with the unit spelled out (`_seconds`, `_bytes`, `_tokens`, `_chunks`);
  counters end in `_total`; latencies are histograms over `LATENCY_BUCKETS_S`. `METRICS` is the one table of
  every name, type, help text and label set, shared by the collector below and the vLLM connector's metrics
  (which go through vLLM's own registry). Nothing else in the package invents a metric name.
- `Histograms` is what the hot paths touch: `observe(name, seconds, label)` is a bisect and a locked add; with
  `keep_observations` the raw values since the last `take_observations()` are kept too (bounded: beyond
  `MAX_KEPT` a name's values are dropped and counted), for processes whose metrics are exported elsewhere.
- `EngineCollector(stats, histograms)` reads `stats()` (an `EngineStats`: counters, tier usage, tier counters,
  breakers, write queue) only when scraped: the engine's paths keep bumping their `Counters`, nothing more.
- `serve_metrics(registry, host, port)` serves `/metrics` on 127.0.0.1 unless told otherwise, in a daemon thread;
  `MetricsEndpoint.close()` stops it. A port that cannot be bound raises OSError (the caller decides).
"""
from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0, 30.0)
MAX_KEPT = 8192  # raw observations kept per histogram between two take_observations()


@dataclass(frozen=True, slots=True)
class MetricSpec:
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()


# The one table. Counter names carry `_total` here, as they appear on /metrics.
METRICS: dict[str, MetricSpec] = {
    "kvfabric_info": MetricSpec("gauge", "Always 1: the engine's model id, codec and chunk size",
                                ("model", "codec", "chunk_size")),
    "kvfabric_requests_total": MetricSpec("counter", "Engine calls", ("op",)),
    "kvfabric_requested_tokens_total": MetricSpec("counter", "Tokens asked for (lookup, retrieve) or offered "
                                                             "(store)", ("op",)),
    "kvfabric_hit_tokens_total": MetricSpec("counter", "Tokens found in the cache (lookup) or loaded (retrieve)",
                                            ("op",)),
    "kvfabric_requested_chunks_total": MetricSpec("counter", "Chunks asked for or offered", ("op",)),
    "kvfabric_hit_chunks_total": MetricSpec("counter", "Chunks found or loaded", ("op",)),
    "kvfabric_stored_tokens_total": MetricSpec("counter", "Tokens of newly stored chunks"),
    "kvfabric_stored_chunks_total": MetricSpec("counter", "Chunks newly stored"),
    "kvfabric_tier_hits_total": MetricSpec("counter", "Chunk reads served by a tier ('pending': a queued write)",
                                           ("tier",)),
    "kvfabric_tier_misses_total": MetricSpec("counter", "Chunk reads that reached a tier and did not find a valid "
                                                        "chunk there", ("tier",)),
    "kvfabric_tier_read_bytes_total": MetricSpec("counter", "Bytes of chunks read from a tier", ("tier",)),
    "kvfabric_tier_usage_bytes": MetricSpec("gauge", "Bytes a tier holds", ("tier",)),
    "kvfabric_tier_capacity_bytes": MetricSpec("gauge", "A tier's byte budget", ("tier",)),
    "kvfabric_tier_chunks": MetricSpec("gauge", "Chunks a tier holds", ("tier",)),
    "kvfabric_tier_evictions_total": MetricSpec("counter", "Chunks a tier evicted to stay within its budget",
                                                ("tier",)),
    "kvfabric_tier_events_total": MetricSpec("counter", "A tier's own counters (errors, timeouts, refusals, "
                                                        "retries), by name", ("tier", "event")),
    "kvfabric_promotions_total": MetricSpec("counter", "Chunks read below the first tier and copied up"),
    "kvfabric_corrupt_chunks_total": MetricSpec("counter", "Chunks that failed their checks and were dropped "
                                                           "('decode': found valid, failed to decode)", ("tier",)),
    "kvfabric_write_queue_depth_chunks": MetricSpec("gauge", "Writes waiting for the slow tiers"),
    "kvfabric_write_queue_capacity_chunks": MetricSpec("gauge", "Bound of the write-behind queue"),
    "kvfabric_write_drops_total": MetricSpec("counter", "Writes dropped because the write-behind queue was full"),
    "kvfabric_write_failures_total": MetricSpec("counter", "Background writes a tier refused or failed", ("tier",)),
    "kvfabric_breaker_open": MetricSpec("gauge", "1 while a tier's circuit breaker is open", ("tier",)),
    "kvfabric_p2p_server_bytes_total": MetricSpec("counter", "Chunk bytes this instance served to peers"),
    "kvfabric_p2p_server_chunks_total": MetricSpec("counter", "Chunks this instance served to peers"),
    "kvfabric_p2p_server_requests_total": MetricSpec("counter", "P2P requests served"),
    "kvfabric_p2p_fetched_bytes_total": MetricSpec("counter", "Chunk bytes fetched from peers"),
    "kvfabric_p2p_errors_total": MetricSpec("counter", "P2P errors", ("side", "kind")),
    "kvfabric_kv_events_total": MetricSpec("counter", "KV events published for routers", ("type",)),
    "kvfabric_lookup_seconds": MetricSpec("histogram", "CacheEngine.lookup latency"),
    "kvfabric_retrieve_seconds": MetricSpec("histogram", "CacheEngine.retrieve / read_chunk latency", ("op",)),
    "kvfabric_store_seconds": MetricSpec("histogram", "CacheEngine.store / store_chunk latency (until the first "
                                                      "tier holds the chunks)", ("op",)),
    "kvfabric_codec_encode_seconds": MetricSpec("histogram", "Encoding one chunk", ("codec",)),
    "kvfabric_codec_decode_seconds": MetricSpec("histogram", "Decoding (or copying out) one chunk", ("codec",)),
}


def _base(name: str) -> str:
    """prometheus_client's family name: counters without the `_total` suffix (it adds it to the sample)."""
    return name[:-6] if METRICS[name].kind == "counter" and name.endswith("_total") else name


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    counts: tuple[int, ...]  # per bucket (not cumulative), the last one +Inf
    sum: float
    count: int


@dataclass(slots=True)
class _Hist:
    counts: list[int]
    sum: float = 0.0
    count: int = 0
    kept: list[float] = field(default_factory=list)


class Histograms:
    """Fixed-bucket latency histograms keyed by (metric name, label value); thread safe."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S, keep_observations: bool = False) -> None:
        self.buckets = buckets
        self.keep_observations = keep_observations
        self.num_dropped = 0  # observations not kept (MAX_KEPT reached)
        self._hists: dict[tuple[str, str], _Hist] = {}
        self._lock = threading.Lock()

    def observe(self, name: str, seconds: float, label: str = "") -> None:
        i = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            hist = self._hists.get((name, label))
            if hist is None:
                hist = self._hists[(name, label)] = _Hist([0] * (len(self.buckets) + 1))
            hist.counts[i] += 1
            hist.sum += seconds
            hist.count += 1
            if self.keep_observations:
                if len(hist.kept) < MAX_KEPT:
                    hist.kept.append(seconds)
                else:
                    self.num_dropped += 1

    def snapshot(self) -> dict[tuple[str, str], HistogramSnapshot]:
        with self._lock:
            return {k: HistogramSnapshot(tuple(h.counts), h.sum, h.count) for k, h in self._hists.items()}

    def take_observations(self) -> dict[tuple[str, str], list[float]]:
        """The raw values observed since the last call (only with keep_observations)."""
        with self._lock:
            out = {k: h.kept for k, h in self._hists.items() if h.kept}
            for h in self._hists.values():
                h.kept = []
            return out


def tier_misses(hits: Mapping[str, int], tier_names: Iterable[str], num_miss: int, num_pending: int) -> dict[str, int]:
    """Misses per tier from the stack's hits: a read that reached tier i and was not served there was served by
    a later tier or by none. The queued writes are checked right after the first tier, before the others."""
    names = list(tier_names)
    out = {}
    for i, name in enumerate(names):
        later = sum(hits.get(n, 0) for n in names[i + 1:])
        out[name] = num_miss + later + (num_pending if i == 0 else 0)
    return out


class _Families:
    """Builds metric families of the METRICS table, adding samples by label values."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def _family(self, name: str) -> Metric:
        family = self._families.get(name)
        if family is None:
            spec = METRICS[name]
            cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}[spec.kind]
            family = self._families[name] = cls(_base(name), spec.help, labels=list(spec.labels))
        return family

    def add(self, name: str, value: float, *labels: str) -> None:
        self._family(name).add_metric(list(labels), value)

    def histogram(self, name: str, buckets: tuple[float, ...], snaps: Mapping[str, HistogramSnapshot]) -> None:
        spec = METRICS[name]
        family = HistogramMetricFamily(name, spec.help, labels=list(spec.labels))
        for label, snap in snaps.items():
            cumulative, total = [], 0
            for bound, n in zip([*map(_bound, buckets), "+Inf"], snap.counts):
                total += n
                cumulative.append((bound, total))
            family.add_metric([label] if spec.labels else [], cumulative, snap.sum)
        self._families[name] = family

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


def _bound(value: float) -> str:
    return repr(float(value))


# engine counter name -> (metric, label values)
_ENGINE_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookups": ("kvfabric_requests_total", ("lookup",)),
    "retrieves": ("kvfabric_requests_total", ("retrieve",)),
    "stores": ("kvfabric_requests_total", ("store",)),
    "chunk_reads": ("kvfabric_requests_total", ("read_chunk",)),
    "lookup_tokens": ("kvfabric_requested_tokens_total", ("lookup",)),
    "lookup_hit_tokens": ("kvfabric_hit_tokens_total", ("lookup",)),
    "retrieve_tokens": ("kvfabric_requested_tokens_total", ("retrieve",)),
    "tokens_retrieved": ("kvfabric_hit_tokens_total", ("retrieve",)),
    "store_tokens": ("kvfabric_requested_tokens_total", ("store",)),
    "lookup_chunks": ("kvfabric_requested_chunks_total", ("lookup",)),
    "lookup_hit_chunks": ("kvfabric_hit_chunks_total", ("lookup",)),
    "retrieve_chunks": ("kvfabric_requested_chunks_total", ("retrieve",)),
    "retrieve_hit_chunks": ("kvfabric_hit_chunks_total", ("retrieve",)),
    "chunk_read_hits": ("kvfabric_hit_chunks_total", ("read_chunk",)),
    "chunk_read_requests": ("kvfabric_requested_chunks_total", ("read_chunk",)),
    "store_chunks": ("kvfabric_requested_chunks_total", ("store",)),
    "tokens_stored": ("kvfabric_stored_tokens_total", ()),
    "chunks_stored": ("kvfabric_stored_chunks_total", ()),
    "promoted": ("kvfabric_promotions_total", ()),
    "dropped_writes": ("kvfabric_write_drops_total", ()),
    "discarded": ("kvfabric_corrupt_chunks_total", ("decode",)),
}
_P2P_SERVER = {"bytes_sent": "kvfabric_p2p_server_bytes_total", "chunks_sent": "kvfabric_p2p_server_chunks_total",
               "requests": "kvfabric_p2p_server_requests_total"}


def engine_families(stats: Any, hists: Mapping[tuple[str, str], HistogramSnapshot], *, model: str = "",
                    codec: str = "", chunk_size: int = 0, buckets: tuple[float, ...] = LATENCY_BUCKETS_S
                    ) -> list[Metric]:
    """Every kvfabric_* family of one engine, from its `EngineStats` snapshot and histogram snapshots."""
    out = _Families()
    out.add("kvfabric_info", 1, model, codec, str(chunk_size))
    counters: dict[str, int] = dict(stats.counters)
    for name in {"lookups", "retrieves", "stores", "chunks_stored", "tokens_stored", "promoted", "dropped_writes",
                 "discarded"}:
        counters.setdefault(name, 0)  # always present, so dashboards and rates see a zero, not a gap
    hits: dict[str, int] = {}
    for name, value in sorted(counters.items()):
        if name in _ENGINE_COUNTERS:
            metric, labels = _ENGINE_COUNTERS[name]
            out.add(metric, value, *labels)
            continue
        kind, _, tier = name.partition(".")
        if kind == "hit" and tier:
            hits[tier] = value
            out.add("kvfabric_tier_hits_total", value, tier)
        elif kind == "bytes_read" and tier:
            out.add("kvfabric_tier_read_bytes_total", value, tier)
        elif kind == "corrupt" and tier:
            out.add("kvfabric_corrupt_chunks_total", value, tier)
        elif kind == "failed_writes":
            out.add("kvfabric_write_failures_total", value, tier or "unknown")
    names = [usage.name for usage in stats.tiers]
    for tier, n in tier_misses(hits, names, counters.get("miss", 0), hits.get("pending", 0)).items():
        out.add("kvfabric_tier_misses_total", n, tier)
    for usage in stats.tiers:
        if f"failed_writes.{usage.name}" not in counters:
            out.add("kvfabric_write_failures_total", 0, usage.name)
        out.add("kvfabric_tier_usage_bytes", usage.num_bytes, usage.name)
        out.add("kvfabric_tier_capacity_bytes", usage.capacity_bytes, usage.name)
        out.add("kvfabric_tier_chunks", usage.num_chunks, usage.name)
        tier_counters = stats.tier_counters.get(usage.name, {})
        out.add("kvfabric_tier_evictions_total", tier_counters.get("evicted", 0), usage.name)
        for event, value in sorted(tier_counters.items()):
            if event != "evicted":
                out.add("kvfabric_tier_events_total", value, usage.name, event)
    for tier, is_open in sorted(stats.breakers_open.items()):
        out.add("kvfabric_breaker_open", int(is_open), tier)
    out.add("kvfabric_write_queue_depth_chunks", stats.write_queue_depth)
    out.add("kvfabric_write_queue_capacity_chunks", stats.write_queue_capacity)
    if stats.p2p_server:
        for name, metric in _P2P_SERVER.items():
            out.add(metric, stats.p2p_server.get(name, 0))
        for kind in ("errors", "rejected", "missing"):
            out.add("kvfabric_p2p_errors_total", stats.p2p_server.get(kind, 0), "server", kind)
    peer = stats.tier_counters.get("peer")
    if peer is not None:
        out.add("kvfabric_p2p_fetched_bytes_total", peer.get("bytes_fetched", 0))
        for kind in ("fetch_errors", "lookup_errors"):
            out.add("kvfabric_p2p_errors_total", peer.get(kind, 0), "client", kind)
    for kind, value in sorted(stats.kv_events.items()):
        out.add("kvfabric_kv_events_total", value, kind)
    by_metric: dict[str, dict[str, HistogramSnapshot]] = {}
    for (name, label), snap in hists.items():
        by_metric.setdefault(name, {})[label] = snap
    for name in ("kvfabric_lookup_seconds", "kvfabric_retrieve_seconds", "kvfabric_store_seconds",
                 "kvfabric_codec_encode_seconds", "kvfabric_codec_decode_seconds"):
        out.histogram(name, buckets, by_metric.get(name, {}))
    return list(out)


class EngineCollector:
    """A prometheus-client collector that reads an engine's snapshots when scraped."""

    def __init__(self, stats: Callable[[], Any], histograms: Histograms, *, model: str = "", codec: str = "",
                 chunk_size: int = 0) -> None:
        self._stats = stats
        self._histograms = histograms
        self._info = {"model": model, "codec": codec, "chunk_size": chunk_size}

    def collect(self) -> Iterator[Metric]:
        yield from engine_families(self._stats(), self._histograms.snapshot(), buckets=self._histograms.buckets,
                                   **self._info)

    def describe(self) -> list[Metric]:
        return []  # no registration-time collect: stats() may touch the network (redis usage)


def engine_registry(collector: EngineCollector) -> CollectorRegistry:
    """A registry with the engine's families and this process's (RSS, fds, CPU)."""
    registry = CollectorRegistry()
    registry.register(collector)
    ProcessCollector(registry=registry)
    return registry


class MetricsEndpoint:
    """`/metrics` of one registry on host:port, served by a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        from prometheus_client import start_http_server
        self._server, self._thread = start_http_server(port, host, registry)
        self.host = host
        self.port = self._server.server_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
