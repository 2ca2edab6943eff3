"""Worker side for vLLM's GPU attention backends, and for MLA latents on any device: the KV cache as vLLM 0.32
hands it to `register_kv_caches` (one [B, H, N, C] view per layer in the group's `KVCacheLayout`: K|V content, or
an MLA backend's one latent per token with H = 1), moved by `PagedMover`.

Contract (what differs from ``WorkerSide``, the CPU backend's path; the rest, stats, stored-key mirroring and
close, is shared):
- `register(kv_caches, layout_name)`: every layer on one device; one KV cache group of full attention or of MLA
  latents, or vLLM's hybrid manager's full-attention and sliding-window groups (each layer moves through its
  group's block table; a window layer loads only from the spec's `window_from`). The copies go through
  `make_copy_stream(device, pinned_bytes)`: on CUDA a side stream with pinned host buffers (a pool bounded by the
  connector's ``pinned_bytes``, reused); on a CPU device (the tests of every GPU layout, vLLM's CPU_MLA backend)
  the same code with plain copies.
- Saves: at `end_step` (``wait_for_save``: every layer of the step has been computed on the engine's stream) each
  chunk of the step's saves is copied out on the copy stream after that compute (`PagedMover.save`); the
  saver thread waits for the copies and stores the chunk (``DeviceSave.store``). The forward never waits for a
  save. A request that had a save keeps its blocks past its end: the scheduler answers ``request_finished``
  True for it, and `finished` reports it as sent once every copy out of its blocks has landed. A running
  request's blocks can still be handed out again (a preempted request's; under the hybrid manager a window block
  that slid out of the window): before vLLM writes this step's new blocks (``handle_preemptions``, before it
  zeroes them), `fence` waits for the copies still reading one of them (``KVFabricMetadata.new_block_ids``),
  and only those: the next step never waits for a save whose blocks vLLM keeps.
  A save that would overfill the saver's queue is dropped (counted) before any copy is made.
- Loads (vLLM's WAITING_FOR_REMOTE_KVS path): one load thread reads and verifies each chunk on the host and
  queues its copies into the request's blocks (`PagedMover.load`); `finished` reports a load once all its copies
  have landed. A missing or corrupt chunk ends the load there: the blocks from it on are reported bad and vLLM
  recomputes them, as on the CPU path.
- Layer-wise loads (``load_mode: layerwise``, within the step that computes the request): `start_loads`
  (``start_load_kv``) reads, verifies and stages every chunk of the step's loads on the worker's thread, then
  queues the copies layer by layer (`PagedMover.load_layered`); `layer_load` (``wait_for_layer_load``) makes the
  engine's stream wait for that layer's copies (`hold_compute`), never the host; `end_step` reports the
  outcomes (a failed chunk's blocks, and no save of that request this step) before queueing saves. With CUDA
  graphs vLLM must run piecewise for this (``requires_piecewise_for_cudagraph``).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger

from kvfabric.cache.protocol import KVCache
from kvfabric.connectors.copy_stream import CopyDone, make_copy_stream
from kvfabric.connectors.paged import blocks_of
from kvfabric.connectors.paged_mover import ChunkRead, LayeredLoad, LoadJob, PagedMover, SaveJob
from kvfabric.connectors.vllm.config import DEFAULT_PINNED_BYTES
from kvfabric.connectors.vllm.load_jobs import LoadOutcome, LoadState
from kvfabric.connectors.vllm.metadata import KVFabricMetadata, LoadSpec, RequestStats
from kvfabric.connectors.vllm.threads import release
from kvfabric.connectors.vllm.worker import WorkerSide
from kvfabric.observe.counters import Counters

logger = init_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Copy:
    """A save's copies out of the device and the blocks they read."""
    done: CopyDone
    block_ids: frozenset[int]


