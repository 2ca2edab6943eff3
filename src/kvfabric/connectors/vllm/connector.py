"""``KVFabricConnector``: vLLM's ``KVConnectorBase_V1`` hooks, delegated to the side this instance plays.

Contract:
- vLLM creates one instance per role: SCHEDULER (in EngineCore; hooks go to ``SchedulerSide``) and WORKER (in
  the model runner; hooks go to ``WorkerSide``). A hook of the other side is a no-op or an empty answer; a
  scheduler hook on a worker instance is a bug (assert).
- Both sides derive the same kvfabric Config, KVLayout and model id from vLLM's config (``config``), so the
  scheduler's chunk keys name what the worker stores.
- Loads are synchronous (``get_num_new_matched_tokens`` answers ``is_async=False``) and the connector never
  delays a request's blocks (``request_finished`` answers False): it is a cache, so a dropped save is a future
  miss (``requires_kv_delivery`` is False).
- The scheduler instance writes the configured load_failure_policy into vLLM's ``kv_load_failure_policy``
  (vLLM reads it right after creating the connector).
"""
from __future__ import annotations

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

from kvfabric.connectors.vllm.config import layout_from_vllm, model_id_from_vllm, resolve_config
from kvfabric.connectors.vllm.scheduler import SchedulerSide
from kvfabric.connectors.vllm.worker import WorkerSide

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


class KVFabricConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector backed by a kvfabric CacheEngine (see the package doc)."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config, self.options = resolve_config(transfer.kv_connector_extra_config)
        self.layout = layout_from_vllm(vllm_config)
        self.model_id = model_id_from_vllm(vllm_config, self.options)
        block_size = vllm_config.cache_config.block_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            policy = self.options["load_failure_policy"]
            if transfer.kv_load_failure_policy != policy:
                try:  # read by the scheduler right after it creates the connector
                    transfer.kv_load_failure_policy = policy
                except Exception:  # pragma: no cover - a frozen config
                    logger.warning("kvfabric: cannot set kv_load_failure_policy=%s; a bad chunk fails its request",
                                   policy)
            self._scheduler = SchedulerSide(self.config, self.layout, self.model_id, block_size,
                                             self.options["key_mode"])
        else:
            self._worker = WorkerSide(self.config, self.layout, self.model_id, block_size, self.options)
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
