"""Cache policies for the tiers: eviction (LRU, LFU with aging, S3-FIFO, ARC, prefix-aware heat/cost), admission
(always, second access, TinyLFU) and `PolicyIndex`, the byte-bounded index that owns them. Nothing here imports the
rest of kvfabric: tiers use it, it uses no tier. Belady's offline optimum, a bound for benchmarks that reads the
future, is not a policy to ship: it lives in kvfabric.research.belady (`kvfabric bench trace` builds it there).

`make_eviction(name, capacity_bytes)` and `make_admission(name, num_entries)` build a policy by its config
name (`EVICTION_NAMES`, `ADMISSION_NAMES`, the same as config's `EvictionName` / `AdmissionName`);
`make_index(capacity_bytes, eviction, admission, on_evict)` a tier's whole index ("always" = no admission
policy; the others are sized at the first store, from the chunk size).
"""
from __future__ import annotations

from collections.abc import Callable

from kvfabric.tiers.policies.admission import AlwaysAdmit, SecondAccess, TinyLFU
from kvfabric.tiers.policies.arc import ARC
from kvfabric.tiers.policies.heat import PrefixHeat
from kvfabric.tiers.policies.index import PolicyIndex
from kvfabric.tiers.policies.keyhash import key_hash64
from kvfabric.tiers.policies.lfu import LFU
from kvfabric.tiers.policies.lru import LRU
from kvfabric.tiers.policies.s3fifo import S3FIFO
from kvfabric.tiers.policies.types import (
    NO_META,
    AccessMeta,
    AdmissionPolicy,
    EvictionPolicy,
    IndexStats,
    Key,
    prefill_cost_s,
)

EVICTION_NAMES = ("heat", "lru", "lfu", "s3fifo", "arc")
ADMISSION_NAMES = ("always", "second", "tinylfu")


def make_eviction(name: str, capacity_bytes: int) -> EvictionPolicy:
    classes = {"heat": PrefixHeat, "lru": LRU, "lfu": LFU, "s3fifo": S3FIFO, "arc": ARC}
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r}; allowed: {', '.join(EVICTION_NAMES)}")
    return classes[name](capacity_bytes)


def make_admission(name: str, num_entries: int) -> AdmissionPolicy:
    """`num_entries`: about how many keys the tier holds (sizes the window or the sketch)."""
    if name == "always":
        return AlwaysAdmit()
    if name == "second":
        return SecondAccess(window=max(1, 2 * num_entries))
    if name == "tinylfu":
        return TinyLFU(width=max(16, 2 * num_entries))
    raise ValueError(f"unknown admission policy {name!r}; allowed: {', '.join(ADMISSION_NAMES)}")


def make_index(capacity_bytes: int, eviction: str | EvictionPolicy = "lru", admission: str = "always",
               on_evict: Callable[[Key], None] | None = None) -> PolicyIndex:
    """`eviction`: a policy name, or a policy object (made for this capacity)."""
    policy = make_eviction(eviction, capacity_bytes) if isinstance(eviction, str) else eviction
    if admission == "always":
        return PolicyIndex(capacity_bytes, policy, on_evict=on_evict)
    make_admission(admission, 1)  # fail now on a bad name, not at the first store
    return PolicyIndex(capacity_bytes, policy, on_evict=on_evict,
                       admission_for=lambda num_entries: make_admission(admission, num_entries))


__all__ = [
    "ADMISSION_NAMES", "ARC", "EVICTION_NAMES", "LFU", "LRU", "NO_META", "S3FIFO", "AccessMeta",
    "AdmissionPolicy", "AlwaysAdmit", "EvictionPolicy", "IndexStats", "Key",
    "PolicyIndex", "PrefixHeat", "SecondAccess", "TinyLFU", "key_hash64", "make_admission", "make_eviction",
    "make_index", "prefill_cost_s"
]
