"""Which pool slot holds what, and who may read or write it: the server's bookkeeping of the shared pool.

A slot is FREE, ALLOCATED (being written: by the server decoding into it, or by a client that leased it for a
store; no key yet) or READY (holds the decoded KV of one chunk key, immutable). References keep a slot from being
reused: client leases (per `Holder`, i.e. per connection) and server holds (a decode or an encode in progress).
A READY slot with no reference is idle: an LRU cache of decoded chunks, evicted oldest first when a slot is needed.

Contract:
- `lease(key, holder)`: a READY slot of `key`, leased, or None. `allocate(holder)`: a slot to write, leased by
  `holder` (None: held by the server), or None when every slot is referenced. Both raise SlotCapError when the
  holder already has `max_per_holder` leases: a client can pin at most that many slots.
- `publish(slot, key)`: ALLOCATED -> READY under key; False (the slot stays unindexed and is freed on its last
  release) when another slot already holds the key.
- `commit(slot, key, holder)`: a slot the holder leased for writing becomes READY under key and is held for the
  encode (`unhold` when persisted). False, and the slot freed, if the holder did not lease it for writing or the
  key is already held.
- `release(slot, holder)` / `release_all(holder)`: an uncommitted written slot goes back to FREE, never READY: a
  client killed mid-write never publishes a partial chunk. A release of a slot the holder does not lease is
  ignored (a confused client cannot free another's slot).
- Thread-safe (one lock; every call is O(1) or O(slots of one holder)).
"""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field


class SlotCapError(RuntimeError):
    """The holder already leases as many slots as it may."""


@dataclass(eq=False)
class Holder:
    """One connection's leases."""
    name: str
    leases: Counter[int] = field(default_factory=Counter)
    writing: set[int] = field(default_factory=set)

    @property
    def num_leased(self) -> int:
        return sum(self.leases.values())


class SlotTable:
    def __init__(self, num_slots: int, max_per_holder: int) -> None:
        self.num_slots = num_slots
        self.max_per_holder = max_per_holder
        self._lock = threading.Lock()
        self._refs = [0] * num_slots
        self._key: list[bytes | None] = [None] * num_slots
        self._slot_of: dict[bytes, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._idle: OrderedDict[int, None] = OrderedDict()  # READY, unreferenced: least recently used first
        self.num_evicted = 0

    # ---- reads -------------------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return key in self._slot_of

    def lease(self, key: bytes, holder: Holder) -> int | None:
        with self._lock:
            slot = self._slot_of.get(key)
            if slot is None:
                return None
            self._check_cap(holder)
            self._ref(slot)
            holder.leases[slot] += 1
            return slot

    def allocate(self, holder: Holder | None) -> int | None:
        with self._lock:
            if holder is not None:
                self._check_cap(holder)
            if self._free:
                slot = self._free.pop()
            elif self._idle:
                slot, _ = self._idle.popitem(last=False)
                del self._slot_of[self._key[slot]]  # type: ignore[arg-type]
                self._key[slot] = None
                self.num_evicted += 1
            else:
                return None
            self._refs[slot] = 1
            if holder is not None:
                holder.leases[slot] += 1
            return slot

    def lease_for_write(self, holder: Holder) -> int | None:
        slot = self.allocate(holder)
        if slot is not None:
            with self._lock:
                holder.writing.add(slot)
        return slot

    def publish(self, slot: int, key: bytes) -> bool:
        with self._lock:
            if key in self._slot_of or self._key[slot] is not None:
                return False
            self._key[slot] = key
            self._slot_of[key] = slot
            return True

    def commit(self, slot: int, key: bytes, holder: Holder) -> bool:
        with self._lock:
            if slot not in holder.writing:
                return False
            holder.writing.discard(slot)
            published = key not in self._slot_of
            if published:
                self._key[slot] = key
                self._slot_of[key] = slot
                self._refs[slot] += 1  # the server's hold until the chunk is persisted
            self._drop_lease(slot, holder)
            return published

    # ---- references --------------------------------------------------------------------------------------
    def unhold(self, slot: int) -> None:
        with self._lock:
            self._unref(slot)

    def release(self, slot: int, holder: Holder) -> None:
        with self._lock:
            if holder.leases.get(slot, 0) > 0:
                holder.writing.discard(slot)
                self._drop_lease(slot, holder)

    def release_all(self, holder: Holder) -> int:
        with self._lock:
            num = 0
            for slot, count in list(holder.leases.items()):
                for _ in range(count):
                    self._unref(slot)
                num += count
            holder.leases.clear()
            holder.writing.clear()
            return num

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"slots": self.num_slots, "free": len(self._free), "idle": len(self._idle),
                    "ready": len(self._slot_of), "referenced": sum(1 for r in self._refs if r), "evicted":
                    self.num_evicted}

    # ---- internals (lock held) ----------------------------------------------------------------------------
    def _check_cap(self, holder: Holder) -> None:
        if holder.num_leased >= self.max_per_holder:
            raise SlotCapError(f"{holder.name} already leases {holder.num_leased} slots")

    def _ref(self, slot: int) -> None:
        if self._refs[slot] == 0:
            self._idle.pop(slot, None)
        self._refs[slot] += 1

    def _unref(self, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot] > 0:
            return
        if self._key[slot] is not None:
            self._idle[slot] = None
        else:
            self._free.append(slot)

    def _drop_lease(self, slot: int, holder: Holder) -> None:
        holder.leases[slot] -= 1
        if holder.leases[slot] <= 0:
            del holder.leases[slot]
        self._unref(slot)
