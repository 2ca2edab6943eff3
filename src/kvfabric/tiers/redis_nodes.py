"""The redis tier's view of a Redis Cluster's nodes: which node serves a key, and a circuit breaker per node.

Contract:
- `node_of(client, name)`: the name (host:port) of the primary serving the hash slot of key `name`, read from the
  redis-py RedisCluster client's slot map: no network. None when the map does not cover the slot.
- `by_node(client, names)`: the positions of `names` grouped by `node_of`, as `NodeBatch`es in order of first
  appearance (one round trip per node); `client` None (not built yet): one batch of every position, node None.
- `NodeBreakers(failures, backoff_max_s, clock)`: one kvfabric.net.breaker.CircuitBreaker per node name, made on
  first use with these settings, so that an unreachable node's failures open only its own breaker.
  `open_nodes()` names the nodes whose breaker is open. Thread safe.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisClusterException

from kvfabric.net.breaker import CircuitBreaker


@dataclass(frozen=True, slots=True)
class NodeBatch:
    node: str | None  # None: not known (no client yet, or a slot the map does not cover)
    positions: tuple[int, ...]


def node_of(client: Any, name: bytes) -> str | None:
    try:
        node = client.get_node_from_key(name)
    except RedisClusterException:  # SlotNotCoveredError: the map has no node for that slot
        return None
    return None if node is None else str(node.name)


def by_node(client: Any, names: Sequence[bytes]) -> list[NodeBatch]:
    if client is None:
        return [NodeBatch(None, tuple(range(len(names))))]
    groups: dict[str | None, list[int]] = {}
    for position, name in enumerate(names):
        groups.setdefault(node_of(client, name), []).append(position)
    return [NodeBatch(node, tuple(positions)) for node, positions in groups.items()]


class NodeBreakers:
    def __init__(self, failures: int, backoff_max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = failures
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._breakers: dict[str, CircuitBreaker] = {}
        self._lock = threading.Lock()

    def get(self, node: str) -> CircuitBreaker:
        breaker = self._breakers.get(node)
        if breaker is None:
            with self._lock:
                breaker = self._breakers.setdefault(
                    node, CircuitBreaker(self.failures, self.backoff_max_s, clock=self._clock))
        return breaker

    def open_nodes(self) -> list[str]:
        with self._lock:
            return sorted(node for node, breaker in self._breakers.items() if breaker.is_open)
