"""kvfabric as a vLLM V1 KV connector: ``KVFabricConnector`` (``KVConnectorBase_V1``). The only kvfabric module
that imports vLLM.

Use::

    from kvfabric.connectors.vllm import kv_transfer_config
    LLM(model, kv_transfer_config=kv_transfer_config({"tiers": ["cpu", "disk"], "disk": {"path": "/tmp/kv"}}))

which is ``{"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric.connectors.vllm",
"kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}``.

Configuration: ``kv_connector_extra_config`` holds kvfabric config keys (``Config``: chunk_size, tiers, disk.path,
...) plus the connector keys below. Precedence: extra config > ``KVFABRIC_*`` environment > YAML
(``config_file`` or ``$KVFABRIC_CONFIG``) > defaults.

    model_id             key namespace (default: the ``name`` in kvfabric's model marker, else the model path)
    config_file          YAML file with kvfabric config
    load_failure_policy  "recompute" (default: a bad chunk costs a recompute, never a failed request) or "fail";
                         written into vLLM's ``kv_load_failure_policy``
    stats_path           the worker writes its counters there as JSON (after steps that loaded, and at shutdown)
    save_queue_bytes     bound on gathered KV waiting for the background saver (default 1 GiB; beyond it, saves are
                         dropped and counted, never waited for)
    key_mode             "tokens" (default): kvfabric's chained token-id keys, shared with kvfabric's other engines;
                         requests with LoRA, multimodal inputs or a cache_salt are then not cached (token ids do not
                         name their KV). "vllm": chunk key = our namespace + vLLM's block hash of the chunk's last
                         block (which folds in LoRA, multimodal inputs, cache_salt); needs vLLM's prefix caching on
                         (the default) and chunk_size a multiple of the block size; shared only between vLLM engines
                         with the same prefix_caching_hash_algo (sha256 by default is reproducible across processes).

Per request, ``SamplingParams(extra_args={"kv_transfer_params": {"kvfabric": {"load": False, "store": False}}})``
turns loading or storing off. Each finished request's output carries ``kv_transfer_params["kvfabric"]``: external
and local hit tokens, tokens and bytes loaded per tier, failed tokens, tokens saved.

Design (vLLM 0.32, CPU backend; LLM, scheduler (EngineCore) and worker are three processes):

- Scheduler side. ``get_num_new_matched_tokens`` hashes the prompt into kvfabric chunk keys (the same chained keys
  ``CacheEngine`` uses, or vLLM's block hashes, see key_mode) and counts the leading chunks present, in (a) a mirror of the keys the worker reported
  stored in its process-memory tier (the reports ride back on ``build_connector_worker_meta``), or (b) a shared tier
  opened read-only in the scheduler process (disk: an index miss re-checks the filesystem, so stores by any
  process are seen; shm; redis). The answer is chunk-aligned, minus what vLLM already has; a hit covering the whole
  prompt leaves its last token to compute. Loads are synchronous (``is_async=False``), so vLLM sets
  ``has_sync_kv_loads`` for that step and the runner calls ``start_load_kv`` BEFORE the forward (it calls it after
  the forward only in steps without sync loads). ``build_connector_meta`` emits per step, with the chunk keys
  (the worker never hashes): loads (token range, block table) and saves (every whole prompt chunk that becomes
  complete this step and is not known to be stored, including chunks vLLM had cached locally).
- Worker side. ``start_load_kv`` reads and verifies the chunks (checksums; a corrupt chunk is deleted and counted)
  and keeps zero-copy views of the raw payloads (disk reads are memory-mapped, see ``_MmapDiskTier``); ``wait_for_layer_load(layer)`` scatters that layer into the
  allocated slots just before that layer's attention (layer by layer; a chunk holds all layers, so the reads
  themselves cannot be pipelined per layer). A missing or corrupt chunk ends the load there: the blocks from it to
  the end of the load go to ``get_block_ids_with_load_errors`` in the same step, vLLM (policy "recompute") rolls
  the request back to the first bad block and recomputes; saves of that request in that step are dropped (their
  KV was computed over bad blocks). ``save_kv_layer`` copies the KV of the finished chunks out of the paged cache
  right after the layer's attention, straight into the payload of the blob that will be stored (one copy; the
  blocks may be reused once the step ends), and ``wait_for_save`` hands them to a background thread that writes the
  chunk headers (checksums) and puts them into the tier stack (whose own writer thread does the disk writes): the
  step loop never waits for checksums, disk or network.
- Paged layout: see ``kvfabric.connectors.paged``. vLLM's CPU kernel stores K dim-major and V token-major inside
  each block; ``detect_cpu_kv_layout`` measures this at start-up with the kernel itself, so stored chunks are true
  [layers, 2, heads, tokens, head_dim] KV (equal to transformers' K/V: tests/test_vllm_connector.py).
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import mmap
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvfabric.codec.base import codec_for_id
from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, write_blob
from kvfabric.codec.raw import RawCodec, payload_view
from kvfabric.config import ENV_PREFIX, RESERVED_ENV, Config, ConfigError
from kvfabric.connectors.paged import REGION_LAYOUTS, CpuPagedLayer, blocks_of, gather, render_region, scatter
from kvfabric.engine import CacheEngine, build_tiers
from kvfabric.hashing import ChunkKey, chunk_keys, root_key
from kvfabric.layout import KVLayout
from kvfabric.tiers.base import Blob
from kvfabric.tiers.disk import DiskTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

CONNECTOR_KEYS = ("model_id", "config_file", "load_failure_policy", "stats_path", "save_queue_bytes", "key_mode")
KEY_MODES = ("tokens", "vllm")
PARAMS_KEY = "kvfabric"  # our entry in a request's kv_transfer_params
_TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def kv_transfer_config(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``kv_transfer_config`` argument of ``vllm.LLM`` for this connector."""
    extra = dict(extra or {})
    return {
        "kv_connector": "KVFabricConnector",
        "kv_connector_module_path": __name__,
        "kv_role": "kv_both",
        "kv_load_failure_policy": extra.get("load_failure_policy", "recompute"),
        "kv_connector_extra_config": extra,
    }


