"""Cache policies for the tiers: eviction (LRU, LFU with aging, S3-FIFO, ARC, prefix-aware heat/cost), admission
(always, second access, TinyLFU), Belady's offline optimum, and `PolicyIndex`, the byte-bounded index that
owns them. Nothing here imports the rest of kvfabric: tiers use it, it uses no tier.

`make_eviction(name, capacity_bytes)` and `make_admission(name, num_entries)` build a policy by its config
name (`EVICTION_NAMES`, `ADMISSION_NAMES`).
"""
from __future__ import annotations

from kvfabric.tiers.policies.admission import AlwaysAdmit, SecondAccess, TinyLFU
from kvfabric.tiers.policies.arc import ARC
from kvfabric.tiers.policies.belady import Belady, BeladyFuture
from kvfabric.tiers.policies.heat import PrefixHeat
from kvfabric.tiers.policies.index import PolicyIndex
from kvfabric.tiers.policies.keyhash import key_hash64
from kvfabric.tiers.policies.lfu import LFU
from kvfabric.tiers.policies.lru import LRU
from kvfabric.tiers.policies.s3fifo import S3FIFO
from kvfabric.tiers.policies.types import NO_META, AccessMeta, AdmissionPolicy, EvictionPolicy, IndexStats, Key

EVICTION_NAMES = ("heat", "lru", "lfu", "s3fifo", "arc")
DEFAULT_EVICTION = "heat"
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


__all__ = [
    "ADMISSION_NAMES", "ARC", "DEFAULT_EVICTION", "EVICTION_NAMES", "LFU", "LRU", "NO_META", "S3FIFO", "AccessMeta",
    "AdmissionPolicy", "AlwaysAdmit", "Belady", "BeladyFuture", "EvictionPolicy", "IndexStats", "Key",
    "PolicyIndex", "PrefixHeat", "SecondAccess", "TinyLFU", "key_hash64", "make_admission", "make_eviction"
]
