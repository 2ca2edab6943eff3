"""`kvfabric stats [--watch] [URL...]`: a terminal view of kvfabric instances' /metrics (kvfabric.observe.metrics names).

Contract:
- `scrape(url)` reads one /metrics page (bearer token optional) into an `InstanceStats`; an unreachable or
  non-kvfabric URL gives `InstanceStats(url, error=...)`, never an exception.
- Hit rate = hit tokens / requested tokens of lookups; tokens saved = tokens loaded by retrieves (prefill that
  did not run); latency percentiles are interpolated inside histogram buckets (as Prometheus'
  histogram_quantile does), over everything since the process started, or since the previous refresh with
  --watch once two scrapes exist.
- `render(stats)` is a rich renderable: one panel per instance with its tiers' usage bars.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

LATENCIES = (("lookup", "kvfabric_lookup_seconds", ""), ("retrieve", "kvfabric_retrieve_seconds", "retrieve"),
             ("read_chunk", "kvfabric_retrieve_seconds", "read_chunk"), ("store", "kvfabric_store_seconds", "store"),
             ("store_chunk", "kvfabric_store_seconds", "store_chunk"))


@dataclass(frozen=True, slots=True)
class TierRow:
    name: str
    num_bytes: float
    capacity_bytes: float
    num_chunks: float
    hits: float
    evictions: float
    breaker_open: bool


@dataclass(frozen=True, slots=True)
class InstanceStats:
    url: str
    error: str = ""
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        want = set(labels.items())
        return sum(v for (n, lab), v in self.samples.items() if n == name and want <= set(lab))

    def label_values(self, name: str, label: str) -> list[str]:
        return sorted({dict(lab)[label] for (n, lab) in self.samples if n == name and label in dict(lab)})

    @property
    def hit_rate(self) -> float:
        asked = self.value("kvfabric_requested_tokens_total", op="lookup")
        return self.value("kvfabric_hit_tokens_total", op="lookup") / asked if asked else 0.0

    @property
    def tokens_saved(self) -> float:
        return self.value("kvfabric_hit_tokens_total", op="retrieve")

    def tiers(self) -> list[TierRow]:
        return [TierRow(t, self.value("kvfabric_tier_usage_bytes", tier=t), self.value("kvfabric_tier_capacity_bytes",
                                                                                          tier=t),
                        self.value("kvfabric_tier_chunks", tier=t), self.value("kvfabric_tier_hits_total", tier=t),
                        self.value("kvfabric_tier_evictions_total", tier=t),
                        self.value("kvfabric_breaker_open", tier=t) > 0)
                for t in self.label_values("kvfabric_tier_usage_bytes", "tier")]

    def buckets(self, metric: str, op: str) -> list[tuple[float, float]]:
        """Cumulative (upper bound, count) of a histogram's series with op label `op` ("" = no op label)."""
        out: dict[float, float] = {}
        for (n, lab), v in self.samples.items():
            labels = dict(lab)
            if n == metric + "_bucket" and labels.get("op", "") == op:
                bound = float(labels["le"])
                out[bound] = out.get(bound, 0.0) + v
        return sorted(out.items())


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            span = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / span if span else 1.0)
        lower_bound, lower_count = bound, count
    return lower_bound


def minus(now: InstanceStats, before: InstanceStats | None) -> InstanceStats:
    """Counter-like samples of `now` minus `before` (for rates and recent percentiles); gauges kept as they are."""
    if before is None or before.error or now.error:
        return now
    gauges = ("kvfabric_tier_usage_bytes", "kvfabric_tier_capacity_bytes", "kvfabric_tier_chunks",
              "kvfabric_breaker_open", "kvfabric_write_queue_depth_chunks", "kvfabric_info")
    samples = {k: (v if k[0] in gauges else v - before.samples.get(k, 0.0)) for k, v in now.samples.items()}
    return InstanceStats(now.url, "", samples)


def scrape(url: str, token: str | None = None, timeout_s: float = 3.0) -> InstanceStats:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s, trust_env=False)
        response.raise_for_status()
        samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    except (httpx.HTTPError, ValueError) as exc:
        return InstanceStats(url, error=f"{type(exc).__name__}: {exc}")
    if not any(name.startswith("kvfabric_") for name, _ in samples):
        return InstanceStats(url, error="no kvfabric_* metrics there")
    return InstanceStats(url, "", samples)


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def panel(stats: InstanceStats, recent: InstanceStats | None = None, interval_s: float = 0.0) -> Panel:
    if stats.error:
        return Panel(Text(stats.error, style="red"), title=stats.url, border_style="red")
    row = [f"hit rate [bold]{100 * stats.hit_rate:.1f} %[/]",
           f"tokens saved [bold]{stats.tokens_saved:,.0f}[/]",
           f"stored chunks {stats.value('kvfabric_stored_chunks_total'):,.0f}",
           f"write queue {stats.value('kvfabric_write_queue_depth_chunks'):.0f}"
           f"/{stats.value('kvfabric_write_queue_capacity_chunks'):.0f}",
           f"drops {stats.value('kvfabric_write_drops_total'):,.0f}",
           f"corrupt {stats.value('kvfabric_corrupt_chunks_total'):,.0f}"]
    if recent is not None and interval_s > 0:
        row.append(f"requests/s {recent.value('kvfabric_requests_total') / interval_s:,.1f}")
    head = Text.from_markup("   ".join(row))
    tiers = Table(box=None, padding=(0, 1))
    for name in ("tier", "usage", "", "chunks", "hits", "evictions", "breaker"):
        tiers.add_column(name)
    for t in stats.tiers():
        share = t.num_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        tiers.add_row(t.name, ProgressBar(total=1.0, completed=min(1.0, share), width=24),
                      f"{_size(t.num_bytes)} / {_size(t.capacity_bytes)}", f"{t.num_chunks:,.0f}", f"{t.hits:,.0f}",
                      f"{t.evictions:,.0f}", Text("OPEN", style="bold red") if t.breaker_open else "closed")
    lat = Table(box=None, padding=(0, 1), title="latency (ms)" + (" since last refresh" if recent else ""),
                title_justify="left")
    for name in ("op", "count", "p50", "p95", "p99"):
        lat.add_column(name)
    source = recent if recent is not None else stats
    for label, metric, op in LATENCIES:
        buckets = source.buckets(metric, op)
        if buckets and buckets[-1][1] > 0:
            lat.add_row(label, f"{buckets[-1][1]:,.0f}", *(_ms(quantile(q, buckets)) for q in (0.5, 0.95, 0.99)))
    return Panel(Group(head, tiers, lat), title=stats.url)


def render(stats: Sequence[InstanceStats], recent: Sequence[InstanceStats | None] = (),
           interval_s: float = 0.0) -> Group:
    recent = list(recent) or [None] * len(stats)
    return Group(*(panel(s, r, interval_s) for s, r in zip(stats, recent)))


def watch(urls: Sequence[str], token: str | None, interval_s: float, console, iterations: int = 0) -> None:
    """Refresh every `interval_s` until interrupted (or `iterations` refreshes, for tests)."""
    from rich.live import Live
    before: list[InstanceStats | None] = [None] * len(urls)
    done = 0
    with Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            now = [scrape(url, token) for url in urls]
            live.update(render(now, [minus(n, b) if b is not None else None for n, b in zip(now, before)],
                               interval_s), refresh=True)
            before = now
            done += 1
            if iterations and done >= iterations:
                return
            time.sleep(interval_s)
