"""Placement of chunks across the tiers of a stack: which tiers a store, a demotion or a promotion writes, when a
chunk read from a slower tier moves up, and how many loads may read the slow tiers at once.

Contract:
- `Levels(tiers, mode)`: the tiers (stack levels) each kind of write goes to.
  write-through: a store goes to every writable tier; a promotion to every writable tier above the one that
  served it. exclusive: a store goes to the first writable tier; what a tier evicts is demoted to the next
  writable one (`demote_to`), and a promotion goes to the first writable tier and leaves the slower one. A tier
  that cannot hand its victims down (not `is_policy_driven`: shm evicts across processes, Redis by its own
  maxmemory) cannot be exclusive: whatever enters it also enters the next writable tier (`group`).
- `PromotionCounter(after)`: a chunk is promoted on its `after`-th read from a slower tier (counted per chunk
  since it last moved up; the counts of at most `max_keys` chunks are kept, oldest dropped).
- `SlowReads(limit, wait_s)` with `LoadPermit`: at most `limit` loads (a retrieve, or one read) read from the
  tiers below the first at once (MTDS's access control: a burst of new loads must not starve the ones already
  reading). A load takes a slot at its first slow read and keeps it to the end; a load that finds none free
  within `wait_s` reads no slow tier (its chunks there are misses, recomputed). limit 0 = no cap.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvfabric.tiers.base import Tier


class Levels:
    def __init__(self, tiers: Sequence[Tier], mode: str) -> None:
        if mode not in ("write-through", "exclusive"):
            raise ValueError(f"placement mode must be write-through or exclusive, got {mode!r}")
        self.is_exclusive = mode == "exclusive"
        self.writable = tuple(i for i, tier in enumerate(tiers) if not tier.is_read_only)
        self._demotes = tuple(tier.is_policy_driven for tier in tiers)
        self.store = self.group(self.writable[0]) if self.is_exclusive and self.writable else self.writable

    def next_writable(self, level: int) -> int | None:
        return next((i for i in self.writable if i > level), None)

    def group(self, level: int) -> tuple[int, ...]:
        """Exclusive: the levels a chunk entering `level` is written to: that level, and the next writable one
        as long as the level cannot demote its victims."""
        levels = [level]
        while not self._demotes[levels[-1]] and (nxt := self.next_writable(levels[-1])) is not None:
            levels.append(nxt)
        return tuple(levels)

    def demote_to(self, level: int) -> tuple[int, ...] | None:
        """Exclusive: where a victim of `level` goes (None: the last writable tier, or write-through)."""
        nxt = self.next_writable(level)
        return self.group(nxt) if self.is_exclusive and nxt is not None and self._demotes[level] else None

    def promote_to(self, level: int) -> tuple[int, ...]:
        """The levels a chunk served by `level` is copied up to."""
        if self.is_exclusive:
            return self.store if self.store and self.store[0] < level else ()
        return tuple(i for i in self.writable if i < level)


class PromotionCounter:
    def __init__(self, after: int, max_keys: int = 1 << 16) -> None:
        if after < 1:
            raise ValueError(f"promote_after must be >= 1, got {after}")
        self.after = after
        self.max_keys = max_keys
        self._hits: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def is_due(self, key: bytes) -> bool:
        """Count one slow read of `key`; True when it should move up now (the count restarts)."""
        if self.after == 1:
            return True
        with self._lock:
            count = self._hits.pop(key, 0) + 1
            if count >= self.after:
                return True
            self._hits[key] = count
            if len(self._hits) > self.max_keys:
                self._hits.popitem(last=False)
            return False


class SlowReads:
    def __init__(self, limit: int, wait_s: float = 0.0) -> None:
        if limit < 0 or wait_s < 0:
            raise ValueError(f"need limit >= 0 and wait_s >= 0, got {limit}, {wait_s}")
        self.limit = limit
        self.wait_s = wait_s
        self._slots = threading.BoundedSemaphore(limit) if limit else None

    def permit(self) -> LoadPermit:
        return LoadPermit(self)


class LoadPermit:
    """One load's right to read the slow tiers: asked for at its first slow read, kept until `release`."""

    __slots__ = ("_reads", "_state", "_lock")

    def __init__(self, reads: SlowReads) -> None:
        self._reads = reads
        self._state: bool | None = None  # None: not asked yet; True: holds a slot; False: refused
        self._lock = threading.Lock()  # the engine's reader thread and its caller share a load's permit

    def allows(self) -> bool:
        slots = self._reads._slots
        if slots is None:
            return True
        with self._lock:
            if self._state is None:
                self._state = slots.acquire(timeout=self._reads.wait_s) if self._reads.wait_s else \
                    slots.acquire(blocking=False)
            return self._state

    def release(self) -> None:
        with self._lock:
            if self._state:
                self._reads._slots.release()
            self._state = None

    def __enter__(self) -> LoadPermit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
