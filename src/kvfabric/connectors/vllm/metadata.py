"""What crosses the scheduler/worker process boundary each step (vLLM pickles these objects).

Contract:
- Scheduler -> worker, ``KVFabricMetadata`` (one per step): the loads and saves of the step, each with its chunk
  keys already computed (the worker never hashes tokens) and the request's block table from token 0.
  A LoadSpec loads tokens [start, end) (start need not be chunk-aligned: vLLM may already hold a prefix),
  asynchronously (`is_async`: the request waits in WAITING_FOR_REMOTE_KVS, the load spans steps) or within the
  step; a SaveSpec saves the chunks [start, end) (start chunk-aligned; end too, or the prompt's end for its
  partial last chunk). Under vLLM's hybrid KV cache manager (several KV cache groups) a spec carries one block
  table per group (`group_block_ids`; `table(g)`), and a LoadSpec's `window_from` is the first token whose
  sliding-window blocks vLLM allocated (earlier ones are its null block): window layers load only from there.
  With one group, `block_ids` serves every layer and `window_from` is 0. `is_idle`: nothing is scheduled
  this step (the worker may then wait briefly for an asynchronous load instead of returning at once).
  `new_block_ids` (the paged mover's path: a GPU, MLA): the blocks vLLM hands out this step; before vLLM writes
  them (``handle_preemptions``) the worker waits for any save still copying out of one of them.
- Worker -> scheduler, ``KVFabricWorkerMetadata`` (only when there is something to say): per-request
  ``RequestStats`` of the step (added up with ``+``). What the cache holds is not reported: the scheduler asks
  the worker's cache (connectors/lookup.py).
- A finished request's ``kv_transfer_params["kvfabric"]`` is its summed ``RequestStats.as_params()``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


class _Tables:
    __slots__ = ()
    block_ids: list[int]
    group_block_ids: tuple[list[int], ...]

    def table(self, group: int) -> list[int]:
        """The block table of KV cache group `group` (one group: `block_ids`)."""
        return self.group_block_ids[group] if self.group_block_ids else self.block_ids


@dataclass(frozen=True, slots=True)
class LoadSpec(_Tables):
    req_id: str
    keys: Sequence[bytes]  # keys of the chunks covering [start, end), the first one holding token `start`
    start: int  # load tokens [start, end) into the request's slots
    end: int
    block_ids: list[int]  # block table from token 0, covering `end`
    is_async: bool = False
    keys_end: int = 0  # where the keys' tokens end, from token 0: a last key may name a partial chunk ending here
    group_block_ids: tuple[list[int], ...] = ()  # per KV cache group (several groups only), each from token 0
    window_from: int = 0  # window layers load tokens [max(start, window_from), end) (block-aligned)


@dataclass(frozen=True, slots=True)
class SaveSpec(_Tables):
    req_id: str
    keys: Sequence[bytes]  # keys of the chunks [start, end)
    start: int  # chunk-aligned
    end: int  # chunk-aligned, or the end of a partial last chunk (the prompt's, with save_partial_chunk, or
    # its tail in whole `tail_step`s)
    block_ids: list[int]
    group_block_ids: tuple[list[int], ...] = ()  # per KV cache group (several groups only)


@dataclass(frozen=True, slots=True)
class RequestStats:
    """One request's connector stats, of a step or summed over its life (``+`` adds field by field)."""
    external_hit_tokens: int = 0  # tokens planned to load from kvfabric
    local_hit_tokens: int = 0  # tokens vLLM had in its own prefix cache
    loaded_tokens: int = 0
    failed_tokens: int = 0  # tokens whose chunk was missing or corrupt: vLLM recomputes them
    saved_tokens: int = 0
    load_read_s: float = 0.0
    bytes_loaded: tuple[tuple[str, int], ...] = ()  # (tier, bytes read), sorted by tier

    def __add__(self, other: RequestStats) -> RequestStats:
        by_tier = dict(self.bytes_loaded)
        for tier, num_bytes in other.bytes_loaded:
            by_tier[tier] = by_tier.get(tier, 0) + num_bytes
        summed = {name: getattr(self, name) + getattr(other, name) for name in _SUMMED}
        return RequestStats(**summed, bytes_loaded=tuple(sorted(by_tier.items())))

    def as_params(self) -> dict[str, Any]:
        """The request's ``kv_transfer_params["kvfabric"]``: the counts, and ``bytes`` loaded per tier."""
        return {**{name: getattr(self, name) for name in _SUMMED}, "bytes": dict(self.bytes_loaded)}


_SUMMED = tuple(f.name for f in dataclasses.fields(RequestStats) if f.name != "bytes_loaded")


@dataclass
class KVFabricMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    is_idle: bool = False
    # the paged mover's path only (a GPU, MLA): every block vLLM hands out this step, in any group (a block an
    # earlier save still copies out of may be among them: a preempted request's, a window block that slid out)
    new_block_ids: frozenset[int] = frozenset()

    @property
    def sync_loads(self) -> list[LoadSpec]:
        """The step's layer-wise loads (the rest are async: they span steps)."""
        return [spec for spec in self.loads if not spec.is_async]


@dataclass
class KVFabricWorkerMetadata(KVConnectorWorkerMetadata):
    requests: dict[str, RequestStats] = field(default_factory=dict)  # per-request stats of the step

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVFabricWorkerMetadata):
            for req_id, stats in other.requests.items():
                self.requests[req_id] = self.requests.get(req_id, RequestStats()) + stats
        return self