# ---- configuration -----------------------------------------------------------------------------------------
def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def resolve_config(extra: dict[str, Any] | None) -> tuple[Config, dict[str, Any]]:
    """Split ``kv_connector_extra_config`` into (kvfabric Config, connector options); see the module doc."""
    extra = dict(extra or {})
    options = {key: extra.pop(key) for key in CONNECTOR_KEYS if key in extra}
    policy = options.setdefault("load_failure_policy", "recompute")
    if policy not in ("recompute", "fail"):
        raise ConfigError(f"load_failure_policy: {policy!r} is not one of recompute, fail")
    if options.setdefault("key_mode", "tokens") not in KEY_MODES:
        raise ConfigError(f"key_mode: {options['key_mode']!r} is not one of {', '.join(KEY_MODES)}")
    base = Config.load(options.get("config_file"), environ=_config_environ())  # YAML + KVFABRIC_* env
    return Config.from_dict(_merge(base.to_dict(), extra)), options


def _config_environ() -> dict[str, str]:
    """os.environ minus KVFABRIC_* variables that are not config keys (KVFABRIC_TEST_MODEL_DIR, ...): an engine
    must not fail to start because of an unrelated variable."""
    fields = {f.name for f in dataclasses.fields(Config)}
    out = {}
    for name, value in os.environ.items():
        if name.startswith(ENV_PREFIX) and name not in RESERVED_ENV and \
                name[len(ENV_PREFIX):].lower().split("__")[0] not in fields:
            logger.debug("kvfabric: ignoring %s (not a config key)", name)
            continue
        out[name] = value
    return out


