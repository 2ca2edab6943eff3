"""Admission policies: whether a key that is not resident gets stored at all.

- `AlwaysAdmit`: every key (today's behaviour).
- `SecondAccess`: a key is stored on its second miss within a window of recently refused ids (ids only, no
  data), so one-hit wonders never displace anything.
- `TinyLFU` (Einziger et al. 2017): a count-min sketch estimates each key's recent access frequency; a
  doorkeeper (an exact set of hashed ids here, cleared with the sketch) absorbs the first access so the
  sketch only counts repeats. Every `sample_size` recorded accesses all counters are halved and the
  doorkeeper is cleared (aging): O(width x depth) work once per `sample_size` accesses, O(depth) amortized.
  A key is admitted when its estimated frequency reaches `threshold`.
Hashes are deterministic (splitmix64 of an int id, or of the last 8 bytes of a bytes key, which is already a
cryptographic digest in kvfabric), never Python's per-process `hash()` of bytes.
"""
from __future__ import annotations

from collections import OrderedDict

from kvfabric.tiers.policies.keyhash import key_hash64
from kvfabric.tiers.policies.types import AccessMeta, Key


class AlwaysAdmit:
    name = "always"

    def record(self, key: Key) -> None:
        pass

    def admit(self, key: Key, meta: AccessMeta) -> bool:
        return True

    def clear(self) -> None:
        pass


class SecondAccess:
    name = "second"

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._seen: OrderedDict[Key, None] = OrderedDict()  # refused once, oldest first

    def record(self, key: Key) -> None:
        pass

    def admit(self, key: Key, meta: AccessMeta) -> bool:
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > self.window:
            self._seen.popitem(last=False)
        return False

    def clear(self) -> None:
        self._seen.clear()


class TinyLFU:
    name = "tinylfu"

    def __init__(self, width: int, depth: int = 4, sample_size: int | None = None, threshold: int = 2,
                 seed: int = 0) -> None:
        if width < 1 or depth < 1 or threshold < 1:
            raise ValueError(f"width, depth and threshold must be >= 1, got {width}, {depth}, {threshold}")
        self.width, self.depth, self.threshold, self.seed = width, depth, threshold, seed
        self.sample_size = sample_size or 10 * width
        self.counters = [[0] * width for _ in range(depth)]
        self._doorkeeper: set[int] = set()
        self._num_recorded = 0
        self.num_steps = 0

    def _slots(self, key: Key) -> tuple[int, list[int]]:
        h = key_hash64(key, self.seed)
        # Double hashing: row i uses h1 + i * h2, from the two halves of one 64-bit hash.
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
        return h, [(h1 + i * h2) % self.width for i in range(self.depth)]

    def estimate(self, key: Key) -> int:
        h, slots = self._slots(key)
        return min(row[s] for row, s in zip(self.counters, slots)) + (h in self._doorkeeper)

    def record(self, key: Key) -> None:
        h, slots = self._slots(key)
        if h not in self._doorkeeper:
            self._doorkeeper.add(h)
        else:
            for row, s in zip(self.counters, slots):
                row[s] += 1
        self._num_recorded += 1
        if self._num_recorded >= self.sample_size:
            self._age()

    def _age(self) -> None:
        for row in self.counters:
            row[:] = [c >> 1 for c in row]
        self.num_steps += self.width * self.depth
        self._doorkeeper.clear()
        self._num_recorded = 0

    def admit(self, key: Key, meta: AccessMeta) -> bool:
        self.record(key)
        return self.estimate(key) >= self.threshold

    def clear(self) -> None:
        for row in self.counters:
            row[:] = [0] * self.width
        self._doorkeeper.clear()
        self._num_recorded = 0
