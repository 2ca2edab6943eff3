"""Worker side of the connector (vLLM's model-runner process): the step's loads, per-layer copies, load errors.

Contract, per step (vLLM calls the hooks in this order; loads are synchronous, so `read_loads` runs before the
forward):
- `bind(meta)`: the step's ``KVFabricMetadata`` (loads and saves with their chunk keys; the worker never hashes).
- `read_loads()`: reads and verifies every chunk the step loads (``CacheEngine.read_chunk``: checksums, layout;
  a corrupt chunk is deleted and counted) and keeps zero-copy views of the raw payloads. A missing or corrupt chunk ends
  that load there: the blocks from it to the end of the load are reported by `take_invalid_blocks` in the same
  step, vLLM (policy "recompute") rolls the request back to the first bad block and recomputes, and the
  request's saves of this step are dropped (their KV was computed over bad blocks).
- `layer_load(layer)`: scatters that layer of every loaded chunk into the allocated slots, just before the
  layer's attention. A chunk holds all layers, so the reads themselves cannot be pipelined per layer.
- `layer_save(layer, kv)`: right after the layer's attention, gathers the KV of the step's finished chunks out of
  the paged cache into engine payloads (``CacheEngine.new_payload``) that the ``Saver`` stores (one copy; the
  blocks may be reused once the step ends).
- `end_step()`: a load not scattered into every layer has its blocks reported (recompute), a save not gathered
  from every layer is dropped; complete saves go to the ``Saver`` (dropped and counted when its queue is full).
- `worker_meta()`: per-request ``RequestStats`` of the step, and the keys that entered or left the process-memory
  tier (the scheduler mirrors them for its lookups).
Paged layout: ``kvfabric.connectors.paged``; the K/V region layouts are measured at first use
(``detect_cpu_kv_layout``), so stored chunks are true [layers, 2, heads, tokens, head_dim] KV.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from kvfabric.config import Config
from kvfabric.counters import Counters
from kvfabric.connectors.paged import CpuPagedLayer, blocks_of, gather, scatter
from kvfabric.connectors.vllm.config import detect_cpu_kv_layout
from kvfabric.connectors.vllm.metadata import KVFabricMetadata, KVFabricWorkerMetadata, LoadSpec, RequestStats
from kvfabric.connectors.vllm.reads import ChunkReader
from kvfabric.connectors.vllm.saver import ActiveSave, Saver
from kvfabric.engine import CacheEngine, ChunkMiss
from kvfabric.layout import KVLayout

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

logger = init_logger(__name__)


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    end: int  # tokens [spec.start, end) were read; end < spec.end after a failure
    chunks: list[torch.Tensor]  # KV [L, 2, H, C, D] of the chunks read, the first one holding token spec.start
    layers_done: set[int] = field(default_factory=set)


class WorkerSide:
    def __init__(self, config: Config, layout: KVLayout, model_id: str, block_size: int,
                 options: dict[str, Any]) -> None:
        self.config = config
        self.layout = layout
        self.chunk_size = config.chunk_size
        self.block_size = block_size
        self.engine = CacheEngine(config, layout, model_id)  # tiers per config (a cluster node wires its own)
        self.layers: dict[str, tuple[int, CpuPagedLayer]] = {}
        self.region_layouts: tuple[str, str] | None = None  # (K, V), measured on first use
        self.counters = Counters()
        self.stats_path = options.get("stats_path")
        self.reader = ChunkReader(self.engine, self.counters)
        # the scheduler mirrors the keys stored in our process-memory tier (it cannot see that tier)
        self.saver = Saver(self.engine, self.counters, int(options.get("save_queue_bytes") or 2**30),
                           track_stored="cpu" in config.tiers,
                           on_stored=self.write_stats if self.stats_path else None)
        # per step
        self.meta: KVFabricMetadata | None = None
        self.loads_read = False
        self.loads: list[_ActiveLoad] = []
        self.saves: list[ActiveSave] = []
        self.failed_reqs: set[str] = set()
        self.step_stats: dict[str, RequestStats] = {}
        self.invalid_blocks: set[int] = set()
        self._reported: set[bytes] = set()
        self._tier_touched = False  # a load may have promoted (and so evicted) memory-tier entries
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
        self.reader.new_step()  # the previous step's chunk views are dropped just above
        self.saves = []
        self.failed_reqs = set()

    def read_loads(self) -> None:
        """Read and verify every chunk this step loads (before the forward: the loads are synchronous)."""
        if self.loads_read or self.meta is None:
            return
        self.loads_read = True
        self._tier_touched = self._tier_touched or bool(self.meta.loads)
        cs = self.chunk_size
        for spec in self.meta.loads:
            started = time.perf_counter()
            end, chunks, by_tier = spec.end, [], {}
            for i, key in enumerate(spec.keys):  # chunk i holds tokens from (spec.start // cs + i) * cs
                found = self.reader.read(key)
                if isinstance(found, ChunkMiss):
                    end = max(spec.start, (spec.start // cs + i) * cs)
                    break
                chunks.append(found.kv)
                by_tier[found.tier] = by_tier.get(found.tier, 0) + found.num_bytes
            if end < spec.end:
                bad = blocks_of(spec.block_ids, self.block_size, end, spec.end)
                self.invalid_blocks.update(bad)
                self.failed_reqs.add(spec.req_id)
                self.counters.add("load_failed_tokens", spec.end - end)
                logger.warning("kvfabric: request %s: chunk at token %d missing or corrupt; %d tokens (blocks %s...) "
                               "will be recomputed", spec.req_id, end, spec.end - end, bad[:4])
            elapsed = time.perf_counter() - started
            self._add_stats(spec.req_id, RequestStats(loaded_tokens=end - spec.start, failed_tokens=spec.end - end,
                                                      load_read_s=elapsed, bytes_loaded=tuple(sorted(by_tier.items()))))
            self.counters.add("load_read_ns", int(elapsed * 1e9))
            self.counters.add("loaded_tokens", end - spec.start)
            self.loads.append(_ActiveLoad(spec, end, chunks))

    def _add_stats(self, req_id: str, stats: RequestStats) -> None:
        self.step_stats[req_id] = self.step_stats.get(req_id, RequestStats()) + stats

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
            for i, kv in enumerate(load.chunks):
                first = (spec.start // cs + i) * cs
                lo, hi = max(spec.start, first), min(load.end, first + cs)
                if lo < hi:  # this chunk's part of [spec.start, load.end): [2, H, hi-lo, D] of layer `index`
                    scatter(layer, spec.block_ids, lo, hi, kv[index, :, :, lo - first:hi - first, :])
            load.layers_done.add(index)
        self.counters.add("load_scatter_ns", time.perf_counter_ns() - started)

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
            self.saves = [ActiveSave(spec, [self.engine.new_payload() for _ in range(spec.start, spec.end, cs)])
                          for spec in self.meta.saves]
        for save in self.saves:
            if save.spec.req_id in self.failed_reqs or index in save.layers_done:
                continue
            for i, chunk in enumerate(save.chunks):
                first = save.spec.start + i * cs
                gather(layer, save.spec.block_ids, first, first + cs, chunk.kv[index])
            save.layers_done.add(index)
        self.counters.add("save_gather_ns", time.perf_counter_ns() - started)

    def end_step(self) -> None:
        num_layers = self.layout.num_layers
        for load in self.loads:  # a load not scattered into every layer before attention: let vLLM recompute
            if len(load.layers_done) < num_layers and load.end > load.spec.start:
                self.invalid_blocks.update(blocks_of(load.spec.block_ids, self.block_size, load.spec.start,
                                                     load.spec.end))
                self.failed_reqs.add(load.spec.req_id)
                self.counters.add("load_not_applied")
        if self.meta is not None and self.meta.loads and not self.loads_read:
            for spec in self.meta.loads:  # start_load_kv / wait_for_layer_load never ran for them
                self.invalid_blocks.update(blocks_of(spec.block_ids, self.block_size, spec.start, spec.end))
                self.counters.add("load_not_applied")
        for save in self.saves:
            spec = save.spec
            if spec.req_id in self.failed_reqs or len(save.layers_done) < num_layers:
                self.counters.add("saves_dropped_incomplete")
                continue
            if not self.saver.submit(save):
                self.counters.add("saves_dropped_queue_full")
                continue
            self._add_stats(spec.req_id, RequestStats(saved_tokens=spec.end - spec.start))
        if self.stats_path and self.meta is not None and self.meta.loads:
            self.write_stats()
        self.saves = []
        self.loads = []

    def worker_meta(self) -> KVFabricWorkerMetadata | None:
        stored = self.saver.take_stored()
        removed: list[bytes] = []
        if "cpu" in self.config.tiers:
            self._reported.update(stored)
            if stored or self._tier_touched or self.engine.tier_usage("cpu").num_chunks < len(self._reported):
                present = set(self.engine.tier_keys("cpu"))
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

    # -- stats and shutdown
    def stats(self) -> dict[str, Any]:
        engine = self.engine.stats()
        return {"connector": self.counters.snapshot(), "engine": engine.counters,
                "tiers": [dataclasses.asdict(usage) for usage in engine.tiers]}

    def write_stats(self) -> None:
        path = Path(self.stats_path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.stats(), indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("kvfabric: cannot write stats to %s: %s", path, exc)

    def flush(self) -> None:
        self.saver.join()
        self.engine.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
            self.saver.stop(timeout=30)
            if self.stats_path:
                self.write_stats()
            self.engine.close()
        except Exception:  # shutdown must not raise
            logger.exception("kvfabric: shutdown failed")
