"""Shared types of the cache policies: per-access metadata, the eviction and admission protocols, results.

Contract (tests/policy_contract.py runs one suite on every eviction policy):
- A policy does bookkeeping only, never data: it learns which keys are resident (`admit`), which were hit
  (`touch`), which were deleted (`remove`), and names the next key to evict (`victim`).
- `victim(pinned)` picks a resident key that is not in `pinned`, forgets it as evicted (a policy with ghost
  lists remembers it there) and returns it; None when every resident key is pinned. It may return the key
  admitted last: that is a bypass (the policy judged the newcomer the least valuable), and the caller refuses
  the admission. `remove(key)` forgets a key without counting it as evicted (an explicit delete).
- Bytes are bounded by the caller (`PolicyIndex`), which calls `victim` until the new key fits; a policy only
  keeps the byte counts its own decisions need (S3-FIFO's small queue, ARC's targets).
- Bookkeeping costs O(1) per access, amortized: every loop a policy runs counts its iterations in `num_steps`
  so that tests check the bound by counting, not by timing.
- Deterministic: the same sequence of calls gives the same victims in every process (no `hash()` of bytes,
  no iteration over sets, explicit seeds).
"""
from __future__ import annotations

from collections.abc import Container, Hashable
from dataclasses import dataclass
from typing import Protocol

Key = Hashable  # a chunk key (bytes) in the tiers, an int block id in the trace simulator


@dataclass(frozen=True, slots=True)
class AccessMeta:
    """What the caller knows about one access of a chunk.

    position: the chunk's index in its prompt (0 = first chunk). The chunk is only useful when chunks
      0..position-1 hit too, so a prompt's tail is cheaper to lose than its head.
    num_chunks: chunks in the prompt of this access (the tail is position == num_chunks - 1).
    num_tokens: tokens the chunk covers.
    miss_cost_s: seconds a miss of this chunk costs the request: recomputing its tokens (prefill), or loading
      it from the next tier when that tier holds it. 0 = unknown.
    """

    position: int = 0
    num_chunks: int = 1
    num_tokens: int = 0
    miss_cost_s: float = 0.0


NO_META = AccessMeta()


class EvictionPolicy(Protocol):
    name: str
    num_steps: int  # loop iterations so far (the O(1) check counts these)

    def __len__(self) -> int: ...

    def admit(self, key: Key, size: int, meta: AccessMeta) -> None:
        """Record a newly stored key (not resident before)."""

    def touch(self, key: Key, meta: AccessMeta) -> None:
        """Record a hit on a resident key."""

    def victim(self, pinned: Container[Key]) -> Key | None:
        """Choose, forget and return the next key to evict (never one in `pinned`); None if all are pinned."""

    def remove(self, key: Key) -> None:
        """Forget a resident key that the caller deleted (no-op for an unknown key)."""

    def clear(self) -> None: ...


class AdmissionPolicy(Protocol):
    name: str

    def record(self, key: Key) -> None:
        """Count an access of a resident key (a hit)."""

    def admit(self, key: Key, meta: AccessMeta) -> bool:
        """Count an access of a key that is not resident and say whether to store it."""

    def clear(self) -> None: ...


@dataclass(frozen=True, slots=True)
class IndexStats:
    num_keys: int
    num_bytes: int
    capacity_bytes: int
    num_hits: int
    num_admitted: int
    num_refused: int
    num_evicted: int
