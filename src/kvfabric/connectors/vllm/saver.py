"""Saving gathered KV off the step loop: chunk buffers, and the background thread that stores them.

Contract:
- The worker gathers each chunk's KV [L, 2, H, C, D] from the paged cache into a ``ChunkPayload`` of the engine
  (``CacheEngine.new_payload``), layer by layer right after each layer's attention (the blocks may be reused once
  the step ends, so this is the one copy; with the raw codec it is the payload of the blob that will be stored).
- `submit(save)` hands a complete save (anything with `req_id`, `keys`, `num_bytes` and `store()`: an
  ``ActiveSave`` of the CPU path, a ``device.DeviceSave`` whose copies are still landing) to the thread, or
  returns False (the caller counts the drop) when the
  gathered bytes waiting would exceed `max_bytes`: the step never waits for checksums, disk or network.
- The thread calls the save's `store()`: each chunk goes through ``KVCache.store_chunks`` (header and checksums, or the codec's encoding;
  a chunk already held is skipped; slow tiers are written by the engine's own writer thread). A failing save is
  logged and counted (``save_errors``), never fatal.
- `join()` waits until every submitted save is stored; `stop()` ends the thread after the saves queued so far.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vllm.logger import init_logger

from kvfabric.cache.protocol import ChunkPayload, KVCache
from kvfabric.connectors.vllm.metadata import SaveSpec
from kvfabric.connectors.vllm.threads import release
from kvfabric.observe.counters import Counters

logger = init_logger(__name__)


@dataclass
class ActiveSave:
    spec: SaveSpec
    chunks: list[ChunkPayload]  # chunk i holds tokens spec.start + i * C ...: its KV [L, 2, H, C, D] is gathered here
    layers_done: set[int] = field(default_factory=set)

    @property
    def req_id(self) -> str:
        return self.spec.req_id

    @property
    def keys(self) -> Sequence[bytes]:
        return self.spec.keys

    @property
    def num_bytes(self) -> int:
        return sum(chunk.kv.numel() * chunk.kv.element_size() for chunk in self.chunks)  # either layout

    def store(self, engine: KVCache) -> int:
        """Store every chunk; the number stored (a chunk the cache held already is not)."""
        return sum(engine.store_chunks(list(zip(self.spec.keys, self.chunks))))


class Save(Protocol):
    @property
    def req_id(self) -> str: ...
    @property
    def keys(self) -> Sequence[bytes]: ...
    @property
    def num_bytes(self) -> int: ...

    def store(self, engine: KVCache) -> int: ...


class Saver:
    def __init__(self, engine: KVCache, counters: Counters, max_bytes: int,
                 on_stored: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.counters = counters  # the worker's connector counters
        self.max_bytes = max_bytes
        self._on_stored = on_stored  # called after each stored save (the worker's stats file)
        self._queue: queue.Queue[Save | None] = queue.Queue()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="kvfabric-saver", daemon=True)
        self._thread.start()

    def has_room(self, num_bytes: int) -> bool:
        """Whether a save of `num_bytes` would be taken now (only the worker's thread submits)."""
        with self._lock:
            return self._queued_bytes + num_bytes <= self.max_bytes

    def submit(self, save: Save) -> bool:
        size = save.num_bytes
        with self._lock:
            if self._queued_bytes + size > self.max_bytes:
                return False
            self._queued_bytes += size
        self._queue.put(save)
        return True

    def _loop(self) -> None:
        release()  # off the core vLLM bound the worker's main thread to
        while (save := self._queue.get()) is not None:
            try:
                started = time.perf_counter_ns()
                num = save.store(self.engine)
                self.counters.add("save_store_ns", time.perf_counter_ns() - started)
                self.counters.add("chunks_stored", num)
                if self._on_stored is not None:
                    self._on_stored()
            except Exception:  # a bug here must not kill the saver
                logger.exception("kvfabric: storing KV of request %s failed", save.req_id)
                self.counters.add("save_errors")
            finally:
                with self._lock:
                    self._queued_bytes -= save.num_bytes
                self._queue.task_done()
        self._queue.task_done()

    def join(self) -> None:
        self._queue.join()

    def stop(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout)
