"""What crosses the scheduler/worker process boundary each step (vLLM pickles these objects).

Contract:
- Scheduler -> worker, ``KVFabricMetadata`` (one per step): the loads and saves of the step, each with its chunk
  keys already computed (the worker never hashes tokens) and the request's block table from token 0.
  A LoadSpec loads tokens [start, end) (start need not be chunk-aligned: vLLM may already hold a prefix);
  a SaveSpec saves the whole chunks [start, end) (both chunk-aligned).
- Worker -> scheduler, ``KVFabricWorkerMetadata`` (only when there is something to say): per-request stats of the
  step (added up by `add_stats`), and the keys that entered or left the worker's process-memory tier (the
  scheduler mirrors them, since it cannot see that tier).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class LoadSpec:
    req_id: str
    keys: list[bytes]  # keys of the chunks covering [start, end), the first one holding token `start`
    start: int  # load tokens [start, end) into the request's slots
    end: int
    block_ids: list[int]  # block table from token 0, covering `end`


@dataclass
class SaveSpec:
    req_id: str
    keys: list[bytes]  # keys of the whole chunks [start, end)
    start: int  # chunk-aligned
    end: int
    block_ids: list[int]


@dataclass
class KVFabricMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class KVFabricWorkerMetadata(KVConnectorWorkerMetadata):
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-request load/save stats of the step
    stored: list[bytes] = field(default_factory=list)  # keys now in the worker's process-memory tier
    removed: list[bytes] = field(default_factory=list)  # keys gone from it

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVFabricWorkerMetadata):
            for req_id, stats in other.requests.items():
                self.requests[req_id] = add_stats(self.requests.get(req_id, {}), stats)
            self.stored.extend(other.stored)
            self.removed.extend(other.removed)
        return self


def add_stats(into: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """Add `more` into `into`, key by key (nested dicts, e.g. bytes per tier, recursively); returns `into`."""
    for key, value in more.items():
        if isinstance(value, dict):
            into[key] = add_stats(dict(into.get(key, {})), value)
        else:
            into[key] = into.get(key, 0) + value
    return into
