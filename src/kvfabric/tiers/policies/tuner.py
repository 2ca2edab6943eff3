"""ShareTuner: pick PrefixHeat's probation share by miniature simulation (Waldspurger et al., ATC 2017).

A fixed 1/`sample` of the keys (chosen by a hash of the key, so a key is always in or always out) is replayed
through one shadow cache per candidate share, each `capacity / sample` bytes: a shadow sees the same workload
at the same relative size, on a sample. Every `period` sampled accesses the live policy takes the share whose
shadow had the most hits (hits decay by half per period, so the choice follows the workload). Cost: one hash
per access, and the shadows' bookkeeping on the sampled 1/`sample` of them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kvfabric.tiers.policies.index import PolicyIndex
from kvfabric.tiers.policies.types import AccessMeta, EvictionPolicy, Key

DEFAULT_SHARES = (0.01, 0.1, 0.5)


class ShareTuner:
    def __init__(self, capacity_bytes: int, make_shadow: Callable[[int, float], EvictionPolicy],
                 shares: Sequence[float] = DEFAULT_SHARES, sample: int = 64, period: int = 1024) -> None:
        if sample < 1 or sample > 256 or period < 1 or not shares:
            raise ValueError(f"need 1 <= sample <= 256, period >= 1 and some shares; got {sample}, {period}, {shares}")
        self.shares = tuple(shares)
        self.threshold = 256 // sample  # keys with sample_bucket(key) below this are replayed
        self.period = period
        capacity = max(1, capacity_bytes // sample)
        self._shadows = [PolicyIndex(capacity, make_shadow(capacity, share)) for share in self.shares]
        self.hits = [0.0] * len(self.shares)
        self._num_sampled = 0
        self.num_steps = 0

    def observe(self, key: Key, size: int, meta: AccessMeta) -> float | None:
        """Replay one access of a sampled key (the caller checks `sample_bucket(key) < threshold`); every
        `period` sampled accesses, return the best share."""
        for i, shadow in enumerate(self._shadows):
            if shadow.touch(key, meta):
                self.hits[i] += 1.0
            else:
                shadow.add(key, size, meta)
        self.num_steps += len(self._shadows)
        self._num_sampled += 1
        if self._num_sampled % self.period:
            return None
        best = max(range(len(self.shares)), key=self.hits.__getitem__)
        self.hits = [h * 0.5 for h in self.hits]
        return self.shares[best]

    def clear(self) -> None:
        for shadow in self._shadows:
            shadow.clear()
        self.hits = [0.0] * len(self.shares)
        self._num_sampled = 0
