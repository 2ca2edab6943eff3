"""``KVFabricConnector``: vLLM's ``KVConnectorBase_V1`` hooks, delegated to the side this instance plays.

Contract:
- vLLM creates one instance per role: SCHEDULER (in EngineCore; hooks go to ``SchedulerSide``) and WORKER (in
  the model runner; hooks go to ``WorkerSide``). A hook of the other side is a no-op or an empty answer; a
  scheduler hook on a worker instance is a bug (assert).
- Both sides derive the same kvfabric Config, KVLayout and model id from vLLM's config (``config``), so the
  scheduler's chunk keys name what the worker stores.
- ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on (``kv_cache_groups``). With one KV cache group of
  full-attention blocks (a model without window layers, or the manager turned off) one block table serves
  every layer. With several groups (Gemma 3: five sliding-window groups and one full-attention group) the specs
  carry a block table per group and the worker maps each layer to its group; window layers are loaded only
  from the first block vLLM allocated for them (before it: its null block; rows older than the window are
  never read), and saved only for chunks whose window blocks vLLM still holds (C < W-1: every chunk saved in
  the step that completes it qualifies; older ones, e.g. vLLM's own prefix-cache hits, are skipped). A failed
  load is reported as a failed receive (vLLM cannot map block ids of several groups back to requests), so the
  request is recomputed from its start. Anything else is refused at start-up.
- Loads are asynchronous by default (``load_mode: async``: ``get_num_new_matched_tokens`` answers
  ``is_async=True``, the request waits in WAITING_FOR_REMOTE_KVS while other requests run, ``get_finished``
  reports its load once the KV is in place, a failed chunk's blocks through ``get_block_ids_with_load_errors``
  in the same pass), or synchronous and layer-wise (``load_mode: layerwise``: ``start_load_kv`` starts them,
  ``wait_for_layer_load`` waits for one layer). On the CPU the connector never delays a request's
  blocks (``request_finished`` answers False): it is a cache, so a dropped save is a future miss
  (``requires_kv_delivery`` is False).
- On a GPU (vLLM's device is not the CPU), and for an MLA model's latent cache on any device (vLLM's CPU_MLA
  backend included), the worker is a ``DeviceWorkerSide`` (``device``): saves are copied out
  of the blocks after the step on a side stream, so ``request_finished`` answers True for a request that had a
  save, and ``get_finished`` reports it sent once those copies landed; the step's metadata lists the blocks
  vLLM hands out (``new_block_ids``) and ``handle_preemptions`` waits only for copies still reading one of them
  (a preempted request's blocks, a window block that slid out). vLLM's hybrid manager works there as on the CPU.
  ``get_required_kvcache_layout`` asks vLLM for the connector's ``kv_cache_layout`` (BLHNC).
- vLLM's ``kv_role`` (``role_of``): a ``kv_producer`` (P/D prefill) loads hits (the pool is its prefix cache too),
  stores, and ends each step only once its KV is stored; a ``kv_consumer`` (P/D decode) loads and never stores;
  ``kv_both`` loads and stores.
- The scheduler instance writes the configured load_failure_policy into vLLM's ``kv_load_failure_policy``
  (vLLM reads it right after creating the connector).
- Metrics and KV events go through vLLM's own channels (``metrics``): per-step ``KVFabricStats`` from both sides,
  made into kvfabric_* metrics of vLLM's registry by ``build_prom_metrics``; with ``--kv-events-config`` the
  worker's chunk events reach the scheduler, which yields them from ``take_events`` as BlockStored / BlockRemoved.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvfabric.connectors.lookup import EveryRank, LookupClient, lookup_path
from kvfabric.connectors.vllm.config import (
    describe_groups,
    for_rank,
    kv_cache_groups,
    kv_cache_layout_option,
    layout_from_vllm,
    model_id_from_vllm,
    resolve_config,
    role_of,
    share_from_vllm,
)
from kvfabric.connectors.vllm.device import DeviceWorkerSide
from kvfabric.connectors.vllm.metrics import (
    EngineStatsSource,
    KVFabricKVEvents,
    KVFabricPromMetrics,
    KVFabricStats,
    LookupStats,
    SchedulerEvents,
    worker_events,
)
from kvfabric.connectors.vllm.scheduler import SchedulerSide, allocated_blocks
from kvfabric.connectors.vllm.worker import WorkerSide
from kvfabric.kv.shares import num_writers

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class KVFabricConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM V1 KV connector backed by a kvfabric CacheEngine (see the package doc)."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config, self.options = resolve_config(transfer.kv_connector_extra_config)
        self.layout = layout_from_vllm(vllm_config)
        self.model_id = model_id_from_vllm(vllm_config, self.options)
        self.kv_role = role_of(transfer.kv_role)
        self.groups = kv_cache_groups(kv_cache_config, self.layout, vllm_config.cache_config.block_size,
                                      self.config.chunk_size, self.options["load_mode"])
        block_size = self.groups.block_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._vllm_config = vllm_config
        # vLLM's GPU backends, and MLA latents on any device (the CPU backend's paged layer knows only K|V regions):
        # PagedMover saves copy out of the blocks after the step (device.py), so a request that saved keeps its
        # blocks until the worker reports the copies landed
        self._uses_mover = vllm_config.device_config.device_type != "cpu" or self.layout.is_latent
        self._saving: set[str] = set()  # (scheduler) requests with a save scheduled, on a device
        events_config = getattr(vllm_config, "kv_events_config", None)
        has_events = bool(events_config is not None and events_config.enable_kv_cache_events)
        self._lookups = LookupStats()
        ranks = vllm_config.parallel_config
        writers = num_writers(self.layout, ranks.pipeline_parallel_size, ranks.tensor_parallel_size)
        self._events = SchedulerEvents(self.config.chunk_size, writers) if has_events else None
        self._engine_stats: EngineStatsSource | None = None
        if role == KVConnectorRole.SCHEDULER:
            policy = self.options["load_failure_policy"]
            if transfer.kv_load_failure_policy != policy:
                try:  # read by the scheduler right after it creates the connector
                    transfer.kv_load_failure_policy = policy
                except Exception:  # pragma: no cover - a frozen config
                    logger.warning("kvfabric: cannot set kv_load_failure_policy=%s; a bad chunk fails its request",
                                   policy)
            world = ranks.tensor_parallel_size * ranks.pipeline_parallel_size
            clients = [LookupClient(self._lookup_path(rank)) for rank in range(world)]
            self._scheduler = SchedulerSide(self.config, self.layout, self.model_id, block_size,
                                             self.options["key_mode"], self.options["load_mode"], self.kv_role,
                                             self.groups, client=clients[0] if world == 1 else EveryRank(clients),
                                             hold_budget=vllm_config.scheduler_config.max_num_batched_tokens
                                             if self.options["hold_newcomers"] else 0,
                                             tail_step=self.options["tail_step"])
        else:
            side = DeviceWorkerSide if self._uses_mover else WorkerSide
            # each worker answers the scheduler's lookups for its share of the model's KV (connectors/lookup.py)
            share, parallel = share_from_vllm(vllm_config, self.layout)
            rank = ranks.rank or 0
            config, options = for_rank(self.config, self.options, rank)
            self._worker = side(config, self.layout, self.model_id, block_size, options,
                                is_sync_store=self.kv_role.is_sync_store, groups=self.groups,
                                events=worker_events(self.config.chunk_size) if has_events else None,
                                lookup_path=self._lookup_path(rank), share=share,
                                parallel=parallel)
            self._engine_stats = EngineStatsSource(self._worker.engine, rank=rank)
        logger.info("kvfabric connector (%s): model_id=%s layout=%s chunk_size=%d tiers=%s kv cache groups: %s "
                    "(block size %d)", role.name, self.model_id, self.layout, self.config.chunk_size,
                    ",".join(self.config.tiers), describe_groups(kv_cache_config), block_size)

    def _lookup_path(self, rank: int = 0) -> str:
        """Where this engine's scheduler asks worker `rank`'s cache (vLLM's engine id: the same on both)."""
        config = self._vllm_config
        return lookup_path(config.kv_transfer_config.engine_id, config.parallel_config.data_parallel_rank or 0, rank)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    # ---- worker ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        if isinstance(self._worker, DeviceWorkerSide):
            self._worker.register(kv_caches, self._vllm_config.cache_config.get_resolved_kv_cache_layout().name)
        else:
            self._worker.register(kv_caches)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """On a GPU, the layout named by the connector's ``kv_cache_layout`` (default BLHNC: block-outermost, so
        a block's KV for every layer is one contiguous run, the fewest and largest copies; vLLM falls back to its
        own choice, with a warning, where the backend cannot use it). None on CPU: its backend has one layout."""
        transfer = vllm_config.kv_transfer_config
        if vllm_config.device_config.device_type == "cpu" or transfer is None:
            return None
        return kv_cache_layout_option(transfer.kv_connector_extra_config) or None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads wait per layer inside the forward: a CUDA graph would skip those waits."""
        return (extra_config or {}).get("load_mode") == "layerwise"

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None:
            self._worker.fence(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_loads()

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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        sent, received = self._worker.finished(finished_req_ids)
        return sent or None, received or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if self._worker is not None:  # several KV cache groups: a failed load is a failed receive
            results.failed_recving = self._worker.take_failed_loads()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_invalid_blocks() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.worker_meta() if self._worker is not None else None

    # ---- metrics and KV events (vLLM's channels; see kvfabric.connectors.vllm.metrics) ----
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._engine_stats is not None:
            stats = self._engine_stats.take()
            return None if stats.is_empty() else stats
        return self._lookups.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVFabricStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVFabricPromMetrics:
        return KVFabricPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_kv_cache_events(self) -> KVFabricKVEvents | None:
        engine = self._worker.engine if self._worker is not None else None
        if engine is None or engine.events is None:
            return None
        engine.sweep_events()
        events = engine.events.take()
        return KVFabricKVEvents(events) if events else None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._events.take() if self._events is not None else ()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.lookup.close()

    # ---- scheduler ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        num = self._scheduler.num_new_matched_tokens(request, num_computed_tokens)
        if num is None:  # held for a step: asked again then
            return None, False
        self._lookups.record(request.num_tokens, num_computed_tokens + num)
        if self._events is not None:
            self._events.remember(request.request_id, list(request.prompt_token_ids or ()),
                                  self._scheduler.request_keys(request))
        return num, bool(num) and self._scheduler.is_async

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        return self._scheduler.hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._scheduler.build_meta(scheduler_output)
        if self._uses_mover:  # saves copy out after the step: the worker fences the blocks handed out again
            self._saving.update(save.req_id for save in meta.saves)
            meta.new_block_ids = allocated_blocks(scheduler_output)
        if self._events is not None:
            for save in meta.saves:
                self._events.saving(save.req_id, save.start, save.end)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update(connector_output)
        if self._events is not None:
            self._events.update(getattr(connector_output, "kv_cache_events", None))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = self._scheduler.finished(request) if self._scheduler is not None else None
        if self._events is not None:
            self._events.forget(request.request_id)
        is_saving = request.request_id in self._saving  # its copies may still be landing (a device's saves)
        self._saving.discard(request.request_id)
        return is_saving, params

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """SupportsHMA's request_finished: every group's blocks are held alike (True: a save's copies may still be
        reading them)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])
