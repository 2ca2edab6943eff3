"""ShareTuner: pick PrefixHeat's probation share by miniature simulation (Waldspurger et al., ATC 2017).

A fixed 1/`sample` of the keys (chosen by a hash of the key, so a key is always in or always out) is replayed
through one shadow cache per candidate share, each `capacity / sample` bytes: a shadow sees the same workload
at the same relative size, on a sample. Every `period` sampled accesses that some shadow missed (accesses
that all shadows hit, such as a system prompt's chunk, say nothing about the shares) the live policy takes
the share whose shadow had the most hits, unless the current share is within `margin` of it (switching
reshapes the queues, so noise must not flip it). Hits decay by half per period, so the choice follows the
workload. Cost: one hash per access, and the shadows' bookkeeping on the sampled 1/`sample` of them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kvfabric.tiers.policies.index import PolicyIndex
from kvfabric.tiers.policies.types import AccessMeta, EvictionPolicy, Key

DEFAULT_SHARES = (0.01, 0.1, 1.0)


class ShareTuner:
    def __init__(self, capacity_bytes: int, make_shadow: Callable[[int, float], EvictionPolicy],
                 shares: Sequence[float] = DEFAULT_SHARES, sample: int = 32, period: int = 256,
                 current: float | None = None, margin: float = 0.01) -> None:
        if sample < 1 or sample > 256 or period < 1 or not shares:
            raise ValueError(f"need 1 <= sample <= 256, period >= 1 and shares; got {sample}, {period}, {shares}")
        self.shares = tuple(shares)
        self.threshold = 256 // sample  # keys with sample_bucket(key) below this are replayed
        self.period = period
        self.margin = margin
        capacity = max(1, capacity_bytes // sample)
        self._shadows = [PolicyIndex(capacity, make_shadow(capacity, share)) for share in self.shares]
        self.hits = [0.0] * len(self.shares)
        self.current = self.shares.index(current) if current in self.shares else None
        self._num_events = 0
        self._num_replays = 0

    @property
    def num_steps(self) -> int:
        """Shadow replays plus the shadows' own loop iterations (the O(1) check counts them too)."""
        return self._num_replays + sum(shadow.policy.num_steps for shadow in self._shadows)

    def observe(self, key: Key, size: int, meta: AccessMeta) -> float | None:
        """Replay one access of a sampled key (the caller checks `sample_bucket(key) < threshold`); at the end
        of a period, return the share to use."""
        num_hits = 0
        for i, shadow in enumerate(self._shadows):
            if shadow.touch(key, meta):
                self.hits[i] += 1.0
                num_hits += 1
            else:
                shadow.add(key, size, meta)
        self._num_replays += len(self._shadows)
        if num_hits == len(self._shadows):
            return None
        self._num_events += 1
        if self._num_events % self.period:
            return None
        best = max(range(len(self.shares)), key=self.hits.__getitem__)
        if self.current is None or self.hits[best] > (1.0 + self.margin) * self.hits[self.current]:
            self.current = best
        self.hits = [h * 0.5 for h in self.hits]
        return self.shares[self.current]
