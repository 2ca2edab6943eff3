"""TierStack: ordered tiers, fastest first; read-through with promotion, write-behind to slow tiers, placement.

Contract:
- `prefix_length(keys)`: how many leading keys some tier holds (or a queued write holds). One batched call per
  tier, and only for keys the faster tiers did not have.
- `get(key, scratch, meta, permit)` (`get_many(keys, scratches)`: many, batched per tier, not promoted): the first
  tier holding a valid blob wins; blobs from untrusted tiers are
  verified (codec.format) and a damaged one is deleted from that tier, counted, and the next tier is tried. A
  chunk served below the first tier is promoted (placement.py: on its `promote_after`-th such read; exclusive
  placement moves it, write-through copies it). Reads below the first tier need a slow-read slot
  (`placement.max_slow_reads`): a load without one gets a miss there (counted `slow_read_refused`). `permit`
  (from `load_permit()`) lets the reads of one load share the slot it took; without, each read asks alone.
  `get(..., in_place=True)` (with promote=False): a tier that `is_zero_copy` hands out a view of its shared
  memory, verified there; the hit's `view.is_current()` tells its caller afterwards whether the bytes it copied
  were still that entry's. A view that fails its checks while it is no longer current was reused under the
  reader, not damaged: it is skipped (counted `view_reused`), never deleted.
- Tiers with `is_read_only` (a peer) are read from but never written to.
- `put(key, blob, per_level, meta)`: placement decides the tiers (`levels.store`: every writable tier, or the
  first one when exclusive); `per_level` gives some tiers (by index) their own encoding of the chunk (a
  per-tier codec); the others get `blob`. The first tier is written synchronously when it is trusted (process
  memory, cheap); every other tier is written by one background thread from a bounded queue
  (tiers/write_behind.py). A full queue drops
  the write and counts it: the engine's step never waits for disk or network. `flush()` waits for queued
  writes. Exclusive: a chunk a tier refuses (admission) goes to the next one instead, and what a policy-driven
  tier evicts is queued for the next one unchanged (demotion: same blob, no re-encoding; a demoted blob keeps
  its codec even when the next tier's config names another, blobs are self-describing). At `close`, what only
  process memory holds is written down too, so a restart finds it (exclusive's cost: a write at exit).
- `delete(keys)` removes chunks from every tier. Queued writes of those keys are cancelled and a write in
  progress is waited for (only that one): a delete never waits for the whole queue, which other threads may keep
  full (a flush there made deletes under load wait for seconds).
- Queued writes are readable before they land (`pending`), so a store is visible to lookups at once.
- Blobs for process memory may be unsealed (codec.format): the stack fills their checksums in before it writes
  them to any untrusted tier, and parses blobs of trusted tiers and queued writes without checksums.
- `meta` (AccessMeta: position in the prompt, miss cost) reaches the policy-driven tiers' policies (cpu, disk).
- Counters: hit.<tier>, bytes_read.<tier>, miss, promoted.<tier> / bytes_promoted.<tier> (into that tier),
  demoted.<tier> / bytes_demoted.<tier> (into that tier), failed_writes.<tier> (a put the tier declined or
  failed: admission refusals included), dropped_writes (queue full), slow_read_refused.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvfabric.codec.format import HEADER_BYTES, ChunkFormatError, ChunkHeader, check_payload, fill_checksums, parse
from kvfabric.config import PlacementConfig
from kvfabric.host.pages import Scratch
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob, RangedBlob, Tier, TierView
from kvfabric.tiers.placement import Levels, LoadPermit, PromotionCounter, SlowReads
from kvfabric.tiers.policies import NO_META, AccessMeta
from kvfabric.tiers.write_behind import Write, WriteBehind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StackHit:
    """A chunk found by `TierStack.get`: its blob, parsed header, and where it came from ("pending" for a write
    still queued). Verified, unless read with get(verify_payload=False) from an untrusted tier (`is_verified`
    False: its header is checked, its payload not yet; the caller hashes the payload as it copies it)."""
    blob: Blob
    header: ChunkHeader
    tier: str
    view: TierView | None = None  # a read in place (get(in_place=True)): check view.is_current() after use
    is_verified: bool = True
    ranged: RangedBlob | None = None  # get(ranged=True) from a ranged tier: `blob` is the header alone; close it
    level: int = 0  # the serving tier's place in the stack
    is_promoted: bool = False  # read with promote: `confirm` promotes an unverified hit once its payload checks


class TierStack:
    def __init__(self, tiers: Sequence[Tier], write_queue_size: int = 64,
                 placement: PlacementConfig = PlacementConfig()) -> None:
        if not tiers:
            raise ValueError("a tier stack needs at least one tier")
        self.tiers = list(tiers)
        self.placement = placement
        self.counters = Counters()
        self.levels = Levels(self.tiers, placement.mode)
        self._takes_meta = tuple(tier.is_policy_driven for tier in self.tiers)
        self._promotions = PromotionCounter(placement.promote_after)
        self._slow_reads = SlowReads(placement.max_slow_reads, placement.slow_read_wait_s)
        self._writer = WriteBehind(write_queue_size, self._put_counted, self.levels.demote_to, self.counters)
        for level, tier in enumerate(self.tiers):
            down = self.levels.demote_to(level)
            if down is not None:
                tier.set_evict_listener(lambda key, blob, down=down: self._write(key, blob, down, "demoted"))

    # ---- reads -------------------------------------------------------------------------------------------
    def prefix_length(self, keys: Sequence[bytes]) -> int:
        present = [self._writer.is_pending(key) for key in keys]
        for tier in self.tiers:
            first = present.index(False) if False in present else len(keys)
            if first == len(keys):
                break
            for i, hit in enumerate(tier.contains_many(keys[first:]), start=first):
                present[i] = present[i] or hit
        return present.index(False) if False in present else len(keys)

    def contains_many(self, keys: Sequence[bytes], writable_only: bool = False) -> list[bool]:
        """Which keys some tier holds; `writable_only` ignores read-only tiers (a peer's chunk is not ours)."""
        present = [self._writer.is_pending(key) for key in keys]
        for tier in self.tiers:
            if writable_only and tier.is_read_only:
                continue
            missing = [i for i, hit in enumerate(present) if not hit]
            if not missing:
                break
            for i, hit in zip(missing, tier.contains_many([keys[i] for i in missing])):
                present[i] = hit
        return present

    def load_permit(self) -> LoadPermit:
        """The slow-read slot of one load (use as a context manager around the load's `get` calls)."""
        return self._slow_reads.permit()

    def get(self, key: bytes, scratch: Scratch | None = None, meta: AccessMeta = NO_META,
            permit: LoadPermit | None = None, promote: bool = True, in_place: bool = False,
            verify_payload: bool = True, ranged: bool = False, from_level: int = 0) -> StackHit | None:
        """The chunk's blob, its header and the tier's name, or None. With `scratch`, the first tier reads with
        `get_into` (no allocation where the tier can); a blob from a later tier is kept for promotion. With
        `promote=False` a hit below the first tier is not promoted, so every tier reads into `scratch` (a caller
        that copies the KV elsewhere at once, e.g. into vLLM's paged cache, pays no fresh allocation). Order: a
        trusted first tier (process memory), then writes still queued, then the other tiers.
        `verify_payload=False`: the payload checksum is left to the caller (`StackHit.is_verified`), who hashes the
        payload while it copies it, in cache, instead of a separate pass over memory here, and calls `discard` when
        the sum does not match; or who calls `confirm` on another thread than the read's (so that the next read
        starts before this one's hash). Nothing unverified is promoted: `confirm` promotes. `ranged=True` (with
        verify_payload=False): a tier that `is_ranged` (disk) is not read here; the hit's `ranged` reads the blob
        piece by piece (its `blob` is the checked header alone). `from_level`: only that tier and the ones below it
        (read again after `confirm` failed at the level above: a peer cannot delete its damaged copy)."""
        if permit is None and self._slow_reads.limit and len(self.tiers) > 1:
            with self.load_permit() as own:
                return self.get(key, scratch, meta, own, promote, in_place, verify_payload, ranged, from_level)
        for level, tier in enumerate(self.tiers):
            if level < from_level:
                continue
            if level == int(self.tiers[0].is_trusted):  # right after process memory, before any slow tier
                pending = self._writer.pending(key)
                if pending is not None:
                    self.counters.add("hit.pending")
                    return StackHit(pending, parse(pending, key, is_trusted=True), "pending")
            if level > 0 and permit is not None and not permit.allows():
                self.counters.add("slow_read_refused")
                break
            if ranged and not verify_payload and tier.is_ranged:
                found = self._open_ranged(tier, key)
                if found is None:
                    continue
                return found
            view = None
            if in_place and not promote and tier.is_zero_copy:  # the view or a miss: never a second read
                view = tier.get_view(key)
                blob = None if view is None else view.blob
            else:
                blob = self._read(level, tier, key, scratch if level == 0 or not promote else None, meta)
            hit = None if blob is None else self._checked(level, key, blob, view, verify_payload, promote)
            if hit is None:
                continue
            if level > 0 and promote and hit.is_verified:
                self._promote(level, key, blob, meta)
            return hit
        self.counters.add("miss")
        return None

    def get_many(self, keys: Sequence[bytes], scratches: Sequence[Scratch]) -> list[StackHit | None]:
        """`get(key, scratch, promote=False)` for each pair (one scratch per key), with one batch call per tier
        (`get_many_into`) for the keys the tiers above lacked: a remote tier moves the batch in one round trip.
        Checked as `get` checks; a damaged blob is deleted from its tier and the next tier is asked."""
        found: list[StackHit | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        with self.load_permit() as permit:
            for level, tier in enumerate(self.tiers):
                if level == int(self.tiers[0].is_trusted):  # queued writes: where `get` looks for them
                    for i in missing:
                        if (pending := self._writer.pending(keys[i])) is not None:
                            self.counters.add("hit.pending")
                            found[i] = StackHit(pending, parse(pending, keys[i], is_trusted=True), "pending")
                    missing = [i for i in missing if found[i] is None]
                if not missing:
                    break
                if level > 0 and not permit.allows():
                    self.counters.add("slow_read_refused")
                    break
                blobs = tier.get_many_into([keys[i] for i in missing], [scratches[i] for i in missing])
                for i, blob in zip(missing, blobs):
                    found[i] = None if blob is None else self._checked(level, keys[i], blob)
                missing = [i for i in missing if found[i] is None]
        self.counters.add("miss", len(missing))
        return found

    def _checked(self, level: int, key: bytes, blob: Blob, view: TierView | None = None,
                 verify_payload: bool = True, promote: bool = False) -> StackHit | None:
        """The hit of a blob `level` handed out, its header (and payload unless not `verify_payload`) checked; None
        when it fails (a damaged blob is deleted from its tier and counted; a view reused meanwhile is not damage)."""
        tier = self.tiers[level]
        try:
            header = parse(blob, key, verify_payload, is_trusted=tier.is_trusted)
        except ChunkFormatError as exc:
            if view is not None and not view.is_current():  # rewritten while we checked it: not damage
                self.counters.add("view_reused")
                return None
            self._drop(tier, key, exc)
            return None
        self.counters.add(f"hit.{tier.name}")
        self.counters.add(f"bytes_read.{tier.name}", len(blob))
        return StackHit(blob, header, tier.name, view, verify_payload or tier.is_trusted, level=level,
                        is_promoted=promote)

    def confirm(self, key: bytes, hit: StackHit, meta: AccessMeta = NO_META) -> bool:
        """Check the payload of a hit read with get(verify_payload=False) and, when it was read with promote, promote
        it now. False: it failed its checksum; it is deleted from its tier and counted as corrupt (read it again with
        `get` for a lower tier's copy)."""
        if hit.is_verified:
            return True
        try:
            check_payload(hit.blob, hit.header)
        except ChunkFormatError as exc:
            self._drop(self.tiers[hit.level], key, exc)
            return False
        if hit.level > 0 and hit.is_promoted:
            self._promote(hit.level, key, hit.blob, meta)
        return True

    def _open_ranged(self, tier: Tier, key: bytes) -> StackHit | None:
        """A ranged tier's chunk, its header read and checked (a damaged header: deleted and counted)."""
        reader = tier.open_ranged(key)
        if reader is None:
            return None
        head = bytearray(HEADER_BYTES)
        try:
            if not reader.read_into(0, memoryview(head)):
                raise ChunkFormatError(f"truncated: {reader.size} bytes")
            header = parse(head, key, verify_payload=False, is_trusted=False, blob_size=reader.size)
        except ChunkFormatError as exc:
            reader.close()
            self._drop(tier, key, exc)
            return None
        self.counters.add(f"hit.{tier.name}")
        self.counters.add(f"bytes_read.{tier.name}", reader.size)
        return StackHit(head, header, tier.name, None, False, reader, level=self.tiers.index(tier))

    def _drop(self, tier: Tier, key: bytes, exc: Exception) -> None:
        """A blob that failed its checks: deleted from the tier that served it, counted as `corrupt.<tier>`."""
        log.warning("dropping damaged chunk %s from tier %s: %s", key.hex()[:16], tier.name, exc)
        self.counters.add(f"corrupt.{tier.name}")
        tier.delete(key)

    def _read(self, level: int, tier: Tier, key: bytes, scratch: Scratch | None, meta: AccessMeta) -> Blob | None:
        if self._takes_meta[level]:
            return tier.get(key, meta=meta) if scratch is None else tier.get_into(key, scratch, meta=meta)
        return tier.get(key) if scratch is None else tier.get_into(key, scratch)

    def _promote(self, level: int, key: bytes, blob: Blob, meta: AccessMeta) -> None:
        """Copy (write-through) or move (exclusive) a chunk served by `level` up, when it is due."""
        levels = self.levels.promote_to(level)
        if not levels or not self._promotions.is_due(key):
            return
        self.counters.add("promoted")
        is_placed = self._write(key, blob, levels, "promoted", meta)
        if self.levels.is_exclusive and is_placed and len(levels) == 1:
            self.tiers[level].delete(key)  # the faster tier holds it now: the slower one lets it go

    def is_in_memory(self, key: bytes) -> bool:
        """True if `get(key)` will be served from process memory (a queued write or a trusted first tier)."""
        tier = self.tiers[0]
        return self._writer.is_pending(key) or (tier.is_trusted and tier.contains_many([key])[0])

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Hint each tier to start reading the keys it will serve (those the faster tiers lack). Only a hint:
        nothing is returned and nothing fails."""
        for tier in self.tiers:
            if not keys:
                return
            present = tier.contains_many(keys)
            tier.prefetch([key for key, hit in zip(keys, present) if hit])
            keys = [key for key, hit in zip(keys, present) if not hit]

    def discard(self, key: bytes, damaged_in: str | None = None) -> None:
        """Remove a chunk found unusable above this layer (e.g. a payload that does not decode); `damaged_in`: the
        tier whose copy failed its checksum after all (counted as `corrupt.<tier>`, like a damaged read here)."""
        self.counters.add("discarded")
        if damaged_in is not None:
            self.counters.add(f"corrupt.{damaged_in}")
        for tier in self.tiers:
            tier.delete(key)

    @contextlib.contextmanager
    def pinned(self, keys: Sequence[bytes]) -> Iterator[None]:
        for tier in self.tiers:
            tier.pin(keys)
        try:
            yield
        finally:
            for tier in self.tiers:
                tier.unpin(keys)

    # ---- writes ------------------------------------------------------------------------------------------
    @property
    def stores_in_memory(self) -> bool:
        """Whether `put` places a blob in this process's memory at once (a trusted first tier takes it as it is):
        the buffers from `new_blob` are then the stored chunks themselves, and none waits on slower I/O."""
        store = self.levels.store
        return bool(store) and store[0] == 0 and self.tiers[0].is_trusted

    def new_blob(self, size: int) -> Blob:
        """A buffer for a blob about to be `put` (the first writable tier's: process memory recycles them)."""
        return self.tiers[self.levels.store[0]].new_blob(size) if self.levels.store else bytearray(size)

    def premap(self, size: int) -> None:
        """Blobs of `size` will be asked for: the first writable tier maps them ahead (Tier.premap)."""
        if self.levels.store:
            self.tiers[self.levels.store[0]].premap(size)

    def pause_premap(self, is_paused: bool) -> None:
        """Hold the first writable tier's premapping back (the caller's hot work runs), or let it go on."""
        if self.levels.store:
            self.tiers[self.levels.store[0]].pause_premap(is_paused)

    def put(self, key: bytes, blob: Blob, per_level: dict[int, Blob] | None = None,
            meta: AccessMeta = NO_META) -> None:
        self._write(key, blob, self.levels.store, "stored", meta, per_level or {})
        self.counters.add("stored")

    def _put(self, level: int, key: bytes, blob: Blob, meta: AccessMeta) -> bool:
        tier = self.tiers[level]
        if not tier.is_trusted:
            fill_checksums(blob)  # blobs made for process memory are unsealed until they leave it
        return tier.put(key, blob, meta=meta) if self._takes_meta[level] else tier.put(key, blob)

    def _write(self, key: bytes, blob: Blob, levels: tuple[int, ...], kind: str, meta: AccessMeta = NO_META,
               per_level: dict[int, Blob] | None = None) -> bool:
        """Write now (a trusted first level) or queue the rest; True when the first level took it now."""
        per_level = per_level or {}
        is_placed = False
        if levels and levels[0] == 0 and self.tiers[0].is_trusted:
            is_placed = self._put_counted(0, key, per_level.get(0, blob), kind, meta)
            levels = levels[1:]
            if not is_placed and self.levels.is_exclusive and not levels and kind != "promoted":
                levels = self.levels.demote_to(0) or ()  # refused above: placed one tier down instead
        if levels:
            self._writer.queue(Write(key, blob, levels, kind, meta, per_level))
        return is_placed

    def _put_counted(self, level: int, key: bytes, blob: Blob, kind: str, meta: AccessMeta) -> bool:
        name = self.tiers[level].name
        if not self._put(level, key, blob, meta):
            self.counters.add(f"failed_writes.{name}")
            return False
        if kind != "stored":
            self.counters.add(f"{kind}.{name}")
            self.counters.add(f"bytes_{kind}.{name}", len(blob))
        return True

    def delete(self, keys: Sequence[bytes]) -> list[bytes]:
        """Remove `keys` from every tier (queued writes of them cancelled); returns the keys some tier held."""
        queued = self._writer.cancel(keys)
        return [key for key in keys if any([tier.delete(key) for tier in self.tiers]) or key in queued]

    @property
    def queue_depth(self) -> int:
        """Writes waiting for the background writer (a metric)."""
        return self._writer.depth

    @property
    def queue_capacity(self) -> int:
        return self._writer.capacity

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if self._writer.is_running:
            self._writer.flush()
            self._write_back()
            self._writer.close()
        for tier in self.tiers:
            tier.close()

    def _write_back(self) -> None:
        """Exclusive: what only process memory holds is written down at close (as if evicted), so that a restart
        or another process finds it on the persistent tiers. Write-through has nothing to do here."""
        for level, tier in enumerate(self.tiers):
            down = self.levels.demote_to(level)
            if down is None or tier.is_persistent:
                continue
            for key in tier.keys():
                blob = tier.get(key)
                for target in down if blob is not None else ():
                    if not self.tiers[target].contains_many([key])[0]:
                        self._put_counted(target, key, blob, "demoted", NO_META)
