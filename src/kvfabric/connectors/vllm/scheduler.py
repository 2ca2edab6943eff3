"""Scheduler side of the connector (vLLM's EngineCore process): which tokens to load, what to save, per step.

Contract:
- `num_new_matched_tokens` hashes the prompt into kvfabric chunk keys (the same chained keys ``CacheEngine`` uses,
  or vLLM's block hashes, see key_mode in ``config``) and asks the worker's cache how many leading chunks it can
  load (``lookup.LookupClient``: the worker's ``lookup_keys``, window parts included; with ``mode: server`` the
  worker's RemoteCache asks the host's server). The scheduler holds no tiers of its own: one lookup authority. No
  chunk data is read here; a worker that does not answer is a miss. The answer is chunk-aligned, minus what vLLM
  already has; a hit covering the whole prompt leaves its last token to compute.
- Key mode "tokens": a request's ``cache_salt`` S moves its keys into the namespace of tenant salt S (see
  ``config``); LoRA and multimodal requests are not cached. With ``tenant_mode`` a request without a cache_salt
  (in either key mode) is served without the cache: nothing looked up, loaded or stored for it.
- Load mode "async": the connector answers ``is_async=True``; vLLM allocates the blocks, parks the request in
  WAITING_FOR_REMOTE_KVS and calls `after_alloc` (a second call with 0 external tokens follows once the KV is in
  place; it changes nothing). The load is emitted in the next `build_meta` although the request is not
  scheduled. Load mode "layerwise": ``is_async=False``, so vLLM sets ``has_sync_kv_loads`` and the runner calls
  ``start_load_kv`` BEFORE the forward; the load rides with the request's first scheduled step.
- Tails (``tail_step`` > 0: key mode "tokens", one KV cache group, no window layers, no save_partial_chunk): a
  prompt's tokens past its last whole chunk are stored too, in whole steps, as a partial chunk (keyed like one:
  ``KeySpace.tail_keys``). When a lookup stops before the prompt's end, the scheduler asks once more, for the
  longest such partial chunk that the prompt's next tokens begin with (`ChunkLookup.tail`): the next turn of a
  chat then loads what the previous turn computed past its last whole chunk, instead of computing it again.
- `build_meta` emits per step, with the chunk keys: loads (token range, block table) and saves (every whole prompt
  chunk that becomes complete this step and is not known to be stored, including chunks vLLM had cached locally).
  A rollback (vLLM recomputing after a failed load) moves the save mark back, so the recomputed chunks are saved.
- vLLM's KV cache groups (``KVGroups``): the request's block table of every group is kept and sent with each spec
  (several groups only). Under the hybrid manager a load's `window_from` is the first token whose window-group
  block vLLM allocated (`KVGroups.window_from` of the load's end: the same rule as its SlidingWindowManager),
  and a chunk is saved only while vLLM still holds its window blocks (from `window_from` of the tokens computed
  before the step); older chunks not yet stored are skipped (counted in `window_chunks_skipped`): their window
  rows are gone, and a chunk is stored with both parts or not at all.
- Holding newcomers (``hold_budget`` > 0, the connector's ``hold_newcomers``): when the step just planned leaves a
  prefill with at most ``hold_budget`` tokens to compute (vLLM's token budget: it finishes in the next step), a
  request the lookup has not seen answers None ("not yet": vLLM keeps it waiting and asks again next step), once
  per request. Why: vLLM fills the budget with the finishing prefill's last tokens and the newcomer's first chunk,
  and the finishing request's first token then waits for the newcomer's chunk as well; shortest remaining first
  lowers the mean TTFT whenever the finishing prefill is the shorter. Measured against LMCache, whose asynchronous
  lookup has the same effect by accident (docs/benchmarks/serve.md).
- Per request, ``kv_transfer_params["kvfabric"] = {"load": False, "store": False}`` turns loading or storing off;
  the instance's kv_role (``Role``, config.py) turns storing off for every request of a P/D consumer;
  each finished request's ``kv_transfer_params["kvfabric"]`` carries its stats (`finished`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvfabric.cache.protocol import KeyLookup
from kvfabric.config import Config, ConfigError
from kvfabric.connectors.lookup import EveryRank, LookupClient
from kvfabric.connectors.vllm.config import PARAMS_KEY, KVGroups, Role, role_of
from kvfabric.connectors.vllm.metadata import KVFabricMetadata, KVFabricWorkerMetadata, LoadSpec, RequestStats, SaveSpec
from kvfabric.connectors.vllm.prompt_keys import ChunkLookup, Tail
from kvfabric.kv.hashing import ChunkKey
from kvfabric.kv.layout import KVLayout

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)
BOTH = role_of("kv_both")


def _request_flags(request: Request, role: Role) -> tuple[bool, bool]:
    params = getattr(request, "kv_transfer_params", None) or {}
    ours = params.get(PARAMS_KEY) or {} if isinstance(params, dict) else {}
    return bool(ours.get("load", True)), role.can_store and bool(ours.get("store", True))


@dataclass(frozen=True, slots=True)
class _Match:
    """The lookup of `get_num_new_matched_tokens`, kept until `update_state_after_alloc`."""
    hit: KeyLookup
    num_local_tokens: int  # tokens vLLM already had (its own prefix cache)
    tail: Tail | None = None  # a partial chunk stored after the hit's whole chunks


@dataclass(frozen=True, slots=True)
class _TokenSpan:
    start: int
    end: int


@dataclass
class _ReqState:
    num_prompt_tokens: int  # only prompt chunks are stored
    can_store: bool = True
    keys: list[ChunkKey] = field(default_factory=list)  # keys of the whole prompt chunks (then the tail's)
    keys_end: int = 0  # where the tokens of `keys` end
    tables: list[list[int]] = field(default_factory=list)  # block table per KV cache group
    saved_upto: int = 0  # chunks [0, saved_upto) are stored or being stored
    next_computed: int = 0  # num_computed_tokens expected at the next schedule (a smaller one = rollback)
    load: _TokenSpan | None = None  # tokens to load in the next step
    load_tail: Tail | None = None  # the partial chunk that load ends with
    async_end: int = 0  # end of an async load in flight: if vLLM resumes below it, a chunk failed (re-save it)
    host_tokens: int = 0
    stats: RequestStats = RequestStats()


class SchedulerSide:
    def __init__(self, config: Config, layout: KVLayout, model_id: str, block_size: int, key_mode: str,
                 load_mode: str = "async", role: Role = BOTH, groups: KVGroups | None = None, *,
                 client: LookupClient | EveryRank, hold_budget: int = 0, tail_step: int = 0) -> None:
        self.chunk_size = config.chunk_size
        self.groups = groups or KVGroups(block_size)
        # 0: no tails (see the module doc): vLLM's block hashes name whole blocks, a partial key already names the
        # prompt's end, a window layer's rows of a partial chunk may be gone
        can_tail = key_mode == "tokens" and not config.save_partial_chunk and not self.groups.is_hybrid \
            and not layout.window_layers
        self.tail_step = tail_step if can_tail and 0 < tail_step < config.chunk_size else 0
        self.window_chunks_skipped = 0  # chunks not saved: vLLM had freed their window blocks
        self.role = role
        self.block_size = block_size
        self.key_mode = key_mode
        self.is_async = load_mode == "async"
        if key_mode == "vllm" and config.chunk_size % block_size:
            raise ConfigError(f"key_mode vllm needs chunk_size ({config.chunk_size}) to be a multiple of vLLM's "
                              f"block size ({block_size})")
        self.lookup = ChunkLookup(config, layout, model_id, client)
        self.tenant_mode = config.tenant_mode
        self._warned: set[str] = set()
        self.states: dict[str, _ReqState] = {}
        self.keys: dict[str, list[ChunkKey]] = {}  # per request: keys of its prompt's whole chunks
        self.pending: dict[str, _Match] = {}
        self.waiting: set[str] = set()  # async loads to emit in the next build_meta (the request is not scheduled)
        self.hold_budget = hold_budget  # 0: never hold a newcomer (see the module doc)
        self.is_finishing = False  # the last step planned left a prefill that finishes within hold_budget tokens
        self.held: set[str] = set()  # requests held once already

    def request_keys(self, request: Request) -> list[ChunkKey]:
        """Keys of the request's whole prompt chunks ([] when it must not be cached in this key mode)."""
        req_id = request.request_id
        keys = self.keys.get(req_id)
        if keys is not None and (self.key_mode == "tokens" or len(keys) == len(request.prompt_token_ids or ())
                                 // self.chunk_size):
            return keys
        tokens = request.prompt_token_ids
        if self.tenant_mode and not getattr(request, "cache_salt", None):
            if "tenant" not in self._warned:
                self._warned.add("tenant")
                logger.warning("kvfabric: tenant_mode is on: requests without a cache_salt are served without the "
                               "cache")
            keys = []
        elif not tokens:
            keys = []
        elif self.key_mode == "vllm":
            keys = self.lookup.keys_from_block_hashes(request.block_hashes, len(tokens), self.block_size)
        else:
            extra = [name for name, value in (("LoRA", request.lora_request), ("multimodal", request.mm_features))
                     if value]
            if extra:  # token ids alone do not name this KV: never share it
                if extra[0] not in self._warned:
                    self._warned.add(extra[0])
                    logger.warning("kvfabric: %s requests are not cached with key_mode=tokens; use key_mode=vllm",
                                   extra[0])
                keys = []
            else:
                keys = self.lookup.keys(tokens, getattr(request, "cache_salt", None))
        self.keys[req_id] = keys
        return keys

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens the connector can load beyond num_computed_tokens, or None: ask again next step (a held
        newcomer, see the module doc)."""
        load, _ = _request_flags(request, self.role)
        req_id = request.request_id
        if self.is_finishing and req_id not in self.held and req_id not in self.states:
            self.held.add(req_id)
            return None
        keys = self.request_keys(request) if load else []
        tokens = request.prompt_token_ids or ()
        hit = self.lookup.prefix(keys, len(tokens)) if keys else KeyLookup()
        if not keys:
            self.pending[req_id] = _Match(hit, num_computed_tokens)
            return 0
        hit_end = hit.num_chunks * self.chunk_size
        tail = None
        # a tail can add tokens: the prompt goes on past a whole step, and vLLM does not have them itself
        if self.tail_step and hit_end + self.tail_step <= len(tokens) and num_computed_tokens < hit_end + \
                self.chunk_size:
            tail = self.lookup.tail(tokens, keys, hit.num_chunks, self.tail_step, getattr(request, "cache_salt", None))
        self.pending[req_id] = _Match(hit, num_computed_tokens, tail)
        # a partial last chunk ends with the prompt (save_partial_chunk), or at the tail's end
        num = min(tail.end if tail else hit_end, len(tokens), request.num_tokens - 1)  # one token left to compute
        return max(0, num - num_computed_tokens)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        state = self.states.get(request.request_id)
        host = min(num_external_tokens, state.host_tokens) if state is not None else 0
        out = {CacheHitSource.HOST: host, CacheHitSource.DISK: num_external_tokens - host}
        return {source: n for source, n in out.items() if n > 0}

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        _, store = _request_flags(request, self.role)
        state = self.states.get(req_id)
        match = self.pending.pop(req_id, None)
        if state is not None and match is None:  # the second call after an async load: blocks only
            state.tables = [list(table) for table in blocks.get_block_ids()]
            return
        match = match or _Match(KeyLookup(), 0)
        local = match.num_local_tokens
        if state is None:
            state = self.states[req_id] = _ReqState(len(request.prompt_token_ids or ()), can_store=store,
                                                    stats=RequestStats(local_hit_tokens=local))
        state.keys = self.request_keys(request)
        state.keys_end = min(state.num_prompt_tokens, len(state.keys) * self.chunk_size)  # a partial last key
        tail = self._own_tail(request, state.keys) if store and state.keys else None
        state.tables = [list(table) for table in blocks.get_block_ids()]
        state.saved_upto = min(match.hit.num_chunks * self.chunk_size, state.num_prompt_tokens)  # stored already
        if tail is not None:
            state.keys = [*state.keys, tail.key]
            state.keys_end = tail.end
            if match.tail == tail:  # the prompt's own tail is stored: nothing of the prompt to save
                state.saved_upto = tail.end
        if num_external_tokens > 0:
            state.load = _TokenSpan(local, local + num_external_tokens)
            state.load_tail = match.tail if match.tail is not None and local + num_external_tokens > \
                match.hit.num_chunks * self.chunk_size else None
            if self.is_async:
                self.waiting.add(req_id)
        # tokens served from the worker's process memory (the rest from shared tiers), for vLLM's hit metrics
        in_memory = match.hit.num_in_memory * self.chunk_size
        if match.tail is not None and match.hit.num_in_memory == match.hit.num_chunks:
            in_memory = match.tail.end  # found with the whole chunks before it, taken to be where they are
        state.host_tokens = max(0, min(num_external_tokens, in_memory - local))

    def _own_tail(self, request: Request, keys: list[ChunkKey]) -> Tail | None:
        """The prompt's tokens past its last whole chunk, in whole steps, as a partial chunk to store."""
        tokens = request.prompt_token_ids or ()
        if not self.tail_step or len(keys) * self.chunk_size + self.tail_step > len(tokens):
            return None
        tails = self.lookup.tail_keys(tokens, keys, len(keys), self.tail_step, getattr(request, "cache_salt", None))
        return tails[-1] if tails else None

    def build_meta(self, out: SchedulerOutput) -> KVFabricMetadata:
        meta = KVFabricMetadata(is_idle=out.total_num_scheduled_tokens == 0)
        for req_id in sorted(self.waiting):
            state = self.states.get(req_id)
            if state is not None and state.load is not None:
                self._emit_load(meta, req_id, state, is_async=True)
        self.waiting.clear()
        for new in out.scheduled_new_reqs:
            state = self.states.get(new.req_id)
            if state is None:  # not seen by the lookup (should not happen): nothing to load or save
                continue
            state.tables = [list(table) for table in new.block_ids]
            self._plan(meta, new.req_id, state, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id], True)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.states.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed and new_blocks is not None:
                state.tables = [list(table) for table in new_blocks]  # a resumed request gets its whole tables
            elif new_blocks is not None:
                for table, added in zip(state.tables, new_blocks):
                    table.extend(added)
            self._plan(meta, req_id, state, cached.num_computed_tokens[i], out.num_scheduled_tokens[req_id], resumed)
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        self.is_finishing = self.hold_budget > 0 and any(
            0 < state.num_prompt_tokens - state.next_computed <= self.hold_budget
            for state in (self.states.get(req_id) for req_id in out.num_scheduled_tokens) if state is not None)
        return meta

    def _plan(self, meta: KVFabricMetadata, req_id: str, state: _ReqState, computed: int, scheduled: int,
              fresh: bool) -> None:
        cs = self.chunk_size
        if (not fresh and computed < state.next_computed) or computed < state.async_end:
            state.saved_upto = min(state.saved_upto, computed // cs * cs)  # a failed load: re-save from there
        state.async_end = 0
        state.next_computed = computed + scheduled
        if state.load is not None:
            self._emit_load(meta, req_id, state, is_async=False)
        if state.can_store and state.keys:
            stored_end = state.keys_end
            end = min(state.next_computed, stored_end)
            end = end if end == stored_end else end // cs * cs
            held = -(-self.groups.window_from(computed) // cs) * cs  # first chunk whose window blocks vLLM holds
            if state.saved_upto < min(held, end):  # hybrid manager: their window rows are gone, never stored
                self.window_chunks_skipped += (min(held, end) - state.saved_upto + cs - 1) // cs
                state.saved_upto = min(held, end)
            if end > state.saved_upto:
                meta.saves.append(SaveSpec(req_id, state.keys[state.saved_upto // cs:-(-end // cs)], state.saved_upto,
                                           end, *self._tables(state, end)))
                state.saved_upto = end

    def _emit_load(self, meta: KVFabricMetadata, req_id: str, state: _ReqState, is_async: bool) -> None:
        cs = self.chunk_size
        assert state.load is not None  # called only for a request with a load to emit
        start, end = state.load.start, state.load.end
        state.load = None
        state.async_end = end if is_async else 0
        block_ids, group_block_ids = self._tables(state, end)
        tail, state.load_tail = state.load_tail, None
        if tail is None:
            keys, keys_end = state.keys[start // cs:-(-end // cs)], state.keys_end
        else:  # whole chunks, then the partial one
            keys, keys_end = [*state.keys[start // cs:end // cs], tail.key], tail.end
        meta.loads.append(LoadSpec(req_id, keys, start, end, block_ids, is_async, keys_end, group_block_ids,
                                   self.groups.window_from(end)))
        state.stats += RequestStats(external_hit_tokens=end - start)

    def _tables(self, state: _ReqState, end: int) -> tuple[list[int], tuple[list[int], ...]]:
        """(block_ids, group_block_ids) of a spec covering tokens up to `end`: group 0's table, and every group's
        with several groups."""
        num = -(-end // self.block_size)
        tables = [table[:num] for table in state.tables] or [[]]
        return tables[0], tuple(tables) if self.groups.is_hybrid else ()

    def update(self, output: KVConnectorOutput) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVFabricWorkerMetadata):
            return
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
        self.waiting.discard(req_id)
        self.held.discard(req_id)


def allocated_blocks(out: SchedulerOutput) -> frozenset[int]:
    """Every block vLLM hands out in this step's output, in any group (the block pool is shared by all groups):
    new requests' and resumed ones' tables, running ones' new blocks, and the targets of its block copies."""
    found: set[int] = set()
    for new in out.scheduled_new_reqs:
        for table in new.block_ids:
            found.update(table)
    for groups in out.scheduled_cached_reqs.new_block_ids:
        for table in groups or ():
            found.update(table)
    found.update(copy.dst_block_id for copy in getattr(out, "kv_cache_block_copies", None) or ())
    found.discard(0)  # vLLM's null block: never written
    return frozenset(found)
