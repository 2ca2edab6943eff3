"""The chunk index's data model and interface: what an instance registers, and the `ChunkIndex` protocol.

- `Namespace`, `TierInfo`, `InstanceInfo`: an instance's key namespaces, tiers (fastest first) and address, as
  registered; `InstanceInfo.to_json` / `from_json` round-trip it through JSON (the Redis backend stores that).
- `ChunkIndex`: the operations every backend implements; their contract is in `kvfabric.cluster.index`.
- `group_keys`: (tier, key) pairs -> tier -> keys, the shape `ChunkIndex.apply` takes.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Namespace:
    """How an instance turns tokens into chunk keys (hashing.chunk_keys): the root key and its parameters."""
    model_id: str
    root: str  # hex of hashing.root_key(...)
    chunk_size: int
    hash: str = "sha256"
    partial: bool = False


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


def group_keys(items: Iterable[tuple[str, bytes]]) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for tier, key in items:
        out.setdefault(tier, []).append(key)
    return out
