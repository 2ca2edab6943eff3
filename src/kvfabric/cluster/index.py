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

Modules: `index_types` (Namespace, TierInfo, InstanceInfo, the ChunkIndex protocol, group_keys), `index_memory`
(MemoryIndex), `index_redis` (RedisIndex); this module re-exports them all and picks one with `open_index`.
"""
from __future__ import annotations

from kvfabric.cluster.index_memory import MemoryIndex
from kvfabric.cluster.index_redis import RedisIndex
from kvfabric.cluster.index_types import ChunkIndex, InstanceInfo, Namespace, TierInfo, group_keys

__all__ = ["ChunkIndex", "InstanceInfo", "MemoryIndex", "Namespace", "RedisIndex", "TierInfo", "group_keys",
           "open_index"]


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
