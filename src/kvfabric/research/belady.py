"""Belady's offline optimum (MIN) for one tier, as an eviction policy driven by a known future.

Evict the resident key whose next use lies furthest in the future; a newcomer used later than every resident
key is bypassed (the index refuses it). With unit sizes this maximises block hits (Belady 1966, with bypass).

Time is counted in requests: `BeladyFuture.now` is the request being served, and `next_use(key)` is the
next request after it that uses the key. Equal next uses are broken by evicting the deeper chunk (larger
position in its prompt) first. On the prefix-hit metric this matters: every request that uses a chunk also
uses all chunks before it (keys are prefix-chained), so a chunk's next use is never earlier than its
ancestors'; evicting the furthest next use, deepest first, therefore never evicts an ancestor while a
descendant stays. The resident set stays closed under prefixes, every block hit is a prefix hit, and the
block-hit optimum is also the optimum of prefix-hit blocks (unit sizes). With token weights (a shorter last
chunk) it is optimal up to the partial chunks.

The heap costs O(log n) per access, and it reads the future: a bound for benchmarks (`kvfabric bench trace`), not a
policy to ship, so no config can name it (tiers.policies.make_eviction does not know it).
"""
from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right
from collections.abc import Container, Iterable, Sequence

from kvfabric.tiers.policies import AccessMeta, Key

NEVER = float("inf")


class BeladyFuture:
    """Each key's sorted request indexes; the replay sets `now` to the request it is serving."""

    def __init__(self, requests: Iterable[Sequence[Key]]) -> None:
        self._uses: dict[Key, list[int]] = {}
        for index, keys in enumerate(requests):
            for key in keys:
                self._uses.setdefault(key, []).append(index)
        self.now = 0

    def next_use(self, key: Key) -> float:
        uses = self._uses.get(key)
        if uses is None:
            return NEVER
        i = bisect_right(uses, self.now)
        return uses[i] if i < len(uses) else NEVER

    def num_uses(self, key: Key) -> int:
        """Requests that use the key over the whole trace."""
        return len(self._uses.get(key, ()))


class Belady:
    name = "belady"
    may_bypass = True  # may turn the newcomer away (see types.py)

    def __init__(self, capacity_bytes: int, future: BeladyFuture) -> None:
        self.future = future
        self._heap: list[tuple[float, int, int, Key]] = []  # (*_rank, stamp, key)
        self._stamp: dict[Key, int] = {}  # key -> stamp of its valid heap entry
        self._counter = itertools.count()
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self._stamp)

    def _rank(self, key: Key, meta: AccessMeta) -> tuple[float, int]:
        """Heap order, smallest evicted first: the furthest next use, then the deepest chunk."""
        return -self.future.next_use(key), -meta.position

    def _push(self, key: Key, meta: AccessMeta) -> None:
        stamp = next(self._counter)
        self._stamp[key] = stamp
        heapq.heappush(self._heap, (*self._rank(key, meta), stamp, key))
        if len(self._heap) > 4 * len(self._stamp) + 64:  # drop stale entries now and then (amortized O(1))
            self._heap = [e for e in self._heap if self._stamp.get(e[3]) == e[2]]
            heapq.heapify(self._heap)
            self.num_steps += len(self._heap)

    def admit(self, key: Key, size: int, meta: AccessMeta) -> None:
        self._push(key, meta)

    def touch(self, key: Key, meta: AccessMeta) -> None:
        self._push(key, meta)

    def victim(self, pinned: Container[Key]) -> Key | None:
        held = []
        chosen = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            self.num_steps += 1
            key = entry[3]
            if self._stamp.get(key) != entry[2]:
                continue  # stale: the key was touched, removed or evicted since
            if key in pinned:
                held.append(entry)
                continue
            del self._stamp[key]
            chosen = key
            break
        for entry in held:
            heapq.heappush(self._heap, entry)
        return chosen

    def remove(self, key: Key) -> None:
        self._stamp.pop(key, None)

    def clear(self) -> None:
        self._heap.clear()
        self._stamp.clear()
