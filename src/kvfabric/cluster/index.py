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
"""
from __future__ import annotations

import json
import threading
import time
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


class RedisIndex:
    """The index in Redis (or Redis Cluster): several controllers share it and a restart loses nothing.

    Keys (prefix `kvfc:` by default; every command touches one key, so any slot layout works):
      <p>instances        hash  instance id -> instance JSON (address, tiers, namespaces, registered_at)
      <p>alive            zset  instance id -> last heartbeat (unix time)
      <p>c:<key hex>      hash  "<instance>|<tier>" -> 1: who holds the chunk
      <p>o:<id>:<tier>    set   the raw chunk keys an instance holds in a tier (to drop them)
      <p>ot:<id>          set   the tiers for which <p>o:<id>:<tier> exists
    """
    backend = "redis"
    BATCH = 1000

    def __init__(self, url: str, *, is_cluster: bool = False, prefix: str = "kvfc:", timeout_s: float = 2.0,
                 client: Any = None) -> None:
        import redis
        import redis.cluster
        self.url = url
        self.prefix = prefix
        if client is not None:
            self._r = client
        elif is_cluster:
            self._r = redis.cluster.RedisCluster.from_url(url, socket_timeout=timeout_s,
                                                          socket_connect_timeout=timeout_s)
        else:
            self._r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.is_cluster = is_cluster

    # ---- key names -----------------------------------------------------------------------------------------
    def _k(self, name: str) -> str:
        return self.prefix + name

    def _chunk(self, key: bytes) -> str:
        return f"{self.prefix}c:{key.hex()}"

    def _owned(self, instance_id: str, tier: str) -> str:
        return f"{self.prefix}o:{instance_id}:{tier}"

    def _pipe(self) -> Any:
        return self._r.pipeline(transaction=False)

    # ---- instances -----------------------------------------------------------------------------------------
    def register(self, info: InstanceInfo, reset: bool = True) -> None:
        if reset:
            self.drop(info.instance_id)
        now = time.time()
        info.registered_at = info.registered_at or now
        info.last_seen = info.last_seen or now
        data = info.to_json()
        data.pop("last_seen")
        self._r.hset(self._k("instances"), info.instance_id, json.dumps(data))
        self._r.zadd(self._k("alive"), {info.instance_id: info.last_seen})

    def heartbeat(self, instance_id: str, tiers: Sequence[TierInfo] | None, now: float) -> bool:
        if self._r.zscore(self._k("alive"), instance_id) is None:
            return False
        self._r.zadd(self._k("alive"), {instance_id: now}, xx=True)
        if tiers is not None:
            raw = self._r.hget(self._k("instances"), instance_id)
            if raw is not None:
                data = json.loads(raw)
                data["tiers"] = [asdict(t) for t in tiers]
                self._r.hset(self._k("instances"), instance_id, json.dumps(data))
        return True

    def unregister(self, instance_id: str) -> bool:
        self.drop(instance_id)
        self._r.zrem(self._k("alive"), instance_id)
        return bool(self._r.hdel(self._k("instances"), instance_id))

    def instances(self) -> list[InstanceInfo]:
        raw = self._r.hgetall(self._k("instances"))
        seen = dict(self._r.zrange(self._k("alive"), 0, -1, withscores=True))
        out = []
        for instance_id, data in raw.items():
            info = InstanceInfo.from_json(json.loads(data))
            score = seen.get(instance_id)
            if score is None:
                continue  # half-unregistered
            info.last_seen = float(score)
            out.append(info)
        return out

    def get_instance(self, instance_id: str) -> InstanceInfo | None:
        raw = self._r.hget(self._k("instances"), instance_id)
        score = self._r.zscore(self._k("alive"), instance_id)
        if raw is None or score is None:
            return None
        info = InstanceInfo.from_json(json.loads(raw))
        info.last_seen = float(score)
        return info

    # ---- entries -------------------------------------------------------------------------------------------
    def apply(self, instance_id: str, admit: Mapping[str, Sequence[bytes]],
              evict: Mapping[str, Sequence[bytes]]) -> bool:
        if self._r.zscore(self._k("alive"), instance_id) is None:
            return False
        ops: list[tuple[str, str, bytes]] = [("+", t, k) for t, keys in admit.items() for k in keys]
        ops += [("-", t, k) for t, keys in evict.items() for k in keys]
        tiers = {t for t, keys in admit.items() if keys}
        if tiers:
            self._r.sadd(self._k(f"ot:{instance_id}"), *sorted(tiers))
        for start in range(0, len(ops), self.BATCH):
            pipe = self._pipe()
            for op, tier, key in ops[start:start + self.BATCH]:
                field_name = f"{instance_id}|{tier}"
                if op == "+":
                    pipe.hset(self._chunk(key), field_name, 1)
                    pipe.sadd(self._owned(instance_id, tier), key)
                else:
                    pipe.hdel(self._chunk(key), field_name)
                    pipe.srem(self._owned(instance_id, tier), key)
            pipe.execute()
        return True

    def drop(self, instance_id: str, tier: str | None = None) -> int:
        if tier is None:
            tiers = [t.decode() if isinstance(t, bytes) else t
                     for t in self._r.smembers(self._k(f"ot:{instance_id}"))]
        else:
            tiers = [tier]
        num = 0
        for name in tiers:
            owned = self._owned(instance_id, name)
            field_name = f"{instance_id}|{name}"
            batch: list[bytes] = []
            for key in self._r.sscan_iter(owned, count=self.BATCH):
                batch.append(key)
                if len(batch) >= self.BATCH:
                    num += self._hdel_all(batch, field_name)
                    batch = []
            num += self._hdel_all(batch, field_name)
            self._r.delete(owned)
            self._r.srem(self._k(f"ot:{instance_id}"), name)
        return num

    def _hdel_all(self, keys: list[bytes], field_name: str) -> int:
        if not keys:
            return 0
        pipe = self._pipe()
        for key in keys:
            pipe.hdel(self._chunk(key), field_name)
        pipe.execute()
        return len(keys)

    def locate(self, keys: Sequence[bytes]) -> list[dict[str, list[str]]]:
        out: list[dict[str, list[str]]] = []
        for start in range(0, len(keys), self.BATCH):
            pipe = self._pipe()
            for key in keys[start:start + self.BATCH]:
                pipe.hkeys(self._chunk(key))
            for fields in pipe.execute():
                holders: dict[str, list[str]] = {}
                for raw in fields:
                    name = raw.decode() if isinstance(raw, bytes) else raw
                    instance_id, _, tier = name.rpartition("|")
                    holders.setdefault(instance_id, []).append(tier)
                out.append({i: sorted(t) for i, t in holders.items()})
        return out

    def counts(self, instance_id: str) -> dict[str, int]:
        tiers = [t.decode() if isinstance(t, bytes) else t for t in self._r.smembers(self._k(f"ot:{instance_id}"))]
        return {name: int(self._r.scard(self._owned(instance_id, name))) for name in sorted(tiers)}

    def expire(self, cutoff: float) -> list[str]:
        gone = []
        for raw in self._r.zrangebyscore(self._k("alive"), "-inf", f"({cutoff}"):
            instance_id = raw.decode() if isinstance(raw, bytes) else raw
            # another controller may have refreshed or expired it meanwhile: re-check the score
            score = self._r.zscore(self._k("alive"), instance_id)
            if score is not None and score >= cutoff:
                continue
            self.unregister(instance_id)
            gone.append(instance_id)
        return gone

    def ping(self) -> bool:
        try:
            return bool(self._r.ping())
        except Exception:
            return False

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:
            pass


def open_index(url: str | None, *, is_cluster: bool = False, prefix: str = "kvfc:") -> ChunkIndex:
    """'memory' (or empty) -> MemoryIndex; redis://, rediss://, unix:// -> RedisIndex (is_cluster for a
    Redis Cluster; the scheme redis+cluster:// is accepted as shorthand)."""
    if not url or url == "memory":
        return MemoryIndex()
    if url.startswith("redis+cluster://"):
        return RedisIndex("redis://" + url[len("redis+cluster://"):], is_cluster=True, prefix=prefix)
    if url.split("://", 1)[0] in ("redis", "rediss", "unix"):
        return RedisIndex(url, is_cluster=is_cluster, prefix=prefix)
    raise ValueError(f"index url must be 'memory' or redis://..., got {url!r}")


def group_keys(items: Iterable[tuple[str, bytes]]) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for tier, key in items:
        out.setdefault(tier, []).append(key)
    return out
