"""Worker-side loads: chunk reads and their scatter into vLLM's paged cache, on background threads.

Contract:
- `Loader(engine, counters, block_size, num_threads)` owns `num_threads` threads and one staging buffer per
  thread, allocated and touched at start-up: a load never pays page faults for fresh buffers (on small machines they
  cost as much as the read itself: docs/design/measurements.md). `bind(layers, groups, window_layers)` gives it the
  paged layers, ordered by layer index, each one's KV cache group (whose block table it uses: ``LoadSpec.table``)
  and, under vLLM's hybrid manager, the window layers, which get only rows from ``LoadSpec.window_from`` (a chunk
  wholly before it is read without its window part: ``CacheEngine.read_chunk(window=False)``).
- The threads run on every CPU the engine was given (``threads.release``: not on the core vLLM bound the
  worker's main thread to), niced (`nice`: the connector's ``load_nice``, default 15) for their whole life:
  where the forward keeps the cores busy, an asynchronous load gets the share of CPU time its weight gives it (at nice 15
  a few percent of a core against one forward thread; more in practice: a niced thread that holds the GIL
  also holds up the forward), so the requests that keep decoding slow by about that much and the load still
  progresses. (SCHED_IDLE, used before, starved a load whenever another request decoded: seconds of TTFT
  under a steady decode. A priority that changes from step to step would need CAP_SYS_NICE to raise again; a
  constant niceness needs no privilege.)
- `help(budget_s)`: the calling thread (the worker's, which bound the layers and has its own placer and staging
  buffer) loads chunks of the started async loads itself, at vLLM's priority: the worker calls it on a step with
  nothing scheduled, where it would otherwise only wait, and niced threads would share the core with vLLM's
  busy-polling message-queue readers. Each load's chunks are claimed one at a time by whichever thread is free.
  (Holding the niced threads back while a forward runs was tried: an 8k load slowed a decoding request less,
  but under `bench serve` chat a load then waited out whole prefills and mean TTFT rose; see
  docs/design/measurements.md.)
- `start_async(spec)` (vLLM's WAITING_FOR_REMOTE_KVS path): the load's chunks are spread over the threads; a
  thread reads a chunk into its staging buffer (``CacheEngine.read_chunk(promote=False)``: checksums and layout
  verified, no copy into process memory: vLLM's own prefix cache will hold the KV) and scatters it into every
  layer at once, so reading chunk i+1 overlaps scattering chunk i. A chunk in the shm pool is not read at all:
  it is verified and scattered where it lies (``read_chunk(in_place=True)``), and a chunk whose slot a writer
  reused during the scatter (``ChunkHit.is_intact``, checked before the load is reported finished) fails like a
  corrupt one: its blocks are recomputed. `take_finished()` returns each finished load once, as a
  ``LoadOutcome``; `wait_finished(timeout)` blocks until one is there (the worker calls it on steps
  that have nothing else to do, instead of letting vLLM poll in a tight loop).
- `start_layered(specs)` (synchronous, layer-wise): a step's loads. All their chunks are read and verified
  first (raw chunks from process memory are zero-copy views; others land in a pool of buffers held until the
  step's loads are done), then scattered one layer at a time, so scattering layer l+1 overlaps the forward's
  layer l. `wait_layer(index)` returns once layer `index` of every load is in place; `finish_layered()` returns
  the step's outcomes. (Not in place: the forward uses each layer as it lands, so its chunks are copied out of
  the pool first and verified whole.) Trade-off (chunks hold all layers): a load is verified before any of its
  KV is used, and a failed chunk never costs a step, but the reads themselves are not overlapped with compute
  (layer 0 needs every chunk); ranged per-layer reads would hide them at the price of verifying after the
  forward.
- Chunks stored in the layers' own block layout (``CpuPagedLayer.blocks``, what this connector saves) are read as
  they are (``read_chunk(blocks=...)``) and copied as whole runs of blocks (``load_blocks``); others (another
  engine's, token-major) are converted once and scattered. An async load verifies such a chunk while it copies
  it (``check_later``): each layer's slab is hashed right before its copy, while in cache, instead of a separate
  pass over the whole chunk; a mismatch is found before the load is reported and fails the chunk like a missing
  one (its blocks are recomputed, the chunk is discarded). From the disk tier such a chunk's file is mapped
  (``SlabReader.map_payload``: page-table entries made at once) and copied straight out of the page cache, each
  piece hashed right after its copy, while in cache; a file shorter than its header says is read one layer's
  slab at a time into the thread's staging buffer (``ChunkHit.slab``) and found short. Where numba is there, that whole chunk (read,
  hash, copies, every layer) is one call that holds no GIL (``block_kernel.ChunkPlacer``, made per thread at
  `bind`): the engine thread holds the GIL most of the time, and each hand-back costs a loader thread up to a
  switch interval. A chunk whose part ends inside a block (a prompt's last block) is copied from Python.
- A missing or corrupt chunk ends that load there: its outcome's `end` is the first token not loaded and
  `bad_blocks` the blocks from there to the load's end (vLLM recomputes them). Nothing here raises for a bad
  cache entry; a bug in a job is logged and fails that load whole, never the process.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import xxhash
from vllm.logger import init_logger

from kvfabric.blocks import BlockLayout, as_words
from kvfabric.connectors.paged import CpuPagedLayer, blocks_of, load_blocks, scatter, segments
from kvfabric.connectors.vllm.config import DEFAULT_LOAD_NICE
from kvfabric.connectors.vllm.metadata import LoadSpec, RequestStats
from kvfabric.connectors.vllm.threads import release
from kvfabric.counters import Counters
from kvfabric.kvcache import ChunkHit, ChunkMiss, KVCache
from kvfabric.pages import Scratch

if TYPE_CHECKING:
    from kvfabric.connectors.block_kernel import ChunkPlacer

logger = init_logger(__name__)


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    req_id: str
    end: int  # tokens [spec.start, end) are in place
    bad_blocks: tuple[int, ...]  # blocks holding tokens [end, spec.end): to recompute
    stats: RequestStats


@dataclass
class _Job:
    spec: LoadSpec
    chunk_size: int
    started: float = field(default_factory=time.perf_counter)
    num_left: int = 0
    num_claimed: int = 0  # chunks [0, num_claimed) taken by a thread (the loader's or, on idle steps, the worker's)
    first_bad: int | None = None  # index of the first chunk that failed
    by_tier: dict[str, int] = field(default_factory=dict)

    def chunk_span(self, i: int) -> tuple[int, int, int]:
        """(first token of chunk i, lo, hi): chunk i's part [lo, hi) of the load's tokens."""
        first = (self.spec.start // self.chunk_size + i) * self.chunk_size
        return first, max(self.spec.start, first), min(self.spec.end, first + self.chunk_size)

    def chunk_tokens(self, i: int) -> int:
        """Tokens chunk i holds: chunk_size, or fewer for a partial last chunk (it ends with the prompt)."""
        first = (self.spec.start // self.chunk_size + i) * self.chunk_size
        prompt = self.spec.num_prompt_tokens or first + self.chunk_size
        return max(1, min(self.chunk_size, prompt - first))

    def outcome(self, block_size: int) -> LoadOutcome:
        spec = self.spec
        end = spec.end if self.first_bad is None else self.chunk_span(self.first_bad)[1]
        bad = blocks_of(spec.block_ids, block_size, end, spec.end)
        stats = RequestStats(loaded_tokens=end - spec.start, failed_tokens=spec.end - end,
                             load_read_s=time.perf_counter() - self.started,
                             bytes_loaded=tuple(sorted(self.by_tier.items())))
        return LoadOutcome(spec.req_id, end, tuple(bad), stats)


class _Layered:
    """One step's synchronous loads, scattered layer by layer."""

    def __init__(self, jobs: list[_Job], num_layers: int) -> None:
        self.jobs = jobs
        self.chunks: list[list[ChunkHit]] = [[] for _ in jobs]  # per job: its good chunks' KV [L, 2, H, C, D]
        self.layer_done = [threading.Event() for _ in range(num_layers)]
        self.done = threading.Event()


