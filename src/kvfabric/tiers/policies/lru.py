"""LRU: evict the least recently stored or hit key (today's behaviour of every tier)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvfabric.tiers.policies.types import AccessMeta, Key


class LRU:
    name = "lru"

    def __init__(self, capacity_bytes: int = 0) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self._order)

    def admit(self, key: Key, size: int, meta: AccessMeta) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key, meta: AccessMeta) -> None:
        self._order.move_to_end(key)

    def victim(self, pinned: Container[Key]) -> Key | None:
        for key in self._order:  # pinned keys are skipped where they stand: a pin is short-lived
            self.num_steps += 1
            if key not in pinned:
                del self._order[key]
                return key
        return None

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def clear(self) -> None:
        self._order.clear()