@dataclass(frozen=True, slots=True)
class DeviceSave:
    """One request's chunks of a step, their copies out of the device still landing (the Saver's `Save`)."""
    req_id: str
    keys: Sequence[bytes]
    jobs: list[SaveJob]
    num_bytes: int

    def store(self, engine: KVCache) -> int:
        return sum(job.finish() for job in self.jobs)  # waits for each chunk's copies, then stores it


def chunk_reads(spec: LoadSpec, chunk_size: int) -> list[ChunkRead]:
    """The load's part of each of its chunks (the last may be a prompt's partial chunk)."""
    state = LoadState(spec, chunk_size)
    return [ChunkRead(key, *state.chunk_span(i), state.chunk_tokens(i)) for i, key in enumerate(spec.keys)]


@dataclass
class _Load:
    spec: LoadSpec
    started: float = field(default_factory=time.perf_counter)
    jobs: list[LoadJob] = field(default_factory=list)
    end: int = -1  # tokens [spec.start, end) are queued; -1 while chunks are still being read
    by_tier: dict[str, int] = field(default_factory=dict)  # bytes read per tier

    def outcome(self, block_size: int) -> LoadOutcome:
        spec = self.spec
        stats = RequestStats(loaded_tokens=self.end - spec.start, failed_tokens=spec.end - self.end,
                             load_read_s=time.perf_counter() - self.started,
                             bytes_loaded=tuple(sorted(self.by_tier.items())))
        return LoadOutcome(spec.req_id, self.end, tuple(blocks_of(spec.block_ids, block_size, self.end, spec.end)),
                           stats)


class DeviceLoads:
    """`Loads` on a device: asynchronous loads on one thread (PagedMover reads into one scratch buffer), and the step's layer-wise
    loads on the worker's thread (`load_mode` makes every load one or the other, so they never share the
    mover's scratch buffer)."""

    def __init__(self, counters: Counters, block_size: int, chunk_size: int) -> None:
        self.counters = counters
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.mover: PagedMover | None = None
        self._queue: queue.Queue[_Load | None] = queue.Queue()
        self._issued: list[_Load] = []
        self._layered: list[tuple[_Load, LayeredLoad]] = []  # this step's layer-wise loads
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvfabric-device-load", daemon=True)
        self._thread.start()

    def bind(self, mover: PagedMover) -> None:
        self.mover = mover

    def start_async(self, spec: LoadSpec) -> None:
        self.counters.add("loads_async")
        load = _Load(spec)
        with self._cond:
            self._issued.append(load)
        self._queue.put(load)

    def _run(self) -> None:
        release()  # off the core vLLM bound the worker's main thread to
        while (load := self._queue.get()) is not None:
            try:
                self._read(load)
            except Exception:  # a bug fails the load (its blocks are recomputed), never the thread
                logger.exception("kvfabric: device load of request %s failed", load.spec.req_id)
                with self._cond:
                    load.end = load.spec.start if load.end < 0 else load.end
                    self._cond.notify_all()

    def _read(self, load: _Load) -> None:
        spec, mover = load.spec, self.mover
        assert mover is not None
        end = spec.start
        for read in chunk_reads(spec, self.chunk_size):
            job = mover.load(read.key, spec.block_ids, read.start, read.end, first=read.first,
                             chunk_tokens=read.chunk_tokens, group_tables=spec.group_block_ids,
                             window_from=spec.window_from)
            if job is None:  # missing or corrupt: the rest is recomputed
                self.counters.add("load_missing_chunks")
                break
            load.jobs.append(job)
            load.by_tier[job.tier] = load.by_tier.get(job.tier, 0) + job.num_bytes
            self.counters.add(f"bytes_loaded.{job.tier}", job.num_bytes)
            end = read.end
        with self._cond:
            load.end = end
            self._cond.notify_all()

    # ---- layer-wise (load_mode: layerwise): within the step, on the worker's thread ----
    def start_layered(self, specs: Sequence[LoadSpec]) -> None:
        """Read every chunk of the step's loads and queue their copies layer by layer (`PagedMover.load_layered`)."""
        assert self.mover is not None
        for spec in specs:
            started = time.perf_counter()
            reads = chunk_reads(spec, self.chunk_size)
            layered = self.mover.load_layered(reads, spec.block_ids)
            load = _Load(spec, started, by_tier=layered.by_tier)
            load.end = reads[layered.num_read - 1].end if layered.num_read else spec.start
            self._layered.append((load, layered))

    def wait_layer(self, index: int) -> None:
        """The engine's stream waits for layer `index` of the step's loads (the host does not)."""
        for _, layered in self._layered:
            layered.layer_done[index].hold_compute()

    def finish_layered(self) -> list[LoadOutcome]:
        outcomes = []
        for load, layered in self._layered:
            layered.finish()
            outcomes.append(load.outcome(self.block_size))
        self._layered = []
        return outcomes

    def take_finished(self) -> list[LoadOutcome]:
        """Loads whose chunks were all read and whose copies have all landed, each returned once."""
        with self._cond:
            done = [load for load in self._issued if load.end >= 0 and all(job.done.is_done() for job in load.jobs)]
            for load in done:
                self._issued.remove(load)
        for load in done:
            for job in load.jobs:
                job.finish()  # the staging buffers back to the pool
        return [load.outcome(self.block_size) for load in done]

    def set_forward(self, is_running: bool) -> None:
        """One load thread, whatever runs: nothing to hold back."""

    def help(self, budget_s: float) -> int:
        """Nothing for the worker's thread to do on an idle step: the copies run on the device."""
        return 0

    def wait_finished(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: any(load.end >= 0 for load in self._issued) or not self._issued, timeout)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


