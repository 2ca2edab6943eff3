"""Oracle-informed eviction policies: bounds that show how much of the LRU -> Belady gap a given piece of
knowledge about the future is worth (`kvfabric bench trace --bounds`). Not policies to ship: they read the
trace's future through `BeladyFuture`.

- `OracleAlive`: LRU that knows whether a block will ever be used again (not when). A block without a next
  use goes to the eviction end. Bounds every policy whose only edge over LRU is predicting dead blocks.
- `OraclePopularity`: evicts the block with the fewest uses in the whole trace (perfect static popularity,
  LRU among equals). Bounds frequency-based policies (LFU, TinyLFU) that learn popularity perfectly.
"""
from __future__ import annotations

from kvfabric.research.belady import NEVER, Belady, BeladyFuture
from kvfabric.tiers.policies import LRU, AccessMeta, Key


class OracleAlive(LRU):
    name = "oracle-alive"
    may_bypass = True

    def __init__(self, capacity_bytes: int, future: BeladyFuture) -> None:
        super().__init__(capacity_bytes)
        self.future = future

    def admit(self, key: Key, size: int, meta: AccessMeta) -> None:
        self.touch(key, meta)

    def touch(self, key: Key, meta: AccessMeta) -> None:
        self._order[key] = None  # a block that is never used again goes to the eviction end
        self._order.move_to_end(key, last=self.future.next_use(key) != NEVER)


class OraclePopularity(Belady):
    """Belady's lazy heap ordered by total uses instead of next use: fewest uses first, then the oldest stamp."""
    name = "oracle-popularity"

    def _rank(self, key: Key, meta: AccessMeta) -> tuple[int, int]:
        return self.future.num_uses(key), 0
