"""Oracle-informed eviction policies: bounds that show how much of the LRU -> Belady gap a given piece of
knowledge about the future is worth (`kvfabric bench trace --bounds`). Not policies to ship: they read the
trace's future through `BeladyFuture`.

- `OracleAlive`: LRU that knows whether a block will ever be used again (not when). A block without a next
  use goes to the eviction end. Bounds every policy whose only edge over LRU is predicting dead blocks.
- `OraclePopularity`: evicts the block with the fewest uses in the whole trace (perfect static popularity,
  LRU among equals). Bounds frequency-based policies (LFU, TinyLFU) that learn popularity perfectly.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Container

from kvfabric.tiers.policies import AccessMeta, BeladyFuture, Key
from kvfabric.tiers.policies.belady import NEVER


class OracleAlive:
    name = "oracle-alive"

    def __init__(self, capacity_bytes: int, future: BeladyFuture) -> None:
        self.future = future
        self._order: OrderedDict[Key, None] = OrderedDict()  # next victim first
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self._order)

    def admit(self, key: Key, size: int, meta: AccessMeta) -> None:
        self.touch(key, meta)

    def touch(self, key: Key, meta: AccessMeta) -> None:
        self._order[key] = None
        self._order.move_to_end(key, last=self.future.next_use(key) != NEVER)

    def victim(self, pinned: Container[Key]) -> Key | None:
        for key in self._order:
            self.num_steps += 1
            if key not in pinned:
                del self._order[key]
                return key
        return None

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def clear(self) -> None:
        self._order.clear()


class OraclePopularity:
    name = "oracle-popularity"

    def __init__(self, capacity_bytes: int, future: BeladyFuture) -> None:
        self.future = future
        self._heap: list[tuple[int, int, Key]] = []  # (total uses, stamp, key): fewest uses, then oldest
        self._stamp: dict[Key, int] = {}
        self._counter = itertools.count()
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self._stamp)

    def admit(self, key: Key, size: int, meta: AccessMeta) -> None:
        self.touch(key, meta)

    def touch(self, key: Key, meta: AccessMeta) -> None:
        stamp = next(self._counter)
        self._stamp[key] = stamp
        heapq.heappush(self._heap, (self.future.num_uses(key), stamp, key))

    def victim(self, pinned: Container[Key]) -> Key | None:
        held, chosen = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            self.num_steps += 1
            if self._stamp.get(entry[2]) != entry[1]:
                continue
            if entry[2] in pinned:
                held.append(entry)
                continue
            chosen = entry[2]
            del self._stamp[chosen]
            break
        for entry in held:
            heapq.heappush(self._heap, entry)
        return chosen

    def remove(self, key: Key) -> None:
        self._stamp.pop(key, None)

    def clear(self) -> None:
        self._heap.clear()
        self._stamp.clear()
