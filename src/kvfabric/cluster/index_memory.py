"""`MemoryIndex`: the chunk index in this process (the controller's embedded default).

Implements `ChunkIndex` (contract in `kvfabric.cluster.index`) with plain dicts under one lock: chunk key ->
{instance: tiers}, plus, per instance and tier, the keys it holds (so dropping an instance or a tier is
proportional to what it holds). Everything is lost when the controller stops; workers re-send on re-register.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

from kvfabric.cluster.index import InstanceInfo, TierInfo


class MemoryIndex:
    """In-process index (the embedded default): lost when the controller stops."""
    backend = "memory"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._instances: dict[str, InstanceInfo] = {}
        self._chunks: dict[bytes, dict[str, set[str]]] = {}
        self._owned: dict[str, dict[str, set[bytes]]] = {}

    def register(self, info: InstanceInfo, reset: bool = True) -> None:
        with self._lock:
            if reset:
                self._drop(info.instance_id, None)
            old = self._instances.get(info.instance_id)
            info.registered_at = info.registered_at or (old.registered_at if old and not reset else time.time())
            info.last_seen = info.last_seen or time.time()
            self._instances[info.instance_id] = info

    def heartbeat(self, instance_id: str, tiers: Sequence[TierInfo] | None, now: float) -> bool:
        with self._lock:
            info = self._instances.get(instance_id)
            if info is None:
                return False
            info.last_seen = now
            if tiers is not None:
                info.tiers = list(tiers)
            return True

    def unregister(self, instance_id: str) -> bool:
        with self._lock:
            self._drop(instance_id, None)
            return self._instances.pop(instance_id, None) is not None

    def instances(self) -> list[InstanceInfo]:
        with self._lock:
            return [InstanceInfo.from_json(i.to_json()) for i in self._instances.values()]

    def get_instance(self, instance_id: str) -> InstanceInfo | None:
        with self._lock:
            info = self._instances.get(instance_id)
            return None if info is None else InstanceInfo.from_json(info.to_json())

    def apply(self, instance_id: str, admit: Mapping[str, Sequence[bytes]],
              evict: Mapping[str, Sequence[bytes]]) -> bool:
        with self._lock:
            if instance_id not in self._instances:
                return False
            owned = self._owned.setdefault(instance_id, {})
            for tier, keys in admit.items():
                mine = owned.setdefault(tier, set())
                for key in keys:
                    self._chunks.setdefault(key, {}).setdefault(instance_id, set()).add(tier)
                    mine.add(key)
            for tier, keys in evict.items():
                mine = owned.get(tier, set())
                for key in keys:
                    self._remove(key, instance_id, tier)
                    mine.discard(key)
            return True

    def _remove(self, key: bytes, instance_id: str, tier: str) -> None:
        holders = self._chunks.get(key)
        if holders is None:
            return
        tiers = holders.get(instance_id)
        if tiers is not None:
            tiers.discard(tier)
            if not tiers:
                del holders[instance_id]
        if not holders:
            del self._chunks[key]

    def _drop(self, instance_id: str, tier: str | None) -> int:
        owned = self._owned.get(instance_id, {})
        num = 0
        for name in [tier] if tier is not None else list(owned):
            for key in owned.pop(name, set()):
                self._remove(key, instance_id, name)
                num += 1
        if not owned:
            self._owned.pop(instance_id, None)
        return num

    def drop(self, instance_id: str, tier: str | None = None) -> int:
        with self._lock:
            return self._drop(instance_id, tier)

    def locate(self, keys: Sequence[bytes]) -> list[dict[str, list[str]]]:
        with self._lock:
            out = []
            for key in keys:
                holders = self._chunks.get(key)
                out.append({i: sorted(t) for i, t in holders.items()} if holders else {})
            return out

    def counts(self, instance_id: str) -> dict[str, int]:
        with self._lock:
            return {tier: len(keys) for tier, keys in self._owned.get(instance_id, {}).items()}

    def expire(self, cutoff: float) -> list[str]:
        with self._lock:
            gone = [i for i, info in self._instances.items() if info.last_seen < cutoff]
            for instance_id in gone:
                self._drop(instance_id, None)
                del self._instances[instance_id]
            return gone

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        pass
