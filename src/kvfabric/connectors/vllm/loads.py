"""Worker-side loads: chunk reads and their scatter into vLLM's paged cache, on background threads.

Contract:
- `Loader(engine, counters, block_size, num_threads)` owns `num_threads` threads and one staging buffer per
  thread, allocated and touched at start-up: a load never pays page faults for fresh buffers (on small machines they
  cost as much as the read itself: docs/design/measurements.md). `bind(layers, groups, window_layers)` gives it the
  paged layers, ordered by layer index, each one's KV cache group (whose block table it uses: ``LoadSpec.table``)
  and, under vLLM's hybrid manager, the window layers, which get only rows from ``LoadSpec.window_from`` (a chunk
  wholly before it is read in its full-attention layers only: ``open_chunk(layers=...)``).
- The threads run on every CPU the engine was given (``threads.release``: not on the core vLLM bound the
  worker's main thread to), niced (`nice`: the connector's ``load_nice``, default 15) for their whole life: where
  the forward keeps the cores busy, a load gets the share of CPU its weight gives it, so decoding requests slow by
  about that much and the load still progresses. (SCHED_IDLE starved a load whenever another request decoded; a
  priority that changes from step to step would need CAP_SYS_NICE to raise again.)
- `help(budget_s)`: the calling thread (the worker's, which bound the layers and has its own placer and staging
  buffer) loads chunks of the started async loads itself, at vLLM's priority: the worker calls it on a step with
  nothing scheduled, where it would otherwise only wait, and niced threads would share the core with vLLM's
  busy-polling message-queue readers. Each load's chunks are claimed one at a time by whichever thread is free.
  (Holding the niced threads back while a forward runs was tried: an 8k load slowed a decoding request less,
  but under `bench serve` chat a load then waited out whole prefills and mean TTFT rose. Holding them back while
  the worker helps, where they share its one core, was tried too: no faster from shm, and slower from a peer,
  whose fetches the threads overlap. See docs/design/measurements.md.)
- `set_forward(is_running)` (the worker, at each step's start): while a forward runs, one load thread claims chunks
  (the first to ask; it goes on until none is left) and the others finish the chunk they hold and wait for a step
  without one. Why: beside a forward (both cores busy), a second niced thread did not make a load end sooner and
  slowed the decoding request more (docs/design/measurements.md). On steps without a forward every thread claims
  chunks, beside the worker's `help` (the claims: `load_jobs.Claims`).
- `start_async(spec)` (vLLM's WAITING_FOR_REMOTE_KVS path): the load's chunks are spread over the threads; a
  thread opens a chunk (``KVCache.open_chunk``: the cache's fastest read of its tier into the thread's staging
  buffer, in place in the shm pool, layer by layer from a disk file) and copies it into every layer, so reading
  chunk i+1 overlaps copying chunk i. The cache verifies what it hands out, while it is copied where it can: a
  chunk that fails (a payload that does not hash to its sum, a file shorter than its header, shm memory reused
  during the copy) raises ``ChunkFailed`` at the source's exit, before the load is reported, and fails like a
  missing one: its blocks are recomputed. `take_finished()` returns each finished load once, as a
  ``LoadOutcome``; `wait_finished(timeout)` blocks until one is there (the worker calls it on steps
  that have nothing else to do, instead of letting vLLM poll in a tight loop).
- `start_layered(specs)` (synchronous, layer-wise): a step's loads. All their chunks are read and verified
  first (``KVCache.read_chunk``: raw chunks from process memory are zero-copy views, others land in a pool of
  buffers held until the step's loads are done), then scattered one layer at a time, so scattering layer l+1
  overlaps the forward's layer l. `wait_layer(index)` returns once layer `index` of every load is in place;
  `finish_layered()` returns the step's outcomes. Trade-off: a load is verified before any of its KV is used (the
  forward uses each layer as it lands), but its reads are not overlapped with compute (layer 0 needs every chunk).
- Chunks stored in the layers' own block layout (``CpuPagedLayer.blocks``, what this connector saves) come as a
  ``BlockSource`` (``open_chunk(blocks=...)``) and are copied as whole runs of blocks; others (another engine's,
  token-major) come as a ``TokenSource`` and are scattered. Where numba is there, a block-layout chunk (read,
  hash, copies, every layer) is one call that holds no GIL (``BlockSource.place`` with the thread's
  ``ChunkPlacer``, made at `bind`): the engine thread holds the GIL most of the time, and each hand-back costs a
  loader thread up to a switch interval. A part that ends inside a block (a prompt's last block) is in that call
  too: the partial block's slots only. Without numba, chunks are copied from Python, slab by slab
  (``BlockSource.slab``). No hashing and no discard here: the cache's sources do both.
- A missing or corrupt chunk ends that load there: its outcome's `end` is the first token not loaded and
  `bad_blocks` the blocks from there to the load's end (vLLM recomputes them). Nothing here raises for a bad
  cache entry; a bug in a job is logged and fails that load whole, never the process.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from vllm.logger import init_logger

from kvfabric.cache.protocol import BlockSource, ChunkFailed, ChunkMiss, KVCache, TokenSource
from kvfabric.connectors.paged import CpuPagedLayer, segments
from kvfabric.connectors.vllm.config import DEFAULT_LOAD_NICE
from kvfabric.connectors.vllm.load_jobs import Claims, LayeredStep, LoadOutcome, LoadState
from kvfabric.connectors.vllm.metadata import LoadSpec
from kvfabric.connectors.vllm.threads import release
from kvfabric.host.pages import Scratch
from kvfabric.kv.blocks import BlockLayout
from kvfabric.observe.counters import Counters

if TYPE_CHECKING:
    from kvfabric.cache.placer import ChunkPlacer

logger = init_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Warmup:
    """Each thread takes one (the barrier holds it until all have): its ChunkPlacer, compiled before any load."""
    barrier: threading.Barrier
    slab_bytes: int


_RESUME = "resume"  # a task: a step without a forward began, load the chunks still unclaimed


class Loader:
    def __init__(self, engine: KVCache, counters: Counters, block_size: int, num_threads: int = 2,
                 nice: int = DEFAULT_LOAD_NICE) -> None:
        self.engine = engine
        self.counters = counters
        self.block_size = block_size
        self.chunk_size = engine.chunk_size
        self.nice = nice
        self._tids: list[int] = []  # native ids of the threads
        self.layers: list[CpuPagedLayer] = []
        self.groups: list[int] = []
        self.window_layers: frozenset[int] = frozenset()
        self._tasks: queue.Queue[LoadState | LayeredStep | _Warmup | str | None] = queue.Queue()  # a LoadState: load chunks
        self.claims = Claims(num_threads)  # the async loads' chunks: who loads which (under _cond)
        self._local = threading.local()  # per thread: its ChunkPlacer (None: copies from Python)
        self._num_threads = num_threads
        self._finished: list[LoadOutcome] = []
        self._cond = threading.Condition()
        self._num_async = 0  # async loads started and not yet taken
        self._pool: list[Scratch] = []  # the layered loads' buffers, reused step after step
        self._layered: LayeredStep | None = None
        blob_bytes = engine.chunk_blob_bytes()
        self._threads = [threading.Thread(target=self._run, args=(blob_bytes,), name=f"kvfabric-load-{i}",
                                          daemon=True) for i in range(num_threads)]
        for thread in self._threads:
            thread.start()
        with self._cond:  # ready (niced, buffers touched) before the first load
            self._cond.wait_for(lambda: len(self._tids) == num_threads)

    def bind(self, layers: Sequence[CpuPagedLayer], groups: Sequence[int] | None = None,
             window_layers: set[int] | frozenset[int] = frozenset()) -> None:
        self.layers = list(layers)
        self.groups = list(groups) if groups is not None else [0] * len(self.layers)
        self.window_layers = frozenset(window_layers)  # rows from spec.window_from only (hybrid manager)
        self.full_layers = [index for index in range(len(self.layers)) if index not in self.window_layers]
        self.blocks: BlockLayout | None = self.layers[0].blocks if self.layers else None
        if self.layers and not self.window_layers and len(set(self.groups)) == 1:
            slab_bytes = self.engine.layout.num_bytes(self.chunk_size) // len(self.layers)
            warmup = _Warmup(threading.Barrier(self._num_threads), slab_bytes)
            for _ in range(self._num_threads):
                self._tasks.put(warmup)
            # the calling thread (the worker's) helps with async loads on idle steps (`help`): its own placer and
            # staging buffer, made now
            self._local.staging = Scratch()
            self._local.staging.view(self.engine.chunk_blob_bytes())
            self._local.placer = _make_placer(self.layers, slab_bytes)

    def _scatter(self, job: LoadState, i: int, source: TokenSource | BlockSource, index: int,
                 layer: CpuPagedLayer) -> None:
        """Chunk i's part of the load into layer `index` (its group's block table; a window layer from
        window_from on, and nothing when the chunk was read without that layer)."""
        first, lo, hi = job.chunk_span(i)
        if index in self.window_layers:
            lo = max(lo, job.spec.window_from)
        layers = source.layers
        if lo >= hi or (layers is not None and index not in layers):
            return
        table = job.spec.table(self.groups[index])
        if isinstance(source, BlockSource):  # the payload is in this layer's block layout: whole blocks, as they are
            layer.load_blocks(table, lo, hi, source.slab(index), first)
        else:
            row = index if layers is None else layers.index(index)
            layer.scatter(table, lo, hi, source.kv[row, :, :, lo - first:hi - first, :])

    # ---- async ----------------------------------------------------------------------------------------------
    def start_async(self, spec: LoadSpec) -> None:
        job = LoadState(spec, self.chunk_size, num_left=len(spec.keys))
        self.counters.add("loads_async")
        with self._cond:
            self._num_async += 1
            if spec.keys:
                self.claims.add(job)
        if not spec.keys:
            self._finish(job)
            return
        for _ in range(min(len(spec.keys), self._num_threads)):  # a wake-up each: a thread loads until none is left
            self._tasks.put(job)

    def set_forward(self, is_running: bool) -> None:
        """Whether this step runs a forward (see the module doc); a step without one wakes the threads that waited."""
        with self._cond:
            num_waiting = self.claims.set_forward(is_running)
        for _ in range(num_waiting):
            self._tasks.put(_RESUME)

    def _drain(self, staging: Scratch, deadline: float | None = None) -> int:
        """Load chunks of the started async loads, one claim at a time (`Claims.pick`), until there is none for this
        thread or `deadline` (perf_counter) has passed; the number of chunks loaded."""
        me = threading.get_ident() if deadline is None else None  # the worker's `help` (a deadline) never waits
        num_done = 0
        while deadline is None or time.perf_counter() < deadline:
            with self._cond:
                picked = self.claims.pick(me)
            if picked is None:
                break
            self._try_chunk(*picked, staging)
            num_done += 1
        return num_done

    def help(self, budget_s: float) -> int:
        """Load chunks of the started async loads on the calling thread (see the module doc) until none is left
        unclaimed or `budget_s` has passed; the number of chunks it loaded."""
        staging = getattr(self._local, "staging", None)
        if staging is None:  # not the thread that bound the layers
            return 0
        num_done = self._drain(staging, time.perf_counter() + budget_s)
        if num_done:
            self.counters.add("load_helped_chunks", num_done)
        return num_done

    @property
    def num_async(self) -> int:
        return self._num_async

    def take_finished(self) -> list[LoadOutcome]:
        with self._cond:
            out, self._finished = self._finished, []
            self._num_async -= len(out)
        return out

    def wait_finished(self, timeout: float) -> None:
        with self._cond:
            if not self._finished and self._num_async:
                self._cond.wait(timeout)

    def _finish(self, job: LoadState) -> None:
        outcome = job.outcome(self.block_size)
        with self._cond:
            self._finished.append(outcome)
            self._cond.notify_all()

    # ---- layered --------------------------------------------------------------------------------------------
    def start_layered(self, specs: Sequence[LoadSpec]) -> None:
        self._layered = LayeredStep([LoadState(spec, self.chunk_size) for spec in specs], len(self.layers))
        self.counters.add("loads_layered", len(specs))
        self._tasks.put(self._layered)

    def wait_layer(self, index: int) -> None:
        if self._layered is not None:
            self._layered.layer_done[index].wait()

    def finish_layered(self) -> list[LoadOutcome]:
        layered, self._layered = self._layered, None
        if layered is None:
            return []
        layered.done.wait()
        return [job.outcome(self.block_size) for job in layered.jobs]

    # ---- threads --------------------------------------------------------------------------------------------
    def _run(self, blob_bytes: int) -> None:
        tid = threading.get_native_id()
        release(self.nice)  # off the core vLLM bound the worker's main thread to, niced
        staging = Scratch()
        staging.view(blob_bytes)  # allocated and touched now, not during a request's load
        with self._cond:
            self._tids.append(tid)
            self._cond.notify_all()
        while (task := self._tasks.get()) is not None:
            if isinstance(task, (LoadState, str)):  # a load's wake-up, or _RESUME
                self._drain(staging)
                continue
            try:
                if isinstance(task, _Warmup):
                    self._warm_up(task)
                else:
                    self._run_layered(task)
            except Exception:  # a bug must fail the load, not kill the thread
                logger.exception("kvfabric: load job failed")
                if isinstance(task, LayeredStep):
                    for job in task.jobs:
                        job.first_bad = 0
                    task.chunks = [[] for _ in task.jobs]
                    for event in task.layer_done:
                        event.set()
                    task.done.set()

    def _try_chunk(self, job: LoadState, i: int, staging: Scratch) -> None:
        """Chunk i of the job; a bug fails that chunk (its blocks are recomputed), never the calling thread: a
        load thread, or the worker's own in `help`."""
        try:
            self._run_chunk(job, i, staging)
        except Exception:
            logger.exception("kvfabric: load job failed")
            self._chunk_done(job, i, False)

    def _warm_up(self, task: _Warmup) -> None:
        """This thread's ChunkPlacer over the bound layers (compiled here, off the engine's thread)."""
        self._local.placer = _make_placer(self.layers, task.slab_bytes)
        try:
            task.barrier.wait(timeout=120)
        except threading.BrokenBarrierError:
            pass

    def _count_read(self, job: LoadState, started: int, source: TokenSource | BlockSource | ChunkMiss) -> bool:
        self.counters.add("load_chunk_read_ns", time.perf_counter_ns() - started)  # file read + checks
        if isinstance(source, ChunkMiss):
            self.counters.add(f"load_{source.reason}_chunks")
            return False
        self.counters.add(f"bytes_loaded.{source.tier}", source.num_bytes)
        with self._cond:
            job.by_tier[source.tier] = job.by_tier.get(source.tier, 0) + source.num_bytes
        return True

    def _layers(self, job: LoadState, i: int) -> list[int] | None:
        """The layers chunk i is read for: a chunk wholly before window_from needs no window row (hybrid manager)."""
        return None if not self.window_layers or job.chunk_span(i)[2] > job.spec.window_from else self.full_layers

    def _run_chunk(self, job: LoadState, i: int, staging: Scratch) -> None:
        if job.first_bad is not None and job.first_bad < i:  # a chunk before it failed: no use loading it
            self._chunk_done(job, i, False)
            return
        started = time.perf_counter_ns()
        source = self.engine.open_chunk(job.spec.keys[i], job.chunk_tokens(i), blocks=self.blocks,
                                        layers=self._layers(job, i), scratch=staging)
        if not self._count_read(job, started, source):
            self._chunk_done(job, i, False)
            return
        assert not isinstance(source, ChunkMiss)
        try:
            with source:
                self._place(job, i, source)
        except ChunkFailed as failed:  # damaged, short or torn: what was copied is recomputed
            self.counters.add(f"load_{failed.miss.reason}_chunks")
            self._chunk_done(job, i, False)
            return
        self._chunk_done(job, i, True)

    def _place(self, job: LoadState, i: int, source: TokenSource | BlockSource) -> None:
        """Chunk i's part of every layer into the cache: a block-layout chunk in one native call (where numba is
        there), any other layer by layer."""
        started = time.perf_counter_ns()
        placer = getattr(self._local, "placer", None)
        if placer is not None and isinstance(source, BlockSource):  # read, hash, copy each layer's slab without the GIL
            source.place(placer, self._runs(job, i))
            self.counters.add("load_scatter_ns", placer.cpu_ns - source.check_ns)  # CPU time, as the hash's
            self.counters.add("load_verify_ns", source.check_ns)
            return
        for index, layer in enumerate(self.layers):
            self._scatter(job, i, source, index, layer)
        check_ns = source.check_ns if isinstance(source, BlockSource) else 0
        self.counters.add("load_scatter_ns", time.perf_counter_ns() - started - check_ns)
        self.counters.add("load_verify_ns", check_ns)

    def _runs(self, job: LoadState, i: int) -> np.ndarray:
        """Chunk i's part of the load as runs [R, 5] (first block in the chunk's slab, first block in the cache,
        number of blocks, first and end token in a block): runs of whole blocks (0, B), and a partial block (a
        prompt's last: vLLM recomputes its last token) as a run of one with the offsets of its tokens."""
        first, lo, hi = job.chunk_span(i)
        size = self.block_size
        table = job.spec.table(self.groups[0])
        return np.array([((lo + at - start - first) // size, block, n, start, end)
                         for block, n, start, end, at in segments(table, size, lo, hi)],
                        dtype=np.int64).reshape(-1, 5)

    def _chunk_done(self, job: LoadState, i: int, is_loaded: bool) -> None:
        with self._cond:
            if not is_loaded and (job.first_bad is None or i < job.first_bad):
                job.first_bad = i
            job.num_left -= 1
            last = job.num_left == 0
        if last:
            self._finish(job)

    def _run_layered(self, task: LayeredStep) -> None:
        held = 0
        with ExitStack() as sources:  # every chunk of the step's loads, verified, held until all are scattered
            for job, chunks in zip(task.jobs, task.chunks):
                for i in range(len(job.spec.keys)):
                    if held == len(self._pool):
                        self._pool.append(Scratch())
                    started = time.perf_counter_ns()
                    source = self.engine.read_chunk(job.spec.keys[i], job.chunk_tokens(i), blocks=self.blocks,
                                                    layers=self._layers(job, i), scratch=self._pool[held])
                    if not self._count_read(job, started, source):
                        job.first_bad = len(chunks)
                        break
                    assert not isinstance(source, ChunkMiss)
                    held += 1  # the source may view this buffer until the step's loads are done
                    sources.enter_context(source)
                    chunks.append(source)
            started = time.perf_counter_ns()
            for index, layer in enumerate(self.layers):
                for job, chunks in zip(task.jobs, task.chunks):
                    for i, source in enumerate(chunks):
                        self._scatter(job, i, source, index, layer)
                task.layer_done[index].set()
            self.counters.add("load_scatter_ns", time.perf_counter_ns() - started)
            task.chunks = [[] for _ in task.jobs]
        task.done.set()

    def stop(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join(timeout=10)


def _make_placer(layers: Sequence[CpuPagedLayer], slab_bytes: int) -> ChunkPlacer | None:
    """A ChunkPlacer over the layers (compiled on the calling thread), or None where it cannot run: copies from
    Python then."""
    try:
        from kvfabric.cache.placer import ChunkPlacer
        return ChunkPlacer([layer.block_array for layer in layers], layers[0].blocks,
                           np.zeros(slab_bytes, dtype=np.uint8))
    except (ImportError, OSError, AttributeError) as exc:  # no numba, or an xxhash build without the symbols
        logger.info("kvfabric: block loads copy from Python (%s)", exc)
        return None
