"""kvfabric's metrics and KV events inside vLLM, through vLLM's own channels.

Metrics: every worker's engine (and the scheduler's lookups) produce `KVFabricStats` every step
(`get_kv_connector_stats`): counter deltas, gauge values and raw latency observations under the names of
kvfabric.observe.metrics.METRICS, labelled by the worker's rank (`rank`; empty for the scheduler's lookups). vLLM
merges the workers' stats and carries them to its front-end process, which calls `KVFabricPromMetrics.observe`:
the metrics are made there with vLLM's own metric classes and registry (multiprocess-safe, with vLLM's
model_name and engine labels), so `vllm serve`'s /metrics shows them beside vllm:*.

KV events (`--kv-events-config`): the worker's engine tracks stored and vanished chunks (kvfabric.observe.events) by key;
`get_kv_connector_kv_cache_events` hands them to the scheduler (`KVFabricKVEvents`), which knows each saved
chunk's tokens and parent (`SchedulerEvents.planned`), turns them into vLLM's BlockStored / BlockRemoved, and
yields them from `take_events`: vLLM's publisher sends them with its own. Under tensor or pipeline parallelism each
writing rank reports its own share: a chunk is announced stored once every writing rank stored its share
(`num_writers`), and removed when the first share of it goes.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvfabric.cache.protocol import KVCache
from kvfabric.observe.events import ChunkEvents
from kvfabric.observe.metrics import METRICS, engine_families

SEP = "\x1f"  # between a metric name and its label values in a stats key


def _key(name: str, labels: Iterable[str]) -> str:
    return SEP.join([name, *labels])


@dataclass
class KVFabricStats(KVConnectorStats):
    """data: {"counters": {key: delta}, "gauges": {key: value}, "observations": {key: [seconds, ...]}}, keys being
    "metric<US>label value<US>..." (plain types: vLLM may serialize it between processes)."""

    def __post_init__(self) -> None:
        for part in ("counters", "gauges", "observations"):
            self.data.setdefault(part, {})

    def reset(self) -> None:
        self.data: dict[str, Any] = {"counters": {}, "gauges": {}, "observations": {}}

    def is_empty(self) -> bool:
        return not (self.data["counters"] or self.data["gauges"] or self.data["observations"])

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.get("counters", {}).items():
            self.data["counters"][key] = self.data["counters"].get(key, 0) + value
        self.data["gauges"].update(other.data.get("gauges", {}))
        for key, values in other.data.get("observations", {}).items():
            self.data["observations"].setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        c = self.data["counters"]
        def total(name: str, *labels: str) -> float:  # summed over the ranks
            return sum(v for k, v in c.items() if k.split(SEP)[0] == name and k.split(SEP)[2:] == list(labels))

        asked, hit = total("kvfabric_requested_tokens_total", "lookup"), total("kvfabric_hit_tokens_total", "lookup")
        return {"kvfabric lookup hit rate": round(hit / asked, 3) if asked else 0.0,
                "kvfabric stored chunks": total("kvfabric_stored_chunks_total"),
                "kvfabric chunk reads": total("kvfabric_requests_total", "read_chunk")}


class EngineStatsSource:
    """The worker side: the engine's metric families as deltas since the previous `take()`, at most every
    `interval_s` (a snapshot reads tier usage, for Redis over the network: not on every step)."""

    def __init__(self, engine: KVCache, interval_s: float = 1.0, rank: int = 0) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.rank = str(rank)
        engine.histograms.keep_observations = True
        self._last: dict[str, float] = {}
        self._next_at = 0.0

    def take(self) -> KVFabricStats:
        stats = KVFabricStats()
        now = time.monotonic()
        if now < self._next_at:
            return stats
        self._next_at = now + self.interval_s
        for family in engine_families(self.engine.stats(), {}):
            name = family.name + ("_total" if family.type == "counter" else "")
            if name not in METRICS or METRICS[name].kind == "histogram":
                continue
            for sample in family.samples:
                key = _key(name, [self.rank, *(sample.labels[label] for label in METRICS[name].labels)])
                if family.type == "counter":
                    delta = sample.value - self._last.get(key, 0.0)
                    self._last[key] = sample.value
                    if delta:
                        stats.data["counters"][key] = delta
                else:
                    stats.data["gauges"][key] = sample.value
        for (name, label), values in self.engine.histograms.take_observations().items():
            stats.data["observations"][_key(name, [self.rank, *([label] if METRICS[name].labels else [])])] = values
        return stats


class LookupStats:
    """The scheduler side: requested and hit tokens of the lookups vLLM asks for."""

    def __init__(self) -> None:
        self._stats = KVFabricStats()

    def record(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        c = self._stats.data["counters"]
        for name, value in (("kvfabric_requested_tokens_total", num_prompt_tokens),
                            ("kvfabric_hit_tokens_total", num_hit_tokens), ("kvfabric_requests_total", 1)):
            key = _key(name, ["", "lookup"])  # no rank: the scheduler's
            c[key] = c.get(key, 0) + value

    def take(self) -> KVFabricStats | None:
        out, self._stats = self._stats, KVFabricStats()
        return None if out.is_empty() else out


class KVFabricPromMetrics(KVConnectorPromMetrics):
    """Every kvfabric_* metric, made in vLLM's front-end with vLLM's metric classes and labels, and `rank`."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for name, spec in METRICS.items():
            labels = [*self._labelnames, "rank", *spec.labels]
            if spec.kind == "counter":
                self._metrics[name] = self._counter_cls(name=name, documentation=spec.help, labelnames=labels)
            elif spec.kind == "gauge":
                self._metrics[name] = self._gauge_cls(name=name, documentation=spec.help, labelnames=labels,
                                                      multiprocess_mode="mostrecent")
            else:
                from kvfabric.observe.metrics import LATENCY_BUCKETS_S
                self._metrics[name] = self._histogram_cls(name=name, documentation=spec.help, labelnames=labels,
                                                          buckets=list(LATENCY_BUCKETS_S))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for part in ("counters", "gauges", "observations"):
            for key, value in transfer_stats_data.get(part, {}).items():
                name, *labels = key.split(SEP)
                metric = self._metrics.get(name)
                if metric is None:
                    continue
                child = metric.labels(*engine, *labels)
                if part == "counters":
                    child.inc(value)
                elif part == "gauges":
                    child.set(value)
                else:
                    for seconds in value:
                        child.observe(seconds)


