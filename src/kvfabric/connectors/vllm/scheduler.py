"""Scheduler side of the connector (vLLM's EngineCore process): which tokens to load, what to save, per step.

Contract:
- `num_new_matched_tokens` hashes the prompt into kvfabric chunk keys (the same chained keys ``CacheEngine`` uses,
  or vLLM's block hashes, see key_mode in ``config``) and counts the leading chunks present, in (a) a mirror of the
  keys the worker reported stored in its process-memory tier (the reports ride back on the worker metadata), or
  (b) a shared tier opened read-only in this process (disk: an index miss re-checks the filesystem, so stores by
  any process are seen; shm; redis). No chunk data is read here. The answer is chunk-aligned, minus what vLLM
  already has; a hit covering the whole prompt leaves its last token to compute.
- Loads are synchronous (the connector answers ``is_async=False``), so vLLM sets ``has_sync_kv_loads`` for that
  step and the runner calls ``start_load_kv`` BEFORE the forward (it calls it after the forward only in steps
  without sync loads).
- `build_meta` emits per step, with the chunk keys: loads (token range, block table) and saves (every whole prompt
  chunk that becomes complete this step and is not known to be stored, including chunks vLLM had cached locally).
  A rollback (vLLM recomputing after a failed load) moves the save mark back, so the recomputed chunks are saved.
- Per request, ``kv_transfer_params["kvfabric"] = {"load": False, "store": False}`` turns loading or storing off;
  each finished request's ``kv_transfer_params["kvfabric"]`` carries its stats (`finished`).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvfabric.config import Config, ConfigError
from kvfabric.connectors.vllm.config import PARAMS_KEY
from kvfabric.connectors.vllm.metadata import KVFabricMetadata, KVFabricWorkerMetadata, LoadSpec, RequestStats, SaveSpec
from kvfabric.hashing import ChunkKey, chunk_keys, root_key
from kvfabric.layout import KVLayout
from kvfabric.tiers.factory import build_tiers

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


def _request_flags(request: Request) -> tuple[bool, bool]:
    params = getattr(request, "kv_transfer_params", None) or {}
    ours = params.get(PARAMS_KEY) or {} if isinstance(params, dict) else {}
    return bool(ours.get("load", True)), bool(ours.get("store", True))


@dataclass(frozen=True, slots=True)
class PrefixHit:
    num_chunks: int = 0  # leading chunks of the prompt that some tier holds
    num_in_memory: int = 0  # how many of those the worker's process-memory tier holds


@dataclass(frozen=True, slots=True)
class _Match:
    """The lookup of `get_num_new_matched_tokens`, kept until `update_state_after_alloc`."""
    hit: PrefixHit
    num_local_tokens: int  # tokens vLLM already had (its own prefix cache)


@dataclass(frozen=True, slots=True)
class _TokenSpan:
    start: int
    end: int


class ChunkLookup:
    """Which leading chunks of a prompt the worker can load: keys only, no chunk data is read."""

    def __init__(self, config: Config, layout: KVLayout, model_id: str) -> None:
        self.config = config
        self.chunk_size = config.chunk_size
        self.root = root_key(model_id, layout, config.chunk_size, config.salt, config.hash)
        # process memory is per process; a peer tier would make the scheduler a cluster member (not supported:
        # chunks that only peers hold are not reported as hits yet)
        shared = tuple(name for name in config.tiers if name not in ("cpu", "peer"))
        self.tiers = build_tiers(config, shared)
        self.has_memory_tier = "cpu" in config.tiers
        self.mirror: set[bytes] = set()  # keys the worker reported in its process-memory tier

    def keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        return chunk_keys(tokens, self.root, self.chunk_size, False, self.config.hash)

    def keys_from_block_hashes(self, block_hashes: Sequence[bytes], num_tokens: int, block_size: int) -> list[ChunkKey]:
        """Key mode "vllm": chunk i's key names vLLM's hash of the last block of the chunk (vLLM chains its block
        hashes over the prefix and folds in LoRA, multimodal inputs and cache_salt), within our namespace."""
        per_chunk = self.chunk_size // block_size
        num = min(num_tokens // self.chunk_size, len(block_hashes) // per_chunk)
        return [ChunkKey(hashlib.sha256(self.root + b"vllm-block-hash" + bytes(block_hashes[(i + 1) * per_chunk - 1]))
                         .digest()) for i in range(num)]

    def prefix(self, keys: Sequence[bytes]) -> PrefixHit:
        in_memory = [key in self.mirror for key in keys]
        present = list(in_memory)
        for tier in self.tiers:
            first = present.index(False) if False in present else len(keys)
            if first == len(keys):
                break
            for i, hit in enumerate(tier.contains_many(keys[first:]), start=first):
                present[i] = present[i] or hit
        num = present.index(False) if False in present else len(keys)
        return PrefixHit(num, sum(in_memory[:num]))

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


@dataclass
class _ReqState:
    num_prompt_tokens: int  # only prompt chunks are stored
    can_store: bool = True
    keys: list[ChunkKey] = field(default_factory=list)  # keys of the whole prompt chunks
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0  # chunks [0, saved_upto) are stored or being stored
    next_computed: int = 0  # num_computed_tokens expected at the next schedule (a smaller one = rollback)
    load: _TokenSpan | None = None  # tokens to load in the next step
    host_tokens: int = 0
    stats: RequestStats = RequestStats()


class SchedulerSide:
    def __init__(self, config: Config, layout: KVLayout, model_id: str, block_size: int, key_mode: str) -> None:
        self.chunk_size = config.chunk_size
        self.block_size = block_size
        self.key_mode = key_mode
        if key_mode == "vllm" and config.chunk_size % block_size:
            raise ConfigError(f"key_mode vllm needs chunk_size ({config.chunk_size}) to be a multiple of vLLM's "
                              f"block size ({block_size})")
        self.lookup = ChunkLookup(config, layout, model_id)
        self._warned: set[str] = set()
        self.states: dict[str, _ReqState] = {}
        self.keys: dict[str, list[ChunkKey]] = {}  # per request: keys of its prompt's whole chunks
        self.pending: dict[str, _Match] = {}

    def request_keys(self, request: Request) -> list[ChunkKey]:
        """Keys of the request's whole prompt chunks ([] when it must not be cached in this key mode)."""
        req_id = request.request_id
        keys = self.keys.get(req_id)
        if keys is not None and (self.key_mode == "tokens" or len(keys) == len(request.prompt_token_ids or ())
                                 // self.chunk_size):
            return keys
        tokens = request.prompt_token_ids
        if not tokens:
            keys = []
        elif self.key_mode == "vllm":
            keys = self.lookup.keys_from_block_hashes(request.block_hashes, len(tokens), self.block_size)
        else:
            extra = [name for name, value in (("LoRA", request.lora_request), ("multimodal", request.mm_features),
                                              ("cache_salt", getattr(request, "cache_salt", None)))
                     if value]
            if extra:  # token ids alone do not name this KV: never share it
                if extra[0] not in self._warned:
                    self._warned.add(extra[0])
                    logger.warning("kvfabric: %s requests are not cached with key_mode=tokens; use key_mode=vllm",
                                   extra[0])
                keys = []
            else:
                keys = self.lookup.keys(tokens)
        self.keys[req_id] = keys
        return keys

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        load, _ = _request_flags(request)
        req_id = request.request_id
        keys = self.request_keys(request) if load else []
        hit = self.lookup.prefix(keys) if keys else PrefixHit()
        self.pending[req_id] = _Match(hit, num_computed_tokens)
        if not keys:
            return 0
        num = min(hit.num_chunks * self.chunk_size, request.num_tokens - 1)  # a full hit leaves one token to compute
        return max(0, num - num_computed_tokens)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        state = self.states.get(request.request_id)
        host = min(num_external_tokens, state.host_tokens) if state is not None else 0
        out = {CacheHitSource.HOST: host, CacheHitSource.DISK: num_external_tokens - host}
        return {source: n for source, n in out.items() if n > 0}

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        _, store = _request_flags(request)
        state = self.states.get(req_id)
        match = self.pending.pop(req_id, _Match(PrefixHit(), 0))
        local = match.num_local_tokens
        if state is None:
            state = self.states[req_id] = _ReqState(len(request.prompt_token_ids or ()), can_store=store,
                                                    stats=RequestStats(local_hit_tokens=local))
        state.keys = self.request_keys(request)
        state.block_ids = list(blocks.get_block_ids()[0])
        state.saved_upto = match.hit.num_chunks * self.chunk_size  # already stored: never gathered again
        if num_external_tokens > 0:
            state.load = _TokenSpan(local, local + num_external_tokens)
        # tokens served from the worker's process memory (the rest from shared tiers), for vLLM's hit metrics
        state.host_tokens = max(0, min(num_external_tokens, match.hit.num_in_memory * self.chunk_size - local))

    def build_meta(self, out: SchedulerOutput) -> KVFabricMetadata:
        meta = KVFabricMetadata()
        for new in out.scheduled_new_reqs:
            state = self.states.get(new.req_id)
            if state is None:  # not seen by the lookup (should not happen): nothing to load or save
                continue
            state.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, state, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id], True)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.states.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed and new_blocks is not None:
                state.block_ids = list(new_blocks[0])  # a resumed request gets its whole block table
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            self._plan(meta, req_id, state, cached.num_computed_tokens[i], out.num_scheduled_tokens[req_id], resumed)
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        return meta

    def _plan(self, meta: KVFabricMetadata, req_id: str, state: _ReqState, computed: int, scheduled: int,
              fresh: bool) -> None:
        cs, bs = self.chunk_size, self.block_size
        if not fresh and computed < state.next_computed:  # rolled back (a failed load): re-save from there
            state.saved_upto = min(state.saved_upto, computed // cs * cs)
        state.next_computed = computed + scheduled
        if state.load is not None:
            start, end = state.load.start, state.load.end
            state.load = None
            meta.loads.append(LoadSpec(req_id, state.keys[start // cs:-(-end // cs)], start, end,
                                       state.block_ids[:-(-end // bs)]))
            state.stats += RequestStats(external_hit_tokens=end - start)
        if state.can_store and state.keys:
            end = min(state.next_computed, state.num_prompt_tokens, len(state.keys) * cs) // cs * cs
            if end > state.saved_upto:
                meta.saves.append(SaveSpec(req_id, state.keys[state.saved_upto // cs:end // cs], state.saved_upto,
                                           end, state.block_ids[:-(-end // bs)]))
                state.saved_upto = end

    def update(self, output: KVConnectorOutput) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVFabricWorkerMetadata):
            return
        self.lookup.mirror.update(meta.stored)
        self.lookup.mirror.difference_update(meta.removed)
        for req_id, stats in meta.requests.items():
            state = self.states.get(req_id)
            if state is not None:
                state.stats += stats

    def finished(self, request: Request) -> dict[str, Any] | None:
        state = self.states.get(request.request_id)
        self.forget(request.request_id)
        return {PARAMS_KEY: state.stats.as_params()} if state is not None else None

    def forget(self, req_id: str) -> None:
        self.states.pop(req_id, None)
        self.keys.pop(req_id, None)
        self.pending.pop(req_id, None)
