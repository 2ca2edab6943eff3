"""ARC (Megiddo & Modha, FAST 2003), counted in bytes.

T1 holds keys seen once recently, T2 keys seen at least twice; B1 and B2 remember the ids (and sizes) of keys
evicted from T1 and T2. A miss that finds its key in B1 means T1 was too small: the target `p` for T1's bytes
grows; one found in B2 shrinks it. Eviction takes T1's LRU while T1 is above its target, else T2's LRU. The
ghost lists are trimmed so that T1 + B1 <= capacity and T1 + T2 + B1 + B2 <= 2 x capacity (bytes).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvfabric.tiers.policies.types import AccessMeta, Key


class ARC:
    name = "arc"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"ARC needs the capacity in bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._t1: OrderedDict[Key, int] = OrderedDict()  # key -> size, LRU first
        self._t2: OrderedDict[Key, int] = OrderedDict()
        self._b1: OrderedDict[Key, int] = OrderedDict()
        self._b2: OrderedDict[Key, int] = OrderedDict()
        self._bytes = {"t1": 0, "t2": 0, "b1": 0, "b2": 0}
        self._target_t1 = 0.0
        self._last_from_b2 = False
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def admit(self, key: Key, size: int, meta: AccessMeta) -> None:
        self.remove(key)
        b = self._bytes
        self._last_from_b2 = False
        if key in self._b1:
            ratio = max(1.0, b["b2"] / max(b["b1"], 1))
            self._target_t1 = min(float(self.capacity_bytes), self._target_t1 + ratio * size)
            b["b1"] -= self._b1.pop(key)
            self._t2[key] = size
            b["t2"] += size
        elif key in self._b2:
            ratio = max(1.0, b["b1"] / max(b["b2"], 1))
            self._target_t1 = max(0.0, self._target_t1 - ratio * size)
            b["b2"] -= self._b2.pop(key)
            self._last_from_b2 = True
            self._t2[key] = size
            b["t2"] += size
        else:
            self._t1[key] = size
            b["t1"] += size
        self._trim_ghosts()

    def touch(self, key: Key, meta: AccessMeta) -> None:
        size = self._t1.pop(key, None)
        if size is None:
            self._t2.move_to_end(key)
            return
        self._bytes["t1"] -= size
        self._bytes["t2"] += size
        self._t2[key] = size

    def victim(self, pinned: Container[Key]) -> Key | None:
        t1_bytes = self._bytes["t1"]
        prefer_t1 = self._t1 and (t1_bytes > self._target_t1 or (self._last_from_b2 and t1_bytes == self._target_t1))
        order = (("t1", self._t1, "b1", self._b1), ("t2", self._t2, "b2", self._b2))
        for name, live, ghost_name, ghost in (order if prefer_t1 else order[::-1]):
            for key in live:
                self.num_steps += 1
                if key in pinned:
                    continue
                size = live.pop(key)
                self._bytes[name] -= size
                ghost[key] = size
                self._bytes[ghost_name] += size
                self._trim_ghosts()
                return key
        return None

    def _trim_ghosts(self) -> None:
        b, cap = self._bytes, self.capacity_bytes
        while self._b1 and b["t1"] + b["b1"] > cap:
            b["b1"] -= self._b1.popitem(last=False)[1]
            self.num_steps += 1
        while (self._b1 or self._b2) and sum(b.values()) > 2 * cap:
            ghost, name = (self._b2, "b2") if self._b2 else (self._b1, "b1")
            b[name] -= ghost.popitem(last=False)[1]
            self.num_steps += 1

    def remove(self, key: Key) -> None:
        for name, live in (("t1", self._t1), ("t2", self._t2)):
            size = live.pop(key, None)
            if size is not None:
                self._bytes[name] -= size

    def clear(self) -> None:
        for part in (self._t1, self._t2, self._b1, self._b2):
            part.clear()
        self._bytes = dict.fromkeys(self._bytes, 0)
        self._target_t1 = 0.0
