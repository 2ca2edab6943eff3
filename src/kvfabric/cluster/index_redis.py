"""`RedisIndex`: the chunk index in Redis or Redis Cluster, shared by several controllers.

Implements `ChunkIndex` (contract in `kvfabric.cluster.index`). Every operation is a set of single-key commands
(pipelined in batches, never a transaction), so it works with any slot layout and a restarted controller loses
nothing. The key layout is in the class docstring. `redis` is imported only when an instance is created.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from kvfabric.cluster.index import InstanceInfo, TierInfo


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