class DeviceWorkerSide(WorkerSide):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pinned_bytes = int(self.options.get("pinned_bytes") or DEFAULT_PINNED_BYTES)
        self.mover: PagedMover | None = None
        self._saving: set[str] = set()  # requests with a save bound: the scheduler holds their blocks at the end
        self._copies: dict[str, list[_Copy]] = {}  # per request: copies out of its blocks, maybe in flight
        self._ending: set[str] = set()  # finished requests whose blocks wait for their copies

    def _new_loader(self, options: dict[str, Any]) -> DeviceLoads:
        return DeviceLoads(self.counters, self.block_size, self.chunk_size)

    def register(self, kv_caches: dict[str, torch.Tensor], layout_name: str = "LBNHC") -> None:
        from vllm.model_executor.models.utils import extract_layer_index
        devices = sorted({str(kv.device) for kv in kv_caches.values()})
        if len(devices) != 1:
            raise ValueError(f"KVFabricConnector: the KV cache is on {', '.join(devices)}; the connector moves one "
                             "device's cache per worker")
        if self.groups.is_hybrid and set(self.groups.layer_group) != set(kv_caches):
            raise ValueError(f"KVFabricConnector: KV cache layers {sorted(kv_caches)} are not those of vLLM's KV "
                             f"cache groups {sorted(self.groups.layer_group)}")
        named = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        views = [kv for _, kv in named]
        layout = self.layout
        width = layout.num_states * layout.head_dim  # K then V, or the one latent
        if (len(views) != layout.num_layers or any(v.dim() != 4 or v.shape[1] != layout.num_kv_heads or
                                                   v.shape[3] != width or v.dtype != layout.torch_dtype
                                                   for v in views)):
            shapes = [(name, tuple(kv.shape), kv.dtype) for name, kv in named[:2]]
            what = f"{width}] views of an MLA latent" if layout.is_latent else f"2 x {layout.head_dim}] views of K|V"
            raise ValueError(f"KVFabricConnector: KV caches {shapes}... are not [blocks, {layout.num_kv_heads} heads, "
                             f"tokens, {what} for {layout}")
        # `layer_load` finds them; a pipeline stage's layers counted from its first
        self.layers = {name: (extract_layer_index(name) - self.first_layer, view) for name, view in named}
        groups = [self.groups.layer_group.get(name, 0) for name, _ in named]
        window = layout.window_layers if self.groups.is_hybrid else ()
        self.mover = PagedMover(self.engine, views, layout_name, make_copy_stream(devices[0], self.pinned_bytes),
                                groups, window)
        assert isinstance(self.loader, DeviceLoads)
        self.loader.bind(self.mover)
        self.engine.premap(self.chunk_size, self.mover.block_layout)
        logger.info("kvfabric: %d layers on %s in layout %s (pinned host pool %d MB)", len(views), devices[0],
                    layout_name, self.pinned_bytes >> 20)

    def bind(self, meta: Any) -> None:
        super().bind(meta)
        if self.meta is not None:
            self._saving.update(spec.req_id for spec in self.meta.saves)

    def layer_save(self, name: str, kv_layer: torch.Tensor) -> None:
        pass  # saved whole at the end of the step, after every layer's compute (`end_step`)

    def end_step(self) -> None:
        if self.meta is None or self.mover is None:
            return
        self._finish_sync_loads()  # first: a request whose load failed saves nothing computed over bad blocks
        size = self.chunk_size
        for spec in self.meta.saves:
            if spec.req_id in self.failed_reqs:
                self.counters.add("saves_dropped_incomplete")
                continue
            spans = [(first, min(spec.end, first + size)) for first in range(spec.start, spec.end, size)]
            num_bytes = sum(self.engine.layout.num_bytes(hi - lo) for lo, hi in spans)
            if not self.saver.has_room(num_bytes):
                self.counters.add("saves_dropped_queue_full")
                continue
            started = time.perf_counter_ns()
            jobs = [self.mover.save(key, spec.block_ids, lo, hi, group_tables=spec.group_block_ids)
                    for key, (lo, hi) in zip(spec.keys, spans)]
            self.counters.add("save_gather_ns", time.perf_counter_ns() - started)  # enqueueing the copies
            blocks = frozenset(block for table in (spec.group_block_ids or (spec.block_ids,))
                               for block in table[spec.start // self.block_size:-(-spec.end // self.block_size)])
            self._copies.setdefault(spec.req_id, []).extend(_Copy(job.done, blocks) for job in jobs)
            self.saver.submit(DeviceSave(spec.req_id, spec.keys, jobs, num_bytes))
            self._add_stats(spec.req_id, RequestStats(saved_tokens=spec.end - spec.start))
        if self.is_sync_store and self.meta.saves:
            self.saver.join()
            self.engine.flush(to_peers=True)
        if self.stats_path and self.meta.sync_loads:
            # a step's sync loads ended in it; async ones are written when they end (finished_loads): written
            # as they start, the file's write sat between the load's start and the worker's help with it
            self.write_stats()
        self.step.close()  # the step's pause of the cache's premapping ends

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose blocks may be freed now: ended and every copy out of them landed, requests whose
        async load ended); each reported once."""
        received = self.finished_loads()
        self._ending |= finished_req_ids & self._saving
        self._saving -= finished_req_ids
        for req_id in list(self._copies):  # forget landed copies (a long request saves chunk after chunk)
            self._copies[req_id] = [copy for copy in self._copies[req_id] if not copy.done.is_done()]
            if not self._copies[req_id]:
                del self._copies[req_id]
        sent = {req_id for req_id in self._ending if req_id not in self._copies}
        self._ending -= sent
        return sent, received

    def fence(self, meta: Any) -> None:
        """vLLM is about to write this step's new blocks: the copies still reading one of them must land first
        (without the step's block list, every copy in flight)."""
        new = meta.new_block_ids if isinstance(meta, KVFabricMetadata) else None
        for req_id, copies in list(self._copies.items()):
            for copy in copies:
                if new is None or not copy.block_ids.isdisjoint(new):
                    if not copy.done.is_done():
                        self.counters.add("save_fences")
                    copy.done.wait()
            self._copies[req_id] = [copy for copy in copies if not copy.done.is_done()]
            if not self._copies[req_id]:
                del self._copies[req_id]
