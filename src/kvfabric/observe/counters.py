"""Named integer counters that any thread may bump.

Contract: `add(name, n)` is atomic (one lock; `counter[name] += n` on a plain dict or Counter is a read then a
write, and two threads can lose an update or, while a third copies the dict, raise "dictionary changed size
during iteration"). `snapshot()` is a consistent copy. `get(name)` is 0 for a name never bumped. Cheap enough for
per-chunk use (a lock and a dict update); not meant for per-token loops.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Mapping


class Counters:
    __slots__ = ("_lock", "_values")

    def __init__(self, initial: Mapping[str, int] | None = None) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter(initial or {})

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def get(self, name: str, default: int = 0) -> int:
        return self._values.get(name, default)

    def __getitem__(self, name: str) -> int:
        return self.get(name)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def __iter__(self) -> Iterator[str]:
        return iter(self.snapshot())

    def __repr__(self) -> str:
        return f"Counters({self.snapshot()!r})"


def merged(*parts: Counters | Mapping[str, int]) -> dict[str, int]:
    """The sum of several counter sets, as a plain dict (for stats reports)."""
    total: Counter[str] = Counter()
    for part in parts:
        total.update(part.snapshot() if isinstance(part, Counters) else part)
    return dict(total)
