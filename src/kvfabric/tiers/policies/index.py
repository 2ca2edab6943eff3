"""PolicyIndex: byte-bounded bookkeeping of one tier (no data), with pluggable eviction and admission.

Contract:
- `add(key, size, meta)` asks the admission policy (for a key not yet resident), records the key and evicts
  the eviction policy's victims until the resident bytes fit `capacity_bytes`; it returns whether the key is
  now resident. Each evicted key is handed to `on_evict(key)` as it goes (a tier frees the key's data there, a
  tier stack demotes it to the next tier); the bookkeeping is already done when the callback runs. Re-adding
  a resident key updates its size and counts as a hit; if it no longer fits it is dropped (False).
- The resident bytes never exceed `capacity_bytes`: a key that cannot fit beside the pinned keys is refused
  before anything is evicted. Pinned keys are never evicted (a retrieve in progress pins what it reads); pins
  are counted, and may name keys that are not resident.
- `touch(key, meta)` records a hit; False when the key is not resident.
- Thread safety: every method takes `lock` (reentrant), and callers may hold it around a data change and its
  bookkeeping. `on_evict` runs under it.
- Cost: the common paths (a hit; a new key that evicts one victim) are kept short: this runs on every access.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from kvfabric.tiers.policies.types import NO_META, AccessMeta, AdmissionPolicy, EvictionPolicy, IndexStats, Key


class PolicyIndex:
    def __init__(self, capacity_bytes: int, policy: EvictionPolicy, admission: AdmissionPolicy | None = None,
                 on_evict: Callable[[Key], None] | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.admission = admission
        self.on_evict = on_evict
        self.num_bytes = 0
        self._sizes: dict[Key, int] = {}
        self._pins: dict[Key, int] = {}
        self._pinned_bytes = 0  # bytes of resident pinned keys
        self.num_hits = self.num_admitted = self.num_refused = self.num_evicted = 0
        self.lock = threading.RLock()

    def __contains__(self, key: Key) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[Key]:
        with self.lock:
            return list(self._sizes)

    def size_of(self, key: Key) -> int | None:
        return self._sizes.get(key)

    def can_fit(self, size: int) -> bool:
        return size <= self.capacity_bytes

    def touch(self, key: Key, meta: AccessMeta = NO_META) -> bool:
        with self.lock:
            if key not in self._sizes:
                return False
            self.num_hits += 1
            self.policy.touch(key, meta)
            if self.admission is not None:
                self.admission.record(key)
            return True

    def add(self, key: Key, size: int, meta: AccessMeta = NO_META) -> bool:
        with self.lock:
            sizes = self._sizes
            if key in sizes or key in self._pins:
                return self._add_slow(key, size, meta)
            # The common case, kept short: a new, unpinned key.
            if size > self.capacity_bytes - self._pinned_bytes or (
                    self.admission is not None and not self.admission.admit(key, meta)):
                self.num_refused += 1
                return False
            sizes[key] = size
            self.num_bytes += size
            self.policy.admit(key, size, meta)
            if self.num_bytes > self.capacity_bytes:
                return self._evict_for(key, size, False)
            self.num_admitted += 1
            return True

    def _add_slow(self, key: Key, size: int, meta: AccessMeta) -> bool:
        """`add` of a key that is resident (a size update, counted as a hit) or pinned."""
        old = self._sizes.get(key)
        if old is not None:
            self.num_bytes -= old
            self._pinned_bytes -= old if key in self._pins else 0
        if size > self.capacity_bytes - self._pinned_bytes or (
                old is None and self.admission is not None and not self.admission.admit(key, meta)):
            self.num_refused += 1
            if old is not None:  # a resident key that no longer fits goes
                del self._sizes[key]
                self.policy.remove(key)
            return False
        self._sizes[key] = size
        self.num_bytes += size
        self._pinned_bytes += size if key in self._pins else 0
        if old is None:
            self.policy.admit(key, size, meta)
        else:
            self.num_hits += 1
            self.policy.touch(key, meta)
        return self._evict_for(key, size, old is not None)

    def _evict_for(self, key: Key, size: int, was_resident: bool) -> bool:
        """Evict the policy's victims until the bytes fit again; the policy may pick `key` itself (bypass)."""
        sizes, victim_of, pins, on_evict = self._sizes, self.policy.victim, self._pins, self.on_evict
        while self.num_bytes > self.capacity_bytes:
            victim = victim_of(pins)
            if victim is None or victim == key:
                if victim is None:  # cannot happen while the pinned-bytes check holds; stay within budget
                    self.policy.remove(key)
                self.num_bytes -= sizes.pop(key)
                self._pinned_bytes -= size if key in pins else 0
                self.num_refused += 1
                self.num_evicted += was_resident
                return False
            self.num_bytes -= sizes.pop(victim)
            self.num_evicted += 1
            if on_evict is not None:
                on_evict(victim)
        self.num_admitted += not was_resident
        return True

    def remove(self, key: Key) -> bool:
        with self.lock:
            size = self._sizes.pop(key, None)
            if size is None:
                return False
            self.num_bytes -= size
            self._pinned_bytes -= size if key in self._pins else 0
            self.policy.remove(key)
            return True

    def pin(self, keys: Iterable[Key]) -> None:
        with self.lock:
            for key in keys:
                count = self._pins.get(key, 0)
                if count == 0 and key in self._sizes:
                    self._pinned_bytes += self._sizes[key]
                self._pins[key] = count + 1

    def unpin(self, keys: Iterable[Key]) -> None:
        with self.lock:
            for key in keys:
                count = self._pins.get(key, 0)
                if count > 1:
                    self._pins[key] = count - 1
                elif count == 1:
                    del self._pins[key]
                    if key in self._sizes:
                        self._pinned_bytes -= self._sizes[key]

    def clear(self) -> None:
        with self.lock:
            self._sizes.clear()
            self.num_bytes = 0
            self._pinned_bytes = 0
            self.policy.clear()
            if self.admission is not None:
                self.admission.clear()

    def stats(self) -> IndexStats:
        return IndexStats(len(self._sizes), self.num_bytes, self.capacity_bytes, self.num_hits,
                          self.num_admitted, self.num_refused, self.num_evicted)