def layout_from_vllm(vllm_config: VllmConfig) -> KVLayout:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
        raise NotImplementedError("KVFabricConnector supports one worker (tensor and pipeline parallel size 1)")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None) and str(cache_dtype) not in _TORCH_DTYPES.values():
        raise NotImplementedError(f"KVFabricConnector does not support kv cache dtype {cache_dtype!r}")
    dtype = model.dtype if cache_dtype in ("auto", None) else getattr(torch, str(cache_dtype))
    if dtype not in _TORCH_DTYPES:
        raise NotImplementedError(f"KVFabricConnector does not support dtype {dtype}")
    return KVLayout(model.get_num_layers(parallel), model.get_num_kv_heads(parallel), model.get_head_size(),
                    _TORCH_DTYPES[dtype])


def model_id_from_vllm(vllm_config: VllmConfig, options: dict[str, Any]) -> str:
    if options.get("model_id"):
        return str(options["model_id"])
    model = str(vllm_config.model_config.model)
    marker = Path(model).expanduser() / "kvfabric_model.json"
    try:
        name = json.loads(marker.read_text()).get("name")
        if name:
            return str(name)
    except (OSError, ValueError, AttributeError):
        pass
    return str(Path(model).expanduser().resolve()) if Path(model).expanduser().is_dir() else model


