"""WriteBehind: the tier stack's background writer, one thread draining a bounded queue of writes to slow tiers.

Contract:
- `queue(write)` takes a write of one blob to some stack levels, in order; False when the key already waits (the
  earlier write wins) or the queue is full (the write is dropped and counted `dropped_writes`: a caller's step
  never waits for disk or network).
- What waits is readable before it lands: `pending(key)` is its blob (`is_pending`), so a store is visible to
  lookups and reads at once.
- `cancel(keys)` (a delete) removes queued writes of those keys and waits for a write in progress of one of them,
  only that one: a delete never waits for the whole queue, which other threads may keep full.
- A level that refuses a write (admission) under exclusive placement passes it on one level down (`demote_to`).
- `flush()` waits until the queue is empty; `close()` flushes and stops the thread. A failing tier never kills
  the thread: the write is counted `failed_writes`.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob
from kvfabric.tiers.policies import NO_META, AccessMeta

log = logging.getLogger("kvfabric.tiers.stack")

PutLevel = Callable[[int, bytes, Blob, str, AccessMeta], bool]  # (level, key, blob, kind, meta) -> stored


@dataclass(frozen=True, slots=True)
class Write:
    """One queued write: `levels` in order; `kind` names the counters ("stored", "promoted", "demoted")."""
    key: bytes
    blob: Blob
    levels: tuple[int, ...]
    kind: str
    meta: AccessMeta = NO_META
    per_level: dict[int, Blob] = field(default_factory=dict)  # levels with their own encoding of the chunk


class WriteBehind:
    def __init__(self, size: int, put: PutLevel, demote_to: Callable[[int], tuple[int, ...] | None],
                 counters: Counters) -> None:
        self._put = put
        self._demote_to = demote_to
        self._counters = counters
        self._pending: dict[bytes, Blob] = {}
        self._cancelled: dict[bytes, int] = {}  # key -> queued items of it to skip (deleted while queued)
        self._writing: bytes | None = None  # the key the thread is putting now
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)  # notified when the thread finishes a key
        self._queue: queue.Queue[Write | None] = queue.Queue(size)
        self._thread = threading.Thread(target=self._loop, name="kvfabric-writer", daemon=True)
        self._thread.start()

    def is_pending(self, key: bytes) -> bool:
        return key in self._pending

    def pending(self, key: bytes) -> Blob | None:
        return self._pending.get(key)

    def queue(self, write: Write) -> bool:
        with self._lock:
            if write.key in self._pending:
                return False
            try:
                self._queue.put_nowait(write)
            except queue.Full:
                self._counters.add("dropped_writes")
                return False
            self._pending[write.key] = write.blob
        return True

    def cancel(self, keys: Sequence[bytes]) -> set[bytes]:
        """Cancel the queued writes of `keys`; the keys that had one."""
        queued = set()
        with self._lock:
            for key in keys:
                if self._writing is not None and key == self._writing:
                    self._written.wait_for(lambda k=key: self._writing != k)
                if self._pending.pop(key, None) is not None:
                    self._cancelled[key] = self._cancelled.get(key, 0) + 1
                    queued.add(key)
        return queued

    def _skips(self, key: bytes) -> bool:
        """Whether this queued write of `key` was cancelled (else it is now the one in progress). Under the lock."""
        skip = self._cancelled.get(key, 0)
        if skip == 1:
            del self._cancelled[key]
        elif skip:
            self._cancelled[key] = skip - 1
        else:
            self._writing = key
        return skip > 0

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            with self._lock:
                skip = self._skips(job.key)
            if skip:
                self._queue.task_done()
                continue
            try:
                levels = list(job.levels)
                for level in levels:
                    if self._put(level, job.key, job.per_level.get(level, job.blob), job.kind, job.meta):
                        continue
                    down = self._demote_to(level) if job.kind != "promoted" else None
                    if down is not None and level == levels[-1]:
                        levels.extend(down)  # exclusive: refused here, placed one tier down instead
            except Exception:  # a tier bug must not kill the writer thread
                log.exception("background write of %s failed", job.key.hex()[:16])
                self._counters.add("failed_writes")
            finally:
                with self._lock:
                    self._pending.pop(job.key, None)
                    self._writing = None
                    self._written.notify_all()
                self._queue.task_done()
        self._queue.task_done()

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    @property
    def capacity(self) -> int:
        return self._queue.maxsize

    def flush(self) -> None:
        self._queue.join()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        if self._thread.is_alive():
            self.flush()
            self._queue.put(None)
            self._thread.join()
