"""S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO with 2-bit reinsertion, a ghost FIFO.

New keys enter the small queue (about 10 % of the resident bytes) unless the ghost queue remembers them, then
they enter main. A key leaving the small queue moves to main if it was hit there, else it leaves the cache and
its id goes to the ghost queue (as many entries as main holds). A key leaving main is reinserted while its hit
counter (capped at 3) is positive, decrementing it. One-hit wonders leave quickly without disturbing main.
Each reinsertion spends a hit earned earlier, so eviction is O(1) amortized.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvfabric.tiers.policies.types import AccessMeta, Key


class S3FIFO:
    name = "s3fifo"

    def __init__(self, capacity_bytes: int = 0, small_frac: float = 0.1, max_freq: int = 3,
                 ghost_mult: float = 1.0) -> None:
        if not 0.0 < small_frac < 1.0:
            raise ValueError(f"small_frac must be in (0, 1), got {small_frac}")
        self.small_frac = small_frac
        self.max_freq = max_freq
        self.ghost_mult = ghost_mult  # ghost entries per main entry
        self._small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._size: dict[Key, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self._freq)

    def admit(self, key: Key, size: int, meta: AccessMeta) -> None:
        self.remove(key)
        self._freq[key] = 0
        self._size[key] = size
        if self._ghost.pop(key, 0) is None:  # seen recently: skip probation
            self._main[key] = None
            self._main_bytes += size
        else:
            self._small[key] = None
            self._small_bytes += size

    def touch(self, key: Key, meta: AccessMeta) -> None:
        if self._freq[key] < self.max_freq:
            self._freq[key] += 1

    def victim(self, pinned: Container[Key]) -> Key | None:
        # Every pass either evicts, moves a key small -> main, or spends one hit of a main key; pinned keys
        # are moved to the back of their queue. The bound only stops the loop when everything is pinned.
        for _ in range(2 * (len(self._freq) + 1) * (self.max_freq + 1)):
            self.num_steps += 1
            total = self._small_bytes + self._main_bytes
            from_small = self._small and (self._small_bytes >= self.small_frac * total or not self._main)
            if from_small:
                key, _ = self._small.popitem(last=False)
                size = self._size[key]
                if key in pinned:
                    self._small[key] = None
                elif self._freq[key] > 0:
                    self._small_bytes -= size
                    self._main_bytes += size
                    self._freq[key] = 0
                    self._main[key] = None
                else:
                    self._small_bytes -= size
                    self._forget(key)
                    self._ghost[key] = None
                    while len(self._ghost) > max(self.ghost_mult * len(self._main), 1):
                        self._ghost.popitem(last=False)
                        self.num_steps += 1
                    return key
            elif self._main:
                key, _ = self._main.popitem(last=False)
                if key in pinned:
                    self._main[key] = None
                elif self._freq[key] > 0:
                    self._freq[key] -= 1
                    self._main[key] = None
                else:
                    self._main_bytes -= self._size[key]
                    self._forget(key)
                    return key
            else:
                return None
        return None

    def _forget(self, key: Key) -> None:
        del self._freq[key]
        del self._size[key]

    def remove(self, key: Key) -> None:
        if key not in self._freq:
            return
        size = self._size[key]
        if self._small.pop(key, 0) is None:
            self._small_bytes -= size
        else:
            del self._main[key]
            self._main_bytes -= size
        self._forget(key)

    def clear(self) -> None:
        for part in (self._small, self._main, self._ghost, self._freq, self._size):
            part.clear()
        self._small_bytes = self._main_bytes = 0
