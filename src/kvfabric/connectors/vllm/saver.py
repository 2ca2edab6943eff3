"""Saving gathered KV off the step loop: chunk buffers, and the background thread that stores them.

Contract:
- `chunk_buffer()` is where the worker gathers one chunk's KV [L, 2, H, C, D] from the paged cache, layer by layer
  right after each layer's attention (the blocks may be reused once the step ends, so this is the one copy).
  With the raw codec the tensor IS the payload of the blob that will be stored (no encode copy; the header is
  written later); with other codecs it is a plain tensor that the codec encodes.
- `submit(save)` hands a complete save to the thread, or returns False (the caller counts the drop) when the
  gathered bytes waiting would exceed `max_bytes`: the step never waits for checksums, disk or network.
- The thread writes each chunk's header (checksums) and puts it into the tier stack, whose own writer thread does
  the slow-tier writes; a chunk some writable tier already holds is skipped. A failing save is logged and
  counted (``save_errors``), never fatal. `take_stored()` returns the keys stored since the last call (tracked
  only when there is a process-memory tier the scheduler mirrors).
- `join()` waits until every submitted save is stored; `stop()` ends the thread after the saves queued so far.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

from kvfabric.codec.format import HEADER_BYTES, ChunkHeader, write_blob
from kvfabric.codec.raw import RawCodec
from kvfabric.connectors.vllm.metadata import SaveSpec
from kvfabric.counters import Counters
from kvfabric.engine import CacheEngine

logger = init_logger(__name__)


@dataclass
class ActiveSave:
    spec: SaveSpec
    # (first token, chunk KV [L, 2, H, C, D], its blob): with the raw codec the KV is gathered straight into the
    # payload of the blob that will be stored (no encode copy); otherwise blob is None and the codec encodes it
    chunks: list[tuple[int, torch.Tensor, memoryview | None]]
    layers_done: set[int] = field(default_factory=set)

    @property
    def num_bytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for _, kv, _ in self.chunks)


class Saver:
    def __init__(self, engine: CacheEngine, counters: Counters, max_bytes: int, track_stored: bool,
                 on_stored: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.counters = counters  # the worker's connector counters
        self.max_bytes = max_bytes
        self._track_stored = track_stored
        self._on_stored = on_stored  # called after each stored save (the worker's stats file)
        self._queue: queue.Queue[ActiveSave | None] = queue.Queue()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._stored_keys: list[bytes] = []
        self._thread = threading.Thread(target=self._loop, name="kvfabric-saver", daemon=True)
        self._thread.start()

    def chunk_buffer(self) -> tuple[torch.Tensor, memoryview | None]:
        """Where one chunk's KV is gathered: the payload of a raw-codec blob (uninitialized memory, filled by the
        gather, header written by the saver) or, for other codecs, a plain tensor."""
        engine = self.engine
        layout, shape = engine.layout, engine.layout.shape(engine.chunk_size)
        if engine.codec.codec_id != RawCodec.codec_id:
            return torch.empty(shape, dtype=layout.torch_dtype), None
        buf = torch.empty(HEADER_BYTES + layout.num_bytes(engine.chunk_size), dtype=torch.uint8)
        return buf[HEADER_BYTES:].view(layout.torch_dtype).view(shape), memoryview(buf.numpy())

    def submit(self, save: ActiveSave) -> bool:
        size = save.num_bytes
        with self._lock:
            if self._queued_bytes + size > self.max_bytes:
                return False
            self._queued_bytes += size
        self._queue.put(save)
        return True

    def take_stored(self) -> list[bytes]:
        with self._lock:
            stored, self._stored_keys = self._stored_keys, []
        return stored

    def _loop(self) -> None:
        while (save := self._queue.get()) is not None:
            spec = save.spec
            try:
                started = time.perf_counter_ns()
                num = sum(self._store_chunk(key, kv, blob) for key, (_, kv, blob) in zip(spec.keys, save.chunks))
                self.counters.add("save_store_ns", time.perf_counter_ns() - started)
                self.counters.add("chunks_stored", num)
                if self._on_stored is not None:
                    self._on_stored()
                if self._track_stored:
                    with self._lock:
                        self._stored_keys.extend(spec.keys)
            except Exception:  # a bug here must not kill the saver
                logger.exception("kvfabric: storing KV of request %s failed", spec.req_id)
                self.counters.add("save_errors")
            finally:
                with self._lock:
                    self._queued_bytes -= save.num_bytes
                self._queue.task_done()
        self._queue.task_done()

    def _store_chunk(self, key: bytes, kv: torch.Tensor, blob: memoryview | None) -> bool:
        """CacheEngine.store for one chunk whose key the scheduler computed (either key mode)."""
        engine, layout = self.engine, self.engine.layout
        if engine.stack.contains_many([key], writable_only=True)[0]:
            return False
        if blob is not None:  # raw codec: the payload is already in place (RawCodec.encode without its copy)
            write_blob(ChunkHeader(RawCodec.codec_id, layout.dtype_code, 0, layout.fingerprint, tuple(kv.shape),
                                   key, len(blob) - HEADER_BYTES), blob)
        engine.put_chunk(key, kv, blob)
        engine.counters.add("chunks_stored")
        return True

    def join(self) -> None:
        self._queue.join()

    def stop(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout)