# ---- KV events ---------------------------------------------------------------------------------------------
def worker_events(block_size: int) -> ChunkEvents:
    """The worker engine's event tracker: plain tuples (picklable), converted by the scheduler."""
    return ChunkEvents(block_size, make=lambda kind, fields: (kind, list(fields.get("block_hashes", []))))


class KVFabricKVEvents(KVConnectorKVEvents):
    """The worker's events of one step: ("BlockStored" | "BlockRemoved" | "AllBlocksCleared", [chunk keys])."""

    def __init__(self, events: list[tuple[str, list[bytes]]] | None = None, num_workers: int = 1) -> None:
        self._events = list(events or [])
        self._num_workers = num_workers

    def add_events(self, events: list[Any]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVFabricKVEvents:
        return self  # the workers' events as they are: SchedulerEvents counts each chunk's shares

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._events = []


class SchedulerEvents:
    """Scheduler side: remembers each request's prompt and chunk keys, and so the tokens and parent of every chunk
    being saved; turns the workers' keys into vLLM's BlockStored / BlockRemoved. With `num_writers` ranks writing
    a share of each chunk, a chunk is stored once all of them reported it, and removed when the first share goes."""

    MAX_PLANNED = 65536

    def __init__(self, block_size: int, num_writers: int = 1) -> None:
        self.block_size = block_size
        self.num_writers = num_writers
        self._requests: dict[str, tuple[list[int], list[bytes]]] = {}
        self._planned: dict[bytes, tuple[list[int], bytes | None]] = {}
        self._shares: dict[bytes, int] = {}  # chunk -> shares reported stored, while fewer than num_writers
        self._whole: dict[bytes, None] = {}  # chunks announced stored (insertion order: the oldest go first)
        self._gone: dict[bytes, None] = {}  # chunks announced removed: the other ranks' removals are not news
        self._pending: list[KVCacheEvent] = []

    def remember(self, req_id: str, tokens: list[int], keys: Sequence[bytes]) -> None:
        self._requests[req_id] = (list(tokens), [bytes(k) for k in keys])

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def saving(self, req_id: str, start: int, end: int) -> None:
        """The chunks of tokens [start, end) of the request are being saved."""
        tokens, keys = self._requests.get(req_id, ([], []))
        cs = self.block_size
        for i in range(start // cs, min(end // cs, len(keys))):
            self._planned[keys[i]] = (tokens[i * cs:(i + 1) * cs], keys[i - 1] if i else None)
        for held in (self._planned, self._shares, self._whole, self._gone):
            while len(held) > self.MAX_PLANNED:
                held.pop(next(iter(held)))

    def update(self, events: KVConnectorKVEvents | None) -> None:
        if not isinstance(events, KVFabricKVEvents):
            return
        for kind, keys in events.get_all_events():
            if kind == "BlockRemoved":
                gone = [k for k in keys if self._removed(k)]
                if gone:
                    self._pending.append(BlockRemoved(block_hashes=gone, medium="CPU"))
                continue
            for key in keys:  # one event per chunk: chunks of a save may land in different steps
                if not self._stored(key):
                    continue
                planned = self._planned.pop(key, None)
                if planned is None:  # not a whole chunk this scheduler saved (a prompt's tail): no block of ours
                    continue
                tokens, parent = planned
                self._pending.append(BlockStored(block_hashes=[key], parent_block_hash=parent, token_ids=tokens,
                                                 block_size=self.block_size, lora_id=None, medium="CPU",
                                                 lora_name=None))

    def _stored(self, key: bytes) -> bool:
        """One share of the chunk stored: whether the chunk is now whole (announced once)."""
        if self.num_writers == 1:
            return True
        count = self._shares.get(key, 0) + 1
        if count < self.num_writers:
            self._shares[key] = count
            return False
        self._shares.pop(key, None)
        self._gone.pop(key, None)
        self._whole[key] = None
        return True

    def _removed(self, key: bytes) -> bool:
        """One share of the chunk gone: whether to announce the chunk removed: once, for a chunk announced stored or
        one this scheduler never planned (stored before a restart); not for a chunk whose shares are still landing."""
        if self.num_writers == 1:
            return True
        self._shares.pop(key, None)
        if key in self._gone:
            return False
        if key in self._whole or key not in self._planned:
            self._whole.pop(key, None)
            self._gone[key] = None
            return True
        return False

    def take(self) -> list[KVCacheEvent]:
        out, self._pending = self._pending, []
        return out