@dataclass(frozen=True, slots=True)
class _Warmup:
    """Each thread takes one (the barrier holds it until all have): its ChunkPlacer, compiled before any load."""
    barrier: threading.Barrier
    slab_bytes: int


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
        self._tasks: queue.Queue[_Job | _Layered | _Warmup | None] = queue.Queue()  # a _Job: claim its next chunk
        self._active: list[_Job] = []  # async loads with chunks not yet claimed
        self._local = threading.local()  # per thread: its ChunkPlacer (None: copies from Python)
        self._num_threads = num_threads
        self._finished: list[LoadOutcome] = []
        self._cond = threading.Condition()
        self._num_async = 0  # async loads started and not yet taken
        self._pool: list[Scratch] = []  # the layered loads' buffers, reused step after step
        self._layered: _Layered | None = None
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

    def _scatter(self, job: _Job, i: int, hit: ChunkHit, index: int, layer: CpuPagedLayer,
                 slab: np.ndarray | None = None) -> None:
        """Chunk i's part of the load into layer `index` (its group's block table; a window layer from
        window_from on, and nothing when the chunk was read without its window part)."""
        first, lo, hi = job.chunk_span(i)
        row = index if hit.layers is None else (hit.layers.index(index) if index in hit.layers else None)
        if index in self.window_layers:
            lo = max(lo, job.spec.window_from)
        if row is None or lo >= hi:
            return
        table = job.spec.table(self.groups[index])
        if slab is not None:  # the payload is in this layer's block layout: whole blocks, as they are
            load_blocks(layer, table, lo, hi, slab, first)
        else:
            scatter(layer, table, lo, hi, hit.kv[row, :, :, lo - first:hi - first, :])

    # ---- async ----------------------------------------------------------------------------------------------
    def start_async(self, spec: LoadSpec) -> None:
        job = _Job(spec, self.chunk_size, num_left=len(spec.keys))
        self.counters.add("loads_async")
        with self._cond:
            self._num_async += 1
            if spec.keys:
                self._active.append(job)
        if not spec.keys:
            self._finish(job)
            return
        for _ in range(len(spec.keys)):
            self._tasks.put(job)

    def _claim(self, job: _Job) -> int | None:
        """The index of job's next chunk, now this thread's to load, or None when every chunk is taken."""
        with self._cond:
            if job.num_claimed == len(job.spec.keys):
                return None
            job.num_claimed += 1
            if job.num_claimed == len(job.spec.keys):
                self._active.remove(job)
            return job.num_claimed - 1

    def help(self, budget_s: float) -> int:
        """Load chunks of the started async loads on the calling thread (the worker's, at its own priority, not
        niced) until none is left unclaimed or `budget_s` has passed: on a step with nothing scheduled the worker's
        thread would only wait, and the loader's niced threads get a small share of a core that vLLM's own
        busy-polling readers keep busy. Returns the number of chunks it loaded."""
        staging = getattr(self._local, "staging", None)
        if staging is None:  # not the thread that bound the layers
            return 0
        deadline = time.perf_counter() + budget_s
        num_done = 0
        while time.perf_counter() < deadline:
            with self._cond:  # re-entrant: _claim takes it too; an active job always has a chunk to claim
                if not self._active:
                    break
                job = self._active[0]
                i = self._claim(job)
            assert i is not None
            self._try_chunk(job, i, staging)
            num_done += 1
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

    def _finish(self, job: _Job) -> None:
        outcome = job.outcome(self.block_size)
        with self._cond:
            self._finished.append(outcome)
            self._cond.notify_all()

    # ---- layered --------------------------------------------------------------------------------------------
    def start_layered(self, specs: Sequence[LoadSpec]) -> None:
        self._layered = _Layered([_Job(spec, self.chunk_size) for spec in specs], len(self.layers))
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
            if isinstance(task, _Job):
                if (i := self._claim(task)) is not None:
                    self._try_chunk(task, i, staging)
                continue
            try:
                if isinstance(task, _Warmup):
                    self._warm_up(task)
                else:
                    self._run_layered(task)
            except Exception:  # a bug must fail the load, not kill the thread
                logger.exception("kvfabric: load job failed")
                if isinstance(task, _Layered):
                    for job in task.jobs:
                        job.first_bad = 0
                    task.chunks = [[] for _ in task.jobs]
                    for event in task.layer_done:
                        event.set()
                    task.done.set()

    def _try_chunk(self, job: _Job, i: int, staging: Scratch) -> None:
        """Chunk i of the job; a bug fails that chunk (its blocks are recomputed), never the calling thread: a
        load thread, or the worker's own in `help`."""
        try:
            self._run_chunk(job, i, staging)
        except Exception:
            logger.exception("kvfabric: load job failed")
            self._chunk_done(job, i, None)

    def _warm_up(self, task: _Warmup) -> None:
        """This thread's ChunkPlacer over the bound layers (compiled here, off the engine's thread)."""
        self._local.placer = _make_placer(self.layers, task.slab_bytes)
        try:
            task.barrier.wait(timeout=120)
        except threading.BrokenBarrierError:
            pass

    def _read(self, job: _Job, i: int, scratch: Scratch, in_place: bool = False,
              check_later: bool = False) -> ChunkHit | None:
        started = time.perf_counter_ns()
        # a chunk wholly before window_from: no window row of it is loaded (hybrid manager), nor read
        window = not self.window_layers or job.chunk_span(i)[2] > job.spec.window_from
        found = self.engine.read_chunk(job.spec.keys[i], num_tokens=job.chunk_tokens(i), scratch=scratch,
                                       promote=False, window=window, in_place=in_place, blocks=self.blocks,
                                       check_later=check_later)
        self.counters.add("load_chunk_read_ns", time.perf_counter_ns() - started)  # file read + checks
        if isinstance(found, ChunkMiss):
            self.counters.add(f"load_{found.reason}_chunks")
            return None
        assert isinstance(found, ChunkHit)
        self.counters.add(f"bytes_loaded.{found.tier}", found.num_bytes)
        with self._cond:
            job.by_tier[found.tier] = job.by_tier.get(found.tier, 0) + found.num_bytes
        return found

    def _run_chunk(self, job: _Job, i: int, staging: Scratch) -> None:
        if job.first_bad is not None and job.first_bad < i:  # a chunk before it failed: no use loading it
            self._chunk_done(job, i, None)
            return
        hit = self._read(job, i, staging, in_place=True, check_later=True)
        if hit is not None:
            try:
                is_whole, digest = self._place(job, i, hit)
            finally:
                hit.close()
            hit = self._intact(hit) if is_whole else None
            if hit is not None and digest is not None and digest != hit.unchecked_sum:
                self.engine.discard_chunk(job.spec.keys[i], hit.tier, "payload checksum mismatch (found while loading)")
                self.counters.add("load_corrupt_chunks")
                hit = None
        self._chunk_done(job, i, hit)

    def _place(self, job: _Job, i: int, hit: ChunkHit) -> tuple[bool, int | None]:
        """Chunk i's part of every layer into the cache: (whether every slab could be read, the xxh3-64 of the
        payload when the read left it unchecked). A block-layout slab is hashed, in payload order, right before
        its copy (in cache); a slab read from disk lands in the staging buffer just before."""
        started = time.perf_counter_ns()
        placer = getattr(self._local, "placer", None)
        runs = self._runs(job, i) if placer is not None and hit.blocks is not None and hit.layers is None else None
        if runs is not None:  # one native call: read, hash and copy every layer's slab
            check = hit.unchecked_sum is not None
            mapping = hit.reader.map_payload() if hit.reader is not None else None
            if mapping is not None:  # straight out of the page cache: no pread copy into the staging buffer
                try:
                    is_whole, digest_sum = placer.place(runs, hit.reader.slab_bytes, src=mapping.array, check=check)
                finally:
                    mapping.close()
            elif hit.reader is not None:  # a file shorter than its header says: found short, slab by slab
                is_whole, digest_sum = placer.place(runs, hit.reader.slab_bytes, fd=hit.reader.fd,
                                                    file_offset=hit.reader.file_offset, check=check)
            else:
                is_whole, digest_sum = placer.place(runs, as_words(hit.kv[0]).nbytes,
                                                    src=as_words(hit.kv).reshape(-1).view(np.uint8), check=check)
            self.counters.add("load_scatter_ns", placer.cpu_ns - placer.hash_ns)  # CPU time, as the hash's
            self.counters.add("load_verify_ns", placer.hash_ns)
            if not is_whole:
                self.counters.add("load_corrupt_chunks")
            return is_whole, digest_sum
        digest = xxhash.xxh3_64() if hit.unchecked_sum is not None else None
        hashing = 0
        for index, layer in enumerate(self.layers):
            slab = None
            if hit.blocks is not None:
                slab = hit.slab(index)
                if slab is None:  # the file was shorter than its header said
                    self.counters.add("load_corrupt_chunks")
                    return False, None
                if digest is not None:
                    before = time.thread_time_ns()  # CPU time: the GIL and other threads' slices not counted
                    digest.update(slab)
                    hashing += time.thread_time_ns() - before
            self._scatter(job, i, hit, index, layer, slab)
        self.counters.add("load_scatter_ns", time.perf_counter_ns() - started - hashing)
        self.counters.add("load_verify_ns", hashing)
        return True, None if digest is None else digest.intdigest()

    def _runs(self, job: _Job, i: int) -> np.ndarray | None:
        """Chunk i's part of the load as runs of whole blocks [R, 3] (first block in the chunk's slab, first block
        in the cache, number of blocks), or None when the part ends inside a block (copied from Python)."""
        first, lo, hi = job.chunk_span(i)
        size = self.block_size
        if lo >= hi or (lo - first) % size or (hi - first) % size:
            return None
        table = job.spec.table(self.groups[0])
        return np.array([((lo + at - first) // size, block, n) for block, n, _, _, at in segments(table, size, lo, hi)],
                        dtype=np.int64).reshape(-1, 3)

    def _intact(self, hit: ChunkHit) -> ChunkHit | None:
        """hit, or None when it was read in place and its memory was reused while we scattered it (torn)."""
        if hit.is_intact():
            return hit
        self.counters.add("load_torn_chunks")
        return None

    def _chunk_done(self, job: _Job, i: int, hit: ChunkHit | None) -> None:
        with self._cond:
            if hit is None and (job.first_bad is None or i < job.first_bad):
                job.first_bad = i
            job.num_left -= 1
            last = job.num_left == 0
        if last:
            self._finish(job)

    def _run_layered(self, task: _Layered) -> None:
        held = 0
        for job, chunks in zip(task.jobs, task.chunks):
            for i in range(len(job.spec.keys)):
                if held == len(self._pool):
                    self._pool.append(Scratch())
                hit = self._read(job, i, self._pool[held])
                if hit is None:
                    job.first_bad = len(chunks)
                    break
                held += 1  # the view may live in this buffer until the step's loads are done
                chunks.append(hit)
        started = time.perf_counter_ns()
        for index, layer in enumerate(self.layers):
            for job, chunks in zip(task.jobs, task.chunks):
                for i, hit in enumerate(chunks):
                    self._scatter(job, i, hit, index, layer, hit.slab(index) if hit.blocks is not None else None)
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
        from kvfabric.connectors.block_kernel import ChunkPlacer
        return ChunkPlacer([layer.block_array for layer in layers], np.zeros(slab_bytes, dtype=np.uint8))
    except (ImportError, OSError, AttributeError) as exc:  # no numba, or an xxhash build without the symbols
        logger.info("kvfabric: block loads copy from Python (%s)", exc)
        return None
