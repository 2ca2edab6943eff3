"""LFU with dynamic aging (LFU-DA, Arlitt et al. 2000), in O(1).

A key's priority is `age + min(hits, max_count)` set at its last access, where `age` is the priority of the
last evicted key; the lowest priority goes first, the oldest first among equals. Aging lets a once-hot key
that stopped being used fall behind newer ones instead of staying forever. Because every priority lies in
[age, age + max_count], the lowest non-empty bucket is found by scanning at most max_count + 1 buckets.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvfabric.tiers.policies.types import AccessMeta, Key


class LFU:
    name = "lfu"

    def __init__(self, capacity_bytes: int = 0, max_count: int = 15) -> None:
        if max_count < 1:
            raise ValueError(f"max_count must be >= 1, got {max_count}")
        self.max_count = max_count
        self._buckets: dict[int, OrderedDict[Key, None]] = {}  # priority -> keys, oldest first
        self._priority: dict[Key, int] = {}
        self._count: dict[Key, int] = {}
        self._age = 0
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self._priority)

    def _place(self, key: Key, priority: int) -> None:
        self._priority[key] = priority
        bucket = self._buckets.get(priority)
        if bucket is None:
            bucket = self._buckets[priority] = OrderedDict()
        bucket[key] = None

    def _unplace(self, key: Key) -> None:
        priority = self._priority.pop(key)
        bucket = self._buckets[priority]
        del bucket[key]
        if not bucket:
            del self._buckets[priority]

    def admit(self, key: Key, size: int, meta: AccessMeta) -> None:
        if key in self._priority:
            self._unplace(key)
        self._count[key] = 1
        self._place(key, self._age + 1)

    def touch(self, key: Key, meta: AccessMeta) -> None:
        count = min(self._count[key] + 1, self.max_count)
        self._count[key] = count
        self._unplace(key)
        self._place(key, self._age + count)

    def victim(self, pinned: Container[Key]) -> Key | None:
        lowest = None  # the age becomes the lowest priority present, so a skipped pinned key stays in range
        for priority in range(self._age, self._age + self.max_count + 1):
            bucket = self._buckets.get(priority)
            self.num_steps += 1
            if bucket is None:
                continue
            lowest = priority if lowest is None else lowest
            for key in bucket:
                self.num_steps += 1
                if key not in pinned:
                    self._unplace(key)
                    del self._count[key]
                    self._age = lowest
                    return key
        return None

    def remove(self, key: Key) -> None:
        if key in self._priority:
            self._unplace(key)
            del self._count[key]

    def clear(self) -> None:
        self._buckets.clear()
        self._priority.clear()
        self._count.clear()
        self._age = 0
