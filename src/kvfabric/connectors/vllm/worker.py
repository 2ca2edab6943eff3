"""Worker side of the connector (vLLM's model-runner process): the step's loads and saves, load errors.

Contract, per step (vLLM calls the hooks in this order):
- `bind(meta)`: the step's ``KVFabricMetadata`` (loads and saves with their chunk keys; the worker never hashes).
  Asynchronous loads (vLLM's WAITING_FOR_REMOTE_KVS path) start here, on the ``Loader``'s background threads:
  the forward of other requests goes on while they read and scatter.
- `start_loads()` (``start_load_kv``): the step's synchronous loads start, layer-wise (``Loader.start_layered``).
- `layer_load(layer)` (``wait_for_layer_load``): waits for that layer of the synchronous loads only.
- `layer_save(layer, kv)`: right after the layer's attention, copies the KV of the step's finished chunks out of
  the paged cache into engine payloads (``CacheEngine.new_payload``) that the ``Saver`` stores (one copy; the
  blocks may be reused once the step ends). The payloads are in the layer's own block layout where the engine
  stores those (``save_blocks``: whole runs of blocks, no transpose), else gathered token-major (``gather``).
- `end_step()` (``wait_for_save``; with ``is_sync_store`` it waits until the step's saves are stored): the
  synchronous loads' outcomes (a failed chunk: its blocks are reported, the request's saves of
  this step dropped, since their KV was computed over bad blocks); a save not gathered from every layer is
  dropped; complete saves go to the ``Saver`` (dropped and counted when its queue is full).
- `finished_loads()` (``get_finished``): ids of the asynchronous loads that ended since the last call, each
  reported once, success or not; a failed one's blocks are reported by `take_invalid_blocks` in the same pass, so
  vLLM recomputes from the first bad block (several KV cache groups: the request is reported by
  `take_failed_loads` instead, as a failed receive, and vLLM recomputes it whole). On a step with nothing
  scheduled the worker's own thread first loads chunks of the started loads itself (``Loader.help``, for up to
  ``HELP_S``: it would only wait, and it runs at vLLM's priority, not niced), then waits a few ms for a load to
  end (vLLM would otherwise poll in a tight loop, taking the cores the load needs).
- `worker_meta()`: per-request ``RequestStats`` of the step, the keys that entered or left the process-memory
  tier (the scheduler mirrors them for its lookups; with ``mode: server`` the cache is the host's
  ``kvfabric server`` and the scheduler asks it instead), and the keys of chunks that failed a load (the scheduler
  forgets them, so a request sent back to waiting is not offered the same bad chunk again).
KV cache groups (``KVGroups``): each layer moves through its group's block table (``LoadSpec.table``); with
several groups the window layers load from the spec's `window_from` only.
At attach the worker process's GIL switch interval drops to ``LOAD_SWITCH_INTERVAL_S`` (0.5 ms): the load
threads' Python steps wait less behind the engine thread.
Paged layout: ``kvfabric.connectors.paged``; the K/V region layouts are measured at first use
(``detect_cpu_kv_layout``), so stored chunks are true [layers, 2, heads, tokens, head_dim] KV.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from kvfabric.cache.builder import build_engine
from kvfabric.config import Config
from kvfabric.connectors.lookup import start_lookup_service
from kvfabric.connectors.paged import CpuPagedLayer, RegionLayout, populate
from kvfabric.connectors.vllm.config import DEFAULT_LOAD_NICE, DEFAULT_LOAD_THREADS, KVGroups, detect_cpu_kv_layout
from kvfabric.connectors.vllm.load_jobs import LoadOutcome, Loads
from kvfabric.connectors.vllm.loads import Loader
from kvfabric.connectors.vllm.metadata import KVFabricMetadata, KVFabricWorkerMetadata, RequestStats
from kvfabric.connectors.vllm.saver import ActiveSave, Saver
from kvfabric.connectors.vllm.threads import on_released
from kvfabric.host.permissions import PRIVATE_FILE, create_file
from kvfabric.kv.blocks import as_words
from kvfabric.kv.layout import KVLayout
from kvfabric.kv.shares import Share
from kvfabric.observe.counters import Counters
from kvfabric.observe.events import ChunkEvents

# The worker process's GIL switch interval once the connector is attached (CPython's default: 5 ms). A load
# thread's Python steps (a chunk's lookup, open and header checks before the native copy) each wait up to one
# interval for the GIL while vLLM's engine thread runs Python. The shorter interval takes back most of what a
# load loses beside a spinning Python thread, brings `bench vllm`'s 1k load closer to its floor and leaves ITL
# during a long load unchanged (docs/design/measurements.md). It only matters while another thread wants the
# GIL, i.e. while loads or saves run.
LOAD_SWITCH_INTERVAL_S = 0.0005

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

logger = init_logger(__name__)

IDLE_WAIT_S = 0.005  # on a step with nothing scheduled, wait this long for an async load to end
HELP_S = 0.05  # ... after loading its chunks for at most this long: a request arriving meanwhile waits for the step


class WorkerSide:
    def __init__(self, config: Config, layout: KVLayout, model_id: str, block_size: int,
                 options: dict[str, Any], is_sync_store: bool = False, groups: KVGroups | None = None,
                 events: ChunkEvents | None = None, lookup_path: str | None = None, share: Share | None = None,
                 parallel: tuple[int, int] = (1, 1)) -> None:
        """`layout`: the whole model's (chunk keys are the model's); `share`: this worker's part of it under tensor
        or pipeline parallelism (None: every layer and head), `parallel` the engine's (pp_size, tp_size)."""
        self.config = config
        self.groups = groups or KVGroups(block_size)
        self.is_sync_store = is_sync_store  # a P/D producer: the step's KV is stored before its output leaves
        self.chunk_size = config.chunk_size
        self.block_size = block_size
        self.first_layer = share.layers[0] if share is not None else 0  # a pipeline stage's first model layer
        # tiers per config (a cluster node wires its own); mode: server = the host's `kvfabric server`. Made on a
        # released thread: the cache's own threads (writer, premap) inherit its placement, not the forward's core
        self.engine = on_released(lambda: build_engine(config, layout, model_id, name=f"vllm-worker-{os.getpid()}",
                                                       events=events, share=share, parallel=parallel))
        self.layout = self.engine.layout  # what this worker's paged layers hold: its share of the model's KV
        self.layers: dict[str, tuple[int, Any]] = {}  # name -> (layer index, CpuPagedLayer; a device's: its view)
        self.group_of: dict[int, int] = {}  # layer index -> its KV cache group (0 with one group)
        self.region_layouts: tuple[RegionLayout, RegionLayout] | None = None  # (K, V), measured on first use
        self.counters = Counters()
        self.stats_path = options.get("stats_path")
        self.options = options
        self.loader = self._new_loader(options)
        self.saver = Saver(self.engine, self.counters, int(options.get("save_queue_bytes") or 2**30),
                           on_stored=self.write_stats if self.stats_path else None)
        # the scheduler asks this cache which prefixes it can load (connectors/lookup.py): every worker answers for
        # its own share
        self.lookup_service = start_lookup_service(self.engine, lookup_path) if lookup_path else None
        # per step
        self.meta: KVFabricMetadata | None = None
        self.sync_started = False
        self.saves: list[ActiveSave] = []
        self.failed_reqs: set[str] = set()
        self.step_stats: dict[str, RequestStats] = {}
        self.invalid_blocks: set[int] = set()
        self.failed_loads: set[str] = set()  # several groups: requests whose load failed (a failed receive)
        self.step = ExitStack()  # what lasts from `bind` to `end_step` (a pause of the cache's premapping)
        self._closed = False
        atexit.register(self.close)

    def _new_loader(self, options: dict[str, Any]) -> Loads:
        """The load threads (a subclass for another device brings its own)."""
        return Loader(self.engine, self.counters, self.block_size, options.get("load_threads", DEFAULT_LOAD_THREADS),
                      options.get("load_nice", DEFAULT_LOAD_NICE))

    # -- layers
    def _paged(self, kv: torch.Tensor) -> CpuPagedLayer:
        if self.region_layouts is None:
            self.region_layouts = detect_cpu_kv_layout(self.layout.num_kv_heads, self.layout.head_dim,
                                                       self.block_size, self.layout.torch_dtype)
            logger.info("kvfabric: CPU KV cache regions: K %s, V %s", *self.region_layouts)
        return CpuPagedLayer(kv, self.block_size, *self.region_layouts)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index
        devices = sorted({str(kv.device) for kv in kv_caches.values() if kv.device.type != "cpu"})
        if devices:  # one line, not a shape error from deep inside: what runs where is in the README
            raise ValueError(f"KVFabricConnector: the KV cache is on {', '.join(devices)}, but vLLM's device is the "
                             "CPU (a GPU's cache goes through DeviceWorkerSide)")
        for name, kv in kv_caches.items():
            self.layers[name] = (extract_layer_index(name) - self.first_layer, self._paged(kv))
            self.group_of[self.layers[name][0]] = self.groups.layer_group.get(name, 0)
        indices = sorted(index for index, _ in self.layers.values())
        some = next(iter(self.layers.values()))[1] if self.layers else None
        if (indices != list(range(self.layout.num_layers)) or some is None or some.num_heads !=
                self.layout.num_kv_heads or some.head_dim != self.layout.head_dim or
                some.dtype != self.layout.torch_dtype):
            shapes = [(name, tuple(kv.shape), kv.dtype) for name, kv in list(kv_caches.items())[:2]]
            raise ValueError(f"KVFabricConnector: KV caches {shapes}... do not match the layout {self.layout}")
        if self.groups.is_hybrid and set(self.groups.layer_group) != set(kv_caches):
            raise ValueError(f"KVFabricConnector: KV cache layers {sorted(kv_caches)} are not those of vLLM's KV "
                             f"cache groups {sorted(self.groups.layer_group)}")
        window = set(self.layout.window_layers) if self.groups.is_hybrid else set()
        started = time.perf_counter()
        num_bytes = populate(list(kv_caches.values()))  # a load into a fresh engine must not fault every page
        logger.info("kvfabric: KV cache mapped (%.0f MB in %.2f s)", num_bytes / 1e6, time.perf_counter() - started)
        assert isinstance(self.loader, Loader)  # the CPU backend's: the layers are bound here
        self.loader.bind([layer for _, layer in sorted(self.layers.values(), key=lambda item: item[0])],
                         [self.group_of[i] for i in indices], window)
        if some is not None:  # the blobs of full chunks, as `layer_save` asks for them, mapped ahead from now
            self.engine.premap(self.chunk_size, some.blocks if self.chunk_size % self.block_size == 0 else None)
        sys.setswitchinterval(LOAD_SWITCH_INTERVAL_S)  # the load threads get the GIL back sooner (see the constant)

    def _layer(self, name: str, kv: torch.Tensor | None = None) -> tuple[int, CpuPagedLayer] | None:
        found = self.layers.get(name)
        if found is None and kv is not None:
            from vllm.model_executor.models.utils import extract_layer_index
            found = self.layers[name] = (extract_layer_index(name) - self.first_layer, self._paged(kv))
            self.group_of[found[0]] = self.groups.layer_group.get(name, 0)
        return found

    # -- step
    def bind(self, meta: KVConnectorMetadata) -> None:
        self.meta = meta if isinstance(meta, KVFabricMetadata) else None
        self.sync_started = False
        self.saves = []
        self.failed_reqs = set()
        if self.meta is None:
            return
        # the forward fills both cores on a CPU engine: mapping cache memory ahead waits until the step ends
        self.step.close()
        if not self.meta.is_idle:
            self.step.enter_context(self.engine.paused())
        self.loader.set_forward(not self.meta.is_idle)
        for spec in self.meta.loads:
            if spec.is_async:
                self.loader.start_async(spec)

    def start_loads(self) -> None:
        """Start this step's synchronous loads, layer-wise (before the forward: it uses them)."""
        if self.sync_started or self.meta is None:
            return
        self.sync_started = True
        if specs := self.meta.sync_loads:
            self.loader.start_layered(specs)

    def layer_load(self, name: str) -> None:
        if self.meta is None or not self.meta.loads:
            return
        self.start_loads()
        found = self._layer(name)
        if found is not None:
            self.loader.wait_layer(found[0])

    def _apply(self, outcome: LoadOutcome) -> None:
        """A finished load: its stats, and the blocks vLLM must recompute when a chunk was missing or bad."""
        self._add_stats(outcome.req_id, outcome.stats)
        self.counters.add("load_read_ns", int(outcome.stats.load_read_s * 1e9))
        self.counters.add("loaded_tokens", outcome.stats.loaded_tokens)
        if outcome.bad_blocks:
            self.failed_reqs.add(outcome.req_id)
            self.counters.add("load_failed_tokens", outcome.stats.failed_tokens)
            if self.groups.is_hybrid:  # vLLM maps block ids back to requests only with one KV cache group
                self.failed_loads.add(outcome.req_id)
                what = "the request will be recomputed from its start (a failed receive: several KV cache groups)"
            else:
                self.invalid_blocks.update(outcome.bad_blocks)
                what = f"{outcome.stats.failed_tokens} tokens (blocks {list(outcome.bad_blocks[:4])}...) will be " \
                    "recomputed"
            logger.warning("kvfabric: request %s: chunk at token %d missing or corrupt; %s", outcome.req_id,
                           outcome.end, what)

    def _add_stats(self, req_id: str, stats: RequestStats) -> None:
        self.step_stats[req_id] = self.step_stats.get(req_id, RequestStats()) + stats

    def layer_save(self, name: str, kv_layer: torch.Tensor) -> None:
        if self.meta is None or not self.meta.saves:
            return
        found = self._layer(name, kv_layer)
        if found is None:
            return
        index, layer = found
        started = time.perf_counter_ns()
        cs = self.chunk_size
        if not self.saves:  # a chunk of the save holds cs tokens, or fewer for the prompt's partial last chunk
            blocks = layer.blocks if cs % self.block_size == 0 else None
            self.saves = [ActiveSave(spec, [self.engine.new_payload(min(cs, spec.end - first), blocks)
                                            for first in range(spec.start, spec.end, cs)])
                          for spec in self.meta.saves]
        group = self.group_of.get(index, 0)
        for save in self.saves:
            if index in save.layers_done:
                continue
            table = save.spec.table(group)
            for i, chunk in enumerate(save.chunks):
                first = save.spec.start + i * cs
                if chunk.blocks is not None:  # [L, n, H, 2, B*D]: this layer's blocks as they are
                    layer.save_blocks(table, first, first + chunk.num_tokens, as_words(chunk.kv[index]))
                else:
                    layer.gather(table, first, first + chunk.num_tokens, chunk.kv[index])
            save.layers_done.add(index)
        self.counters.add("save_gather_ns", time.perf_counter_ns() - started)

    def _finish_sync_loads(self) -> None:
        """The step's layer-wise loads' outcomes (a failed chunk: its blocks reported, its request's saves of
        this step dropped)."""
        if self.meta is not None and self.meta.sync_loads:
            self.start_loads()  # never started (no attention layer ran): finish them all the same
            for outcome in self.loader.finish_layered():
                self._apply(outcome)

    def end_step(self) -> None:
        num_layers = self.layout.num_layers
        self._finish_sync_loads()
        for save in self.saves:
            spec = save.spec
            if spec.req_id in self.failed_reqs or len(save.layers_done) < num_layers:
                self.counters.add("saves_dropped_incomplete")
                continue
            if not self.saver.submit(save):
                self.counters.add("saves_dropped_queue_full")
                continue
            self._add_stats(spec.req_id, RequestStats(saved_tokens=spec.end - spec.start))
        if self.is_sync_store and self.saves:
            self.saver.join()  # the answer tells the proxy that the decode instance can load this KV ...
            self.engine.flush(to_peers=True)  # ... from every tier, the write-behind ones included, and a peer
            # finds it through the controller (P2P)
        if self.stats_path and self.meta is not None and self.meta.sync_loads:
            # a step's sync loads ended in it; async ones are written when they end (finished_loads): written
            # as they start, the file's write sat between the load's start and the worker's help with it
            self.write_stats()
        self.saves = []
        self.step.close()  # the step's pause of the cache's premapping ends

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose blocks may be freed now: none, a save here never outlives its step; requests whose
        async load ended)."""
        return set(), self.finished_loads()

    def fence(self, meta: KVConnectorMetadata) -> None:
        """Nothing to wait for before vLLM writes the step's new blocks: saves copy within their step."""

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous load ended (loaded, or failed with its blocks reported)."""
        if self.meta is not None and self.meta.is_idle:
            self.loader.help(HELP_S)
            self.loader.wait_finished(IDLE_WAIT_S)
        outcomes = self.loader.take_finished()
        for outcome in outcomes:
            self._apply(outcome)
        if outcomes and self.stats_path:
            self.write_stats()
        return {outcome.req_id for outcome in outcomes}

    def worker_meta(self) -> KVFabricWorkerMetadata | None:
        requests, self.step_stats = self.step_stats, {}
        return KVFabricWorkerMetadata(requests) if requests else None

    def take_failed_loads(self) -> set[str]:
        out, self.failed_loads = self.failed_loads, set()
        return out

    def take_invalid_blocks(self) -> set[int]:
        out, self.invalid_blocks = self.invalid_blocks, set()
        return out

    # -- stats and shutdown
    def stats(self) -> dict[str, Any]:
        engine = self.engine.stats()
        return {"connector": self.counters.snapshot(), "engine": engine.counters,
                "kv_cache_groups": self.groups.num_groups, "switch_interval_s": sys.getswitchinterval(),
                "tiers": [dataclasses.asdict(usage) for usage in engine.tiers]}

    def write_stats(self) -> None:
        assert self.stats_path is not None
        path = Path(self.stats_path)
        # one temp file per writing thread: the saver thread and the engine thread both write (an exclusive create)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.unlink(missing_ok=True)  # left by a process of the same pid that died mid-write
            with open(create_file(tmp, PRIVATE_FILE), "w") as f:  # 0600, as everything kvfabric keeps
                f.write(json.dumps(self.stats(), indent=1, sort_keys=True))
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
            if self.lookup_service is not None:
                self.lookup_service.close()
            self.loader.stop()
            self.saver.stop(timeout=30)
            if self.stats_path:
                self.write_stats()
            self.engine.close()
        except Exception:  # shutdown must not raise
            logger.exception("kvfabric: shutdown failed")
