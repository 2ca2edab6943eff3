"""TierStack: ordered tiers, fastest first; read-through with promotion, write-behind to slow tiers.

Contract:
- `prefix_length(keys)`: how many leading keys some tier holds (or a queued write holds). One batched call per
  tier, and only for keys the faster tiers did not have.
- `get(key)`: the first tier holding a valid blob wins; blobs from untrusted tiers are verified (codec.format)
  and a damaged one is deleted from that tier, counted, and the next tier is tried. A hit below the first tier is
  promoted into the faster tiers.
- Tiers with `is_read_only` (a peer) are read from but never written to.
- `put(key, blob, per_level)`: `per_level` gives some tiers (by index) their own encoding of the chunk (a
  per-tier codec); the others get `blob`. The first tier is written synchronously when it is trusted (process memory, cheap); every other
  tier is written by one background thread from a bounded queue. A full queue drops the write and counts it:
  the engine's step never waits for disk or network. `flush()` waits for queued writes.
- `delete(keys)` removes chunks from every tier. Queued writes of those keys are cancelled and a write in
  progress is waited for (only that one): a delete never waits for the whole queue, which other threads may keep
  full (a flush there made deletes under load wait for seconds).
- Queued writes are readable before they land (`pending`), so a store is visible to lookups at once.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvfabric.codec.format import ChunkFormatError, ChunkHeader, parse
from kvfabric.counters import Counters
from kvfabric.tiers.base import Blob, Scratch, Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StackHit:
    """A verified chunk found by `TierStack.get`: its blob, parsed header, and where it came from ("pending" for a
    write still queued)."""
    blob: Blob
    header: ChunkHeader
    tier: str


class TierStack:
    def __init__(self, tiers: Sequence[Tier], write_queue_size: int = 64) -> None:
        if not tiers:
            raise ValueError("a tier stack needs at least one tier")
        self.tiers = list(tiers)
        self.counters = Counters()
        self._writable = tuple(i for i, tier in enumerate(self.tiers) if not tier.is_read_only)
        self._pending: dict[bytes, tuple[Blob, int]] = {}
        self._cancelled: dict[bytes, int] = {}  # key -> queued items of it to skip (deleted while queued)
        self._writing: bytes | None = None  # the key the writer thread is putting now
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)  # notified when the writer finishes a key
        self._queue: queue.Queue[tuple[bytes, Blob, tuple[int, ...], dict[int, Blob]] | None] = \
            queue.Queue(write_queue_size)
        self._writer = threading.Thread(target=self._write_loop, name="kvfabric-writer", daemon=True)
        self._writer.start()

    # ---- reads -------------------------------------------------------------------------------------------
    def prefix_length(self, keys: Sequence[bytes]) -> int:
        present = [key in self._pending for key in keys]
        for tier in self.tiers:
            first = present.index(False) if False in present else len(keys)
            if first == len(keys):
                break
            for i, hit in enumerate(tier.contains_many(keys[first:]), start=first):
                present[i] = present[i] or hit
        return present.index(False) if False in present else len(keys)

    def contains_many(self, keys: Sequence[bytes], writable_only: bool = False) -> list[bool]:
        """Which keys some tier holds; `writable_only` ignores read-only tiers (a peer's chunk is not ours)."""
        present = [key in self._pending for key in keys]
        for tier in self.tiers:
            if writable_only and tier.is_read_only:
                continue
            missing = [i for i, hit in enumerate(present) if not hit]
            if not missing:
                break
            for i, hit in zip(missing, tier.contains_many([keys[i] for i in missing])):
                present[i] = hit
        return present

    def get(self, key: bytes, scratch: Scratch | None = None, promote: bool = True) -> StackHit | None:
        """The chunk's blob, its header and the tier's name, or None. With `scratch`, the first tier reads with
        `get_into` (no allocation where the tier can); a blob from a later tier is kept for promotion. With
        `promote=False` a hit below the first tier is not promoted, so every tier reads into `scratch` (a caller
        that copies the KV elsewhere at once, e.g. into vLLM's paged cache, pays no fresh allocation). Order: a
        trusted first tier (process memory), then writes still queued, then the other tiers."""
        for level, tier in enumerate(self.tiers):
            if level == int(self.tiers[0].is_trusted):  # right after process memory, before any slow tier
                pending = self._pending.get(key)
                if pending is not None:
                    self.counters.add("hit.pending")
                    return StackHit(pending[0], parse(pending[0], key, verify_payload=False), "pending")
            if scratch is not None and (level == 0 or not promote):
                blob = tier.get_into(key, scratch)
            else:
                blob = tier.get(key)
            if blob is None:
                continue
            try:
                header = parse(blob, key, verify_payload=not tier.is_trusted)
            except ChunkFormatError as exc:
                log.warning("dropping damaged chunk %s from tier %s: %s", key.hex()[:16], tier.name, exc)
                self.counters.add(f"corrupt.{tier.name}")
                tier.delete(key)
                continue
            self.counters.add(f"hit.{tier.name}")
            self.counters.add(f"bytes_read.{tier.name}", len(blob))
            if level > 0 and promote:
                self.counters.add("promoted")
                self._write(key, blob, tuple(i for i in self._writable if i < level))
            return StackHit(blob, header, tier.name)
        self.counters.add("miss")
        return None

    def is_in_memory(self, key: bytes) -> bool:
        """True if `get(key)` will be served from process memory (a queued write or a trusted first tier)."""
        tier = self.tiers[0]
        return key in self._pending or (tier.is_trusted and tier.contains_many([key])[0])

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Hint each tier to start reading the keys it will serve (those the faster tiers lack). Only a hint:
        nothing is returned and nothing fails."""
        for tier in self.tiers:
            if not keys:
                return
            present = tier.contains_many(keys)
            tier.prefetch([key for key, hit in zip(keys, present) if hit])
            keys = [key for key, hit in zip(keys, present) if not hit]

    def discard(self, key: bytes) -> None:
        """Remove a chunk found unusable above this layer (e.g. a payload that does not decode)."""
        self.counters.add("discarded")
        for tier in self.tiers:
            tier.delete(key)

    @contextlib.contextmanager
    def pinned(self, keys: Sequence[bytes]) -> Iterator[None]:
        for tier in self.tiers:
            tier.pin(keys)
        try:
            yield
        finally:
            for tier in self.tiers:
                tier.unpin(keys)

    # ---- writes ------------------------------------------------------------------------------------------
    def put(self, key: bytes, blob: Blob, per_level: dict[int, Blob] | None = None) -> None:
        self._write(key, blob, self._writable, per_level or {})
        self.counters.add("stored")

    def _write(self, key: bytes, blob: Blob, levels: tuple[int, ...], per_level: dict[int, Blob] | None = None) -> None:
        per_level = per_level or {}
        if levels and levels[0] == 0 and self.tiers[0].is_trusted:
            self.tiers[0].put(key, per_level.get(0, blob))
            levels = levels[1:]
        if not levels:
            return
        with self._lock:
            if key in self._pending:
                return
            try:
                self._queue.put_nowait((key, blob, levels, per_level))
            except queue.Full:
                self.counters.add("dropped_writes")
                return
            self._pending[key] = (blob, len(levels))

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            key, blob, levels, per_level = item
            with self._lock:
                skip = self._cancelled.get(key, 0)
                if skip:
                    if skip == 1:
                        del self._cancelled[key]
                    else:
                        self._cancelled[key] = skip - 1
                else:
                    self._writing = key
            if skip:
                self._queue.task_done()
                continue
            try:
                for level in levels:
                    tier = self.tiers[level]
                    if not tier.put(key, per_level.get(level, blob)):
                        self.counters.add(f"failed_writes.{tier.name}")
            except Exception:  # a tier bug must not kill the writer thread
                log.exception("background write of %s failed", key.hex()[:16])
                self.counters.add("failed_writes")
            finally:
                with self._lock:
                    self._pending.pop(key, None)
                    self._writing = None
                    self._written.notify_all()
                self._queue.task_done()
        self._queue.task_done()

    def delete(self, keys: Sequence[bytes]) -> list[bytes]:
        """Remove `keys` from every tier (queued writes of them cancelled); returns the keys some tier held."""
        queued = set()
        with self._lock:
            for key in keys:
                if self._writing is not None and key == self._writing:
                    self._written.wait_for(lambda k=key: self._writing != k)
                if self._pending.pop(key, None) is not None:
                    self._cancelled[key] = self._cancelled.get(key, 0) + 1
                    queued.add(key)
        return [key for key in keys if any([tier.delete(key) for tier in self.tiers]) or key in queued]

    @property
    def queue_depth(self) -> int:
        """Writes waiting for the background writer (a metric)."""
        return self._queue.qsize()

    @property
    def queue_capacity(self) -> int:
        return self._queue.maxsize

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self.flush()
            self._queue.put(None)
            self._writer.join()
        for tier in self.tiers:
            tier.close()
