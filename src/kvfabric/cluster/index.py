"""The controller's global chunk index: chunk key -> {instance: tiers}, plus the registered instances.

Contract (one suite in tests/test_cluster_index.py runs on every backend):
- `register(info, reset)` records an instance (address, tiers fastest first, key namespaces) and its heartbeat
  time; with `reset` its old entries are dropped first (a restarted worker re-sends everything).
- `heartbeat(id, tiers, now)` refreshes an instance; False if the index does not know it (the worker then
  registers again and re-sends its keys).
- `apply(id, admit, evict)` adds / removes (tier -> keys) entries of one instance; unknown instances are refused.
- `locate(keys)` -> for each key {instance_id: [tiers]} (only what was reported; liveness is the caller's filter).
- `expire(cutoff)` drops every instance whose last heartbeat is older than `cutoff` and all of its entries.
- `drop(id, tier=None)` removes an instance's entries (one tier or all); `unregister(id)` removes it entirely.
- Safe under concurrent callers (threads; for RedisIndex also several controller processes: every operation is
  a set of single-key commands, so it works on Redis Cluster too, and a restarted controller loses nothing).

Here: the data model (`Namespace`, `TierInfo`, `InstanceInfo`, which round-trips through JSON for the Redis
backend), the `ChunkIndex` protocol, and `open_index`, which picks a backend: `index_memory.MemoryIndex` or
`index_redis.RedisIndex` (each imported only when chosen).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvfabric.kv.hashing import KeySpace


@dataclass(frozen=True, slots=True)
class Namespace:
    """How an instance turns tokens into chunk keys (hashing.chunk_keys): the root key and its parameters."""
    model_id: str
    root: str  # hex of the KeySpace root
    chunk_size: int
    hash: str = "sha256"
    partial: bool = False

    @classmethod
    def of(cls, space: KeySpace) -> Namespace:
        """The wire form of a key space."""
        return cls(space.model_id, space.root.hex(), space.chunk_size, space.hash_name, space.include_partial)

    def key_space(self) -> KeySpace:
        return KeySpace(bytes.fromhex(self.root), self.chunk_size, self.hash, self.partial, self.model_id)


@dataclass(frozen=True, slots=True)
class TierInfo:
    name: str
    capacity_bytes: int = 0
    num_chunks: int = 0
    num_bytes: int = 0


@dataclass(slots=True)
class InstanceInfo:
    instance_id: str
    host: str
    port: int
    tiers: list[TierInfo] = field(default_factory=list)  # fastest first
    namespaces: list[Namespace] = field(default_factory=list)
    registered_at: float = 0.0
    last_seen: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> InstanceInfo:
        return cls(instance_id=data["instance_id"], host=data["host"], port=int(data["port"]),
                   tiers=[TierInfo(**t) for t in data.get("tiers", [])],
                   namespaces=[Namespace(**n) for n in data.get("namespaces", [])],
                   registered_at=float(data.get("registered_at", 0.0)), last_seen=float(data.get("last_seen", 0.0)))


class ChunkIndex(Protocol):
    backend: str

    def register(self, info: InstanceInfo, reset: bool = True) -> None: ...

    def heartbeat(self, instance_id: str, tiers: Sequence[TierInfo] | None, now: float) -> bool: ...

    def unregister(self, instance_id: str) -> bool: ...

    def instances(self) -> list[InstanceInfo]: ...

    def get_instance(self, instance_id: str) -> InstanceInfo | None: ...

    def apply(self, instance_id: str, admit: Mapping[str, Sequence[bytes]],
              evict: Mapping[str, Sequence[bytes]]) -> bool: ...

    def drop(self, instance_id: str, tier: str | None = None) -> int: ...

    def locate(self, keys: Sequence[bytes]) -> list[dict[str, list[str]]]: ...

    def counts(self, instance_id: str) -> dict[str, int]: ...

    def expire(self, cutoff: float) -> list[str]: ...

    def ping(self) -> bool: ...

    def close(self) -> None: ...


def open_index(url: str | None, *, is_cluster: bool = False, prefix: str = "kvfc:") -> ChunkIndex:
    """'memory' (or empty) -> MemoryIndex; redis://, rediss://, unix:// -> RedisIndex (is_cluster for a
    Redis Cluster; the scheme redis+cluster:// is accepted as shorthand)."""
    from kvfabric.cluster.index_memory import MemoryIndex
    from kvfabric.cluster.index_redis import RedisIndex
    if not url or url == "memory":
        return MemoryIndex()
    if url.startswith("redis+cluster://"):
        return RedisIndex("redis://" + url[len("redis+cluster://"):], is_cluster=True, prefix=prefix)
    if url.split("://", 1)[0] in ("redis", "rediss", "unix"):
        return RedisIndex(url, is_cluster=is_cluster, prefix=prefix)
    raise ValueError(f"index url must be 'memory' or redis://..., got {url!r}")