def detect_cpu_kv_layout(num_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                         kv_cache_dtype: str = "auto") -> tuple[str, str]:
    """(K, V) region layouts ("td" token-major or "dt" dim-major) of vLLM's CPU attention cache, measured by
    letting the attention kernel write known keys and values into a scratch one-block cache."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(block_size, num_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(block_size, num_heads, head_dim, generator=gen).to(dtype)
    cache = torch.zeros(1, num_heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(1, num_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(block_size, dtype=torch.int64),
                                   isa, kv_cache_dtype=kv_cache_dtype)
    regions = cache.view(num_heads, 2, block_size * head_dim)
    found = []
    for which, values in ((0, key), (1, value)):
        match = [layout for layout in REGION_LAYOUTS
                 if all(torch.equal(regions[h, which], render_region(values[:, h, :], layout))
                        for h in range(num_heads))]
        if not match:
            raise NotImplementedError(f"KVFabricConnector: unknown CPU KV cache layout (isa {isa!r}, {dtype}, "
                                      f"block {block_size}, head_dim {head_dim}) for {'KV'[which]}")
        found.append(match[0])
    return found[0], found[1]


def _request_flags(request: Request) -> tuple[bool, bool]:
    params = getattr(request, "kv_transfer_params", None) or {}
    ours = params.get(PARAMS_KEY) or {} if isinstance(params, dict) else {}
    return bool(ours.get("load", True)), bool(ours.get("store", True))


# ---- metadata ----------------------------------------------------------------------------------------------
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
                self.requests[req_id] = _add_stats(self.requests.get(req_id, {}), stats)
            self.stored.extend(other.stored)
            self.removed.extend(other.removed)
        return self


def _add_stats(into: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    for key, value in more.items():
        if isinstance(value, dict):
            into[key] = _add_stats(dict(into.get(key, {})), value)
        else:
            into[key] = into.get(key, 0) + value
    return into


# ---- scheduler side ----------------------------------------------------------------------------------------
class _Lookup:
    """Which leading chunks of a prompt the worker can load: keys only, no chunk data is read."""

    def __init__(self, config: Config, layout: KVLayout, model_id: str) -> None:
        self.config = config
        self.chunk_size = config.chunk_size
        self.root = root_key(model_id, layout, config.chunk_size, config.salt, config.hash)
        # process memory is per process; a peer tier would make the scheduler a cluster member (not supported:
        # chunks that only peers hold are not reported as hits yet)
        shared = tuple(name for name in config.tiers if name not in ("cpu", "peer"))
        self.tiers = build_tiers(dataclasses.replace(config, tiers=shared)) if shared else []
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

    def prefix(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """(leading chunks present anywhere, how many of those are in the worker's memory tier)."""
        in_memory = [key in self.mirror for key in keys]
        present = list(in_memory)
        for tier in self.tiers:
            first = present.index(False) if False in present else len(keys)
            if first == len(keys):
                break
            for i, hit in enumerate(tier.contains_many(keys[first:]), start=first):
                present[i] = present[i] or hit
        num = present.index(False) if False in present else len(keys)
        return num, sum(in_memory[:num])

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
    load: tuple[int, int] | None = None  # token range to load in the next step
    host_tokens: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


class _SchedulerSide:
    def __init__(self, config: Config, layout: KVLayout, model_id: str, block_size: int, key_mode: str) -> None:
        self.chunk_size = config.chunk_size
        self.block_size = block_size
        self.key_mode = key_mode
        if key_mode == "vllm" and config.chunk_size % block_size:
            raise ConfigError(f"key_mode vllm needs chunk_size ({config.chunk_size}) to be a multiple of vLLM's "
                              f"block size ({block_size})")
        self.lookup = _Lookup(config, layout, model_id)
        self._warned: set[str] = set()
        self.states: dict[str, _ReqState] = {}
        self.keys: dict[str, list[ChunkKey]] = {}  # per request: keys of its prompt's whole chunks
        self.pending: dict[str, tuple[int, int, int]] = {}  # req -> (chunks present, in memory, local tokens)

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
        if not keys:
            self.pending[req_id] = (0, 0, num_computed_tokens)
            return 0
        num_chunks, in_memory = self.lookup.prefix(keys)
        self.pending[req_id] = (num_chunks, in_memory, num_computed_tokens)
        hit = min(num_chunks * self.chunk_size, request.num_tokens - 1)  # a full hit leaves one token to compute
        return max(0, hit - num_computed_tokens)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        state = self.states.get(request.request_id)
        host = min(num_external_tokens, state.host_tokens) if state is not None else 0
        out = {CacheHitSource.HOST: host, CacheHitSource.DISK: num_external_tokens - host}
        return {source: n for source, n in out.items() if n > 0}

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        _, store = _request_flags(request)
        state = self.states.get(req_id)
        if state is None:
            state = self.states[req_id] = _ReqState(len(request.prompt_token_ids or ()), can_store=store)
        state.keys = self.request_keys(request)
        num_chunks, in_memory, local = self.pending.pop(req_id, (0, 0, 0))
        state.block_ids = list(blocks.get_block_ids()[0])
        state.saved_upto = num_chunks * self.chunk_size  # already stored: never gathered again
        if num_external_tokens > 0:
            state.load = (local, local + num_external_tokens)
        # tokens served from the worker's process memory (the rest from shared tiers), for vLLM's hit metrics
        state.host_tokens = max(0, min(num_external_tokens, in_memory * self.chunk_size - local))
        state.stats.setdefault("local_hit_tokens", local)

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
            start, end = state.load
            state.load = None
            meta.loads.append(LoadSpec(req_id, state.keys[start // cs:-(-end // cs)], start, end,
                                       state.block_ids[:-(-end // bs)]))
            state.stats["external_hit_tokens"] = state.stats.get("external_hit_tokens", 0) + end - start
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
                _add_stats(state.stats, stats)

    def finished(self, request: Request) -> dict[str, Any] | None:
        state = self.states.get(request.request_id)
        self.forget(request.request_id)
        return {PARAMS_KEY: dict(state.stats)} if state is not None else None

    def forget(self, req_id: str) -> None:
        self.states.pop(req_id, None)
        self.keys.pop(req_id, None)
        self.pending.pop(req_id, None)


# ---- worker side -------------------------------------------------------------------------------------------
@dataclass
class _ActiveLoad:
    spec: LoadSpec
    end: int  # tokens [spec.start, end) were read; end < spec.end after a failure
    sources: list[tuple[int, torch.Tensor]]  # (first token of the chunk, chunk KV [L, 2, H, C, D])
    layers_done: set[int] = field(default_factory=set)


@dataclass
class _ActiveSave:
    spec: SaveSpec
    # (first token, chunk KV [L, 2, H, C, D], its blob): with the raw codec the KV is gathered straight into the
    # payload of the blob that will be stored (no encode copy); otherwise blob is None and the codec encodes it
    chunks: list[tuple[int, torch.Tensor, memoryview | None]]
    layers_done: set[int] = field(default_factory=set)

    @property
    def num_bytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for _, kv, _ in self.chunks)


class _WorkerSide:
    def __init__(self, config: Config, layout: KVLayout, model_id: str, block_size: int,
                 options: dict[str, Any]) -> None:
        self.config = config
        self.layout = layout
        self.chunk_size = config.chunk_size
        self.block_size = block_size
        if "peer" in config.tiers:  # a cluster node wires its own local tiers: keep them as built
            tiers = build_tiers(config)
        else:
            tiers = [_MmapDiskTier(config.disk.resolved_path(), config.disk.capacity, fsync=config.disk.fsync)
                     if name == "disk" else build_tiers(dataclasses.replace(config, tiers=(name,)))[0]
                     for name in config.tiers]
        self.engine = CacheEngine(config, layout, model_id, tiers=tiers)
        self.layers: dict[str, tuple[int, CpuPagedLayer]] = {}
        self.region_layouts: tuple[str, str] | None = None  # (K, V), measured on first use
        self.counters: Counter[str] = Counter()
        self.stats_path = options.get("stats_path")
        self.save_queue_bytes = int(options.get("save_queue_bytes") or 2**30)
        # per step
        self.meta: KVFabricMetadata | None = None
        self.loads_read = False
        self.loads: list[_ActiveLoad] = []
        self.saves: list[_ActiveSave] = []
        self.failed_reqs: set[str] = set()
        self.step_stats: dict[str, dict[str, Any]] = {}
        self.invalid_blocks: set[int] = set()
        # saver thread
        self._queue: queue.Queue[_ActiveSave | None] = queue.Queue()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._stored_keys: list[bytes] = []
        self._reported: set[bytes] = set()
        self._tier_touched = False  # a load may have promoted (and so evicted) memory-tier entries
        self._saver = threading.Thread(target=self._save_loop, name="kvfabric-saver", daemon=True)
        self._saver.start()
        self._closed = False
        atexit.register(self.close)

    # -- layers
    def _paged(self, kv: torch.Tensor) -> CpuPagedLayer:
        if self.region_layouts is None:
            self.region_layouts = detect_cpu_kv_layout(self.layout.num_kv_heads, self.layout.head_dim,
                                                       self.block_size, self.layout.torch_dtype)
            logger.info("kvfabric: CPU KV cache regions: K %s, V %s", *self.region_layouts)
        return CpuPagedLayer(kv, self.block_size, *self.region_layouts)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index
        for name, kv in kv_caches.items():
            self.layers[name] = (extract_layer_index(name), self._paged(kv))
        indices = sorted(index for index, _ in self.layers.values())
        some = next(iter(self.layers.values()))[1] if self.layers else None
        if (indices != list(range(self.layout.num_layers)) or some is None or some.num_heads !=
                self.layout.num_kv_heads or some.head_dim != self.layout.head_dim or
                some.dtype != self.layout.torch_dtype):
            shapes = [(name, tuple(kv.shape), kv.dtype) for name, kv in list(kv_caches.items())[:2]]
            raise ValueError(f"KVFabricConnector: KV caches {shapes}... do not match the layout {self.layout}")

    def _layer(self, name: str, kv: torch.Tensor | None = None) -> tuple[int, CpuPagedLayer] | None:
        found = self.layers.get(name)
        if found is None and kv is not None:
            from vllm.model_executor.models.utils import extract_layer_index
            found = self.layers[name] = (extract_layer_index(name), self._paged(kv))
        return found

    # -- step
    def bind(self, meta: KVConnectorMetadata) -> None:
        self.meta = meta if isinstance(meta, KVFabricMetadata) else None
        self.loads_read = False
        self.loads = []
        self.saves = []
        self.failed_reqs = set()

    def read_loads(self) -> None:
        """Read and verify every chunk this step loads (before the forward: the loads are synchronous)."""
        if self.loads_read or self.meta is None:
            return
        self.loads_read = True
        self._tier_touched = self._tier_touched or bool(self.meta.loads)
        for spec in self.meta.loads:
            started = time.perf_counter()
            stats = self.step_stats.setdefault(spec.req_id, {})
            cs = self.chunk_size
            end, sources = spec.end, []
            first = spec.start // cs
            for i in range(first, -(-spec.end // cs)):
                kv = self._read_chunk(spec.keys[i - first], stats)
                if kv is None:
                    end = max(spec.start, i * cs)
                    break
                sources.append((i * cs, kv))
            if end < spec.end:
                bad = blocks_of(spec.block_ids, self.block_size, end, spec.end)
                self.invalid_blocks.update(bad)
                self.failed_reqs.add(spec.req_id)
                stats["failed_tokens"] = stats.get("failed_tokens", 0) + spec.end - end
                self.counters["load_failed_tokens"] += spec.end - end
                logger.warning("kvfabric: request %s: chunk at token %d missing or corrupt; %d tokens (blocks %s...) "
                               "will be recomputed", spec.req_id, end, spec.end - end, bad[:4])
            stats["loaded_tokens"] = stats.get("loaded_tokens", 0) + end - spec.start
            elapsed = time.perf_counter() - started
            stats["load_read_s"] = stats.get("load_read_s", 0.0) + elapsed
            self.counters["load_read_ns"] += int(elapsed * 1e9)
            self.counters["loaded_tokens"] += end - spec.start
            self.loads.append(_ActiveLoad(spec, end, sources))

    def _read_chunk(self, key: bytes, stats: dict[str, Any]) -> torch.Tensor | None:
        layout, cs = self.layout, self.chunk_size
        found = self.engine.stack.get(key)  # checksums verified for untrusted tiers; a bad blob is deleted
        if found is None:
            self.counters["load_missing_chunks"] += 1
            return None
        blob, header, tier = found
        try:
            if header.fingerprint != layout.fingerprint or header.shape != layout.shape(cs):
                raise ChunkFormatError(f"chunk made for another layout {header.shape}")
            if (header.codec_id == RawCodec.codec_id and header.dtype_code == layout.dtype_code
                    and header.payload_len == layout.num_bytes(cs)):
                kv = payload_view(blob, layout.torch_dtype, header.shape)  # zero copy: scattered per layer
            else:
                kv = torch.empty(layout.shape(cs), dtype=layout.torch_dtype)
                codec_for_id(header.codec_id).decode(header, memoryview(blob), layout, kv)
        except ChunkFormatError as exc:
            logger.warning("kvfabric: dropping undecodable chunk %s: %s", key.hex()[:16], exc)
            self.engine.stack.discard(key)
            self.counters["load_corrupt_chunks"] += 1
            return None
        by_tier = stats.setdefault("bytes", {})
        by_tier[tier] = by_tier.get(tier, 0) + len(blob)
        self.counters[f"bytes_loaded.{tier}"] += len(blob)
        return kv

    def layer_load(self, name: str) -> None:
        if self.meta is None or not self.meta.loads:
            return
        self.read_loads()
        found = self._layer(name)
        if found is None:
            return
        index, layer = found
        cs = self.chunk_size
        started = time.perf_counter_ns()
        for load in self.loads:
            if index in load.layers_done:
                continue
            spec = load.spec
            for first, kv in load.sources:
                lo, hi = max(spec.start, first), min(load.end, first + cs)
                if lo < hi:
                    scatter(layer, spec.block_ids, lo, hi, kv[index, :, :, lo - first:hi - first, :])
            load.layers_done.add(index)
        self.counters["load_scatter_ns"] += time.perf_counter_ns() - started

    def layer_save(self, name: str, kv_layer: torch.Tensor) -> None:
        if self.meta is None or not self.meta.saves:
            return
        found = self._layer(name, kv_layer)
        if found is None:
            return
        index, layer = found
        started = time.perf_counter_ns()
        cs = self.chunk_size
        if not self.saves:
            self.saves = [_ActiveSave(spec, [(first, *self._chunk_buffer())
                                             for first in range(spec.start, spec.end, cs)])
                          for spec in self.meta.saves]
        for save in self.saves:
            if save.spec.req_id in self.failed_reqs or index in save.layers_done:
                continue
            for first, kv, _ in save.chunks:
                gather(layer, save.spec.block_ids, first, first + cs, kv[index])
            save.layers_done.add(index)
        self.counters["save_gather_ns"] += time.perf_counter_ns() - started

    def _chunk_buffer(self) -> tuple[torch.Tensor, memoryview | None]:
        """Where one chunk's KV is gathered: the payload of a raw-codec blob (uninitialized memory, filled by the
        gather, header written by the saver) or, for other codecs, a plain tensor."""
        layout, shape = self.layout, self.layout.shape(self.chunk_size)
        if self.engine.codec.codec_id != RawCodec.codec_id:
            return torch.empty(shape, dtype=layout.torch_dtype), None
        buf = torch.empty(HEADER_BYTES + layout.num_bytes(self.chunk_size), dtype=torch.uint8)
        return buf[HEADER_BYTES:].view(layout.torch_dtype).view(shape), memoryview(buf.numpy())

    def end_step(self) -> None:
        num_layers = self.layout.num_layers
        for load in self.loads:  # a load not scattered into every layer before attention: let vLLM recompute
            if len(load.layers_done) < num_layers and load.end > load.spec.start:
                self.invalid_blocks.update(blocks_of(load.spec.block_ids, self.block_size, load.spec.start,
                                                     load.spec.end))
                self.failed_reqs.add(load.spec.req_id)
                self.counters["load_not_applied"] += 1
        if self.meta is not None and self.meta.loads and not self.loads_read:
            for spec in self.meta.loads:  # start_load_kv / wait_for_layer_load never ran for them
                self.invalid_blocks.update(blocks_of(spec.block_ids, self.block_size, spec.start, spec.end))
                self.counters["load_not_applied"] += 1
        for save in self.saves:
            spec = save.spec
            if spec.req_id in self.failed_reqs or len(save.layers_done) < num_layers:
                self.counters["saves_dropped_incomplete"] += 1
                continue
            size = save.num_bytes
            with self._lock:
                if self._queued_bytes + size > self.save_queue_bytes:
                    self.counters["saves_dropped_queue_full"] += 1
                    continue
                self._queued_bytes += size
            self._queue.put(save)
            stats = self.step_stats.setdefault(spec.req_id, {})
            stats["saved_tokens"] = stats.get("saved_tokens", 0) + spec.end - spec.start
        if self.stats_path and self.meta is not None and self.meta.loads:
            self.write_stats()
        self.saves = []
        self.loads = []

    def _save_loop(self) -> None:
        while (save := self._queue.get()) is not None:
            spec = save.spec
            try:
                started = time.perf_counter_ns()
                num = sum(self._store_chunk(key, kv, blob) for key, (_, kv, blob) in zip(spec.keys, save.chunks))
                self.counters["save_store_ns"] += time.perf_counter_ns() - started
                self.counters["chunks_stored"] += num
                if self.stats_path:
                    self.write_stats()
                if "cpu" in self.config.tiers:
                    with self._lock:
                        self._stored_keys.extend(spec.keys)
            except Exception:  # a bug here must not kill the saver
                logger.exception("kvfabric: storing KV of request %s failed", spec.req_id)
                self.counters["save_errors"] += 1
            finally:
                with self._lock:
                    self._queued_bytes -= save.num_bytes
                self._queue.task_done()
        self._queue.task_done()

    def _store_chunk(self, key: bytes, kv: torch.Tensor, blob: memoryview | None) -> bool:
        """CacheEngine.store for one chunk whose key the scheduler computed (either key mode)."""
        engine, layout = self.engine, self.layout
        if engine.stack.contains_many([key], writable_only=True)[0]:
            return False
        if blob is None:
            blob = engine.codec.encode(kv, key, layout)
        else:  # raw codec: the payload is already in place (RawCodec.encode without its copy)
            write_blob(ChunkHeader(RawCodec.codec_id, layout.dtype_code, 0, layout.fingerprint, tuple(kv.shape),
                                   key, len(blob) - HEADER_BYTES), blob)
        engine.stack.put(key, blob)
        engine.counters["chunks_stored"] += 1
        return True

    def worker_meta(self) -> KVFabricWorkerMetadata | None:
        with self._lock:
            stored, self._stored_keys = self._stored_keys, []
        removed: list[bytes] = []
        if "cpu" in self.config.tiers:
            self._reported.update(stored)
            cpu = self.engine.stack.tiers[self.config.tiers.index("cpu")]
            if stored or self._tier_touched or cpu.usage().num_chunks < len(self._reported):
                present = set(cpu.keys())
                removed = [key for key in self._reported if key not in present]
                self._reported.difference_update(removed)
        self._tier_touched = False
        requests, self.step_stats = self.step_stats, {}
        if not (requests or stored or removed):
            return None
        return KVFabricWorkerMetadata(requests, list(stored), removed)

    def take_invalid_blocks(self) -> set[int]:
        out, self.invalid_blocks = self.invalid_blocks, set()
        return out

    def stats(self) -> dict[str, Any]:
        for _ in range(3):  # the saver thread may bump a counter while we copy them
            try:
                engine = self.engine.stats()
                break
            except RuntimeError:
                time.sleep(0.001)
        else:
            engine = {"counters": {}, "tiers": []}
        return {"connector": dict(self.counters), "engine": engine["counters"],
                "tiers": [dataclasses.asdict(usage) for usage in engine["tiers"]]}

    def write_stats(self) -> None:
        path = Path(self.stats_path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.stats(), indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("kvfabric: cannot write stats to %s: %s", path, exc)

    def flush(self) -> None:
        self._queue.join()
        self.engine.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
            self._queue.put(None)
            self._saver.join(timeout=30)
            if self.stats_path:
                self.write_stats()
            self.engine.close()
        except Exception:  # shutdown must not raise
            logger.exception("kvfabric: shutdown failed")


class _MmapDiskTier(DiskTier):
    """DiskTier whose reads map the file instead of copying it into a fresh buffer (no allocation, no page
    faults on new memory, no copy): a 366 MB 8k-token load costs a checksum pass and the scatter. Chunk files are
    only ever replaced atomically (os.replace), never rewritten in place, so a mapping stays valid and immutable."""

    def get(self, key: bytes) -> Blob | None:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                blob = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # missing, or empty (mmap of 0 bytes)
            self._index.remove(key)
            return None
        if not self._index.touch(key):
            self._adopt(key)
        try:
            os.utime(path)  # keeps LRU order across restarts
        except OSError:
            pass
        return blob


# ---- the connector -----------------------------------------------------------------------------------------
class KVFabricConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector backed by a kvfabric CacheEngine (see the module doc)."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config, self.options = resolve_config(transfer.kv_connector_extra_config)
        self.layout = layout_from_vllm(vllm_config)
        self.model_id = model_id_from_vllm(vllm_config, self.options)
        block_size = vllm_config.cache_config.block_size
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            policy = self.options["load_failure_policy"]
            if transfer.kv_load_failure_policy != policy:
                try:  # read by the scheduler right after it creates the connector
                    transfer.kv_load_failure_policy = policy
                except Exception:  # pragma: no cover - a frozen config
                    logger.warning("kvfabric: cannot set kv_load_failure_policy=%s; a bad chunk fails its request",
                                   policy)
            self._scheduler = _SchedulerSide(self.config, self.layout, self.model_id, block_size,
                                             self.options["key_mode"])
        else:
            self._worker = _WorkerSide(self.config, self.layout, self.model_id, block_size, self.options)
        logger.info("kvfabric connector (%s): model_id=%s layout=%s chunk_size=%d tiers=%s", role.name,
                    self.model_id, self.layout, self.config.chunk_size, ",".join(self.config.tiers))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    # ---- worker ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.read_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.layer_save(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_invalid_blocks() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.lookup.close()

    # ---- scheduler ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens), False

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        return self._scheduler.hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = self._scheduler.finished(request) if self._scheduler is not None else None
        return False, params
