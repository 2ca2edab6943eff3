"""PrefixHeat: a prefix- and cost-aware S3-FIFO for KV chunks (config name "heat"; not the default: its
bookkeeping costs a multiple of LRU's, for a few points of hit ratio; docs/design/measurements.md).

What it knows that a generic cache policy does not:
- Position. A chunk is only useful when every chunk before it in the prompt hits (lookups stop at the first
  miss). A prompt's chunks are queued tail first, so among chunks that entered together the tail is evicted
  before the head and a resident chunk's ancestors outlive it. A prompt's last chunk (usually partial, and
  on the Mooncake traces reused far less often than the others)
  enters at the eviction end of its queue.
- Cost. A hit earns reinsertion credit in proportion to the chunk's miss cost relative to the running mean
  (`AccessMeta.miss_cost_s`: prefill time of its tokens, or the load time from the next tier when that tier
  holds it): a chunk that is cheap to get back (short, or one fast read away) leaves sooner than one that
  costs a long prefill.
- Heat. As in S3-FIFO (Yang et al., SOSP 2023): new chunks wait in a probation FIFO; one hit there moves them
  to the main FIFO, none sends their id to a ghost FIFO (ids only); a chunk stored again while its id is in
  the ghost skips probation. Main reinserts a chunk while it has credit, spending one unit per pass. The
  ghost remembers `ghost_mult` x the resident chunks: on these traces reuse gaps are hundreds of requests,
  longer than a small cache holds anything, and ids are cheap.
- Adaptation. The probation share decides between catching first reuses (large share) and protecting chunks
  that were already reused (small share); the best share differs with the workload and the capacity (on the
  Mooncake conversation trace a small share is best at a small capacity, no probation at all at a larger one;
  docs/design/measurements.md). Share 1
  means no probation: new chunks go straight to main, a CLOCK with 2-bit credit, close to LRU; it is the
  start. Once the cache holds 1024 keys, `ShareTuner` (tuner.py) replays a hashed 1/`sample` of the keys
  through shadow caches, one per candidate share, and moves the live share to the one with the most recent
  hits (miniature simulation, Waldspurger et al., ATC 2017).
All bookkeeping is O(1) amortized per access: each reinsertion spends credit earned by a hit.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence

from kvfabric.tiers.policies.keyhash import GOLDEN, MASK64, sample_bucket
from kvfabric.tiers.policies.tuner import DEFAULT_SHARES, ShareTuner
from kvfabric.tiers.policies.types import AccessMeta, Key


class PrefixHeat:
    name = "heat"
    may_bypass = True  # may turn the newcomer away (see types.py)

    def __init__(self, capacity_bytes: int = 0, small_frac: float = 1.0, ghost_mult: float = 4.0,
                 max_credit: int = 3, is_tail_first: bool = True, is_cost_aware: bool = True,
                 is_tuned: bool = True, shares: Sequence[float] = DEFAULT_SHARES) -> None:
        if not 0.0 < small_frac <= 1.0:
            raise ValueError(f"small_frac must be in (0, 1], got {small_frac}")
        self.small_frac = small_frac
        self.ghost_mult = ghost_mult
        self.max_credit = max_credit
        self.is_tail_first = is_tail_first
        self.is_cost_aware = is_cost_aware
        self._small: OrderedDict[Key, None] = OrderedDict()  # probation, next victim first
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()  # ids of evicted keys, oldest first
        self._credit: dict[Key, int] = {}
        self._size: dict[Key, int] = {}
        self._chain: list[Key] = []  # new keys of the prompt being stored, head first, not yet queued
        self._chain_position = -1
        self._small_bytes = 0  # probation and chain
        self._main_bytes = 0
        self._mean_cost = 0.0
        self._touch_position = -2
        self._parent_credit = 0
        self._steps = 0  # loop iterations; `num_steps` adds the tuner's
        self.capacity_bytes = capacity_bytes
        self.shares = tuple(shares)
        self.is_tuned = self._wants_tuning = is_tuned and capacity_bytes > 0
        self._initial_small_frac = small_frac
        self._tuner: ShareTuner | None = None  # made when the cache first fills (see _start_tuner)

    def __len__(self) -> int:
        return len(self._credit)

    @property
    def num_steps(self) -> int:
        return self._steps + (self._tuner.num_steps if self._tuner is not None else 0)

    # ---- accesses ---------------------------------------------------------------------------------------
    def admit(self, key: Key, size: int, meta: AccessMeta) -> None:
        tuner = self._tuner
        if tuner is not None and (key[-1] if key.__class__ is bytes else self._bucket(key)) < tuner.threshold:
            self._observe(key, size, meta)
        self._credit[key] = 0
        self._size[key] = size
        if key in self._ghost:  # reused after it left: skip probation
            del self._ghost[key]
            self._main[key] = None
            self._main_bytes += size
            return
        position = meta.position
        if self.is_tail_first and position == meta.num_chunks - 1 and position > 0:
            queue = self._small if self.small_frac < 1.0 else self._main
            self._add_bytes(queue, size)
            queue[key] = None  # the prompt's last chunk, rarely reused: next in line
            queue.move_to_end(key, last=False)
            return
        self._small_bytes += size  # waits in the chain, counted as probation
        if position <= self._chain_position:
            self._flush_chain()
        self._chain.append(key)
        self._chain_position = position

    def touch(self, key: Key, meta: AccessMeta) -> None:
        tuner = self._tuner
        if tuner is not None and (key[-1] if key.__class__ is bytes else self._bucket(key)) < tuner.threshold:
            self._observe(key, self._size[key], meta)
        gain = 1
        cost = meta.miss_cost_s
        if cost > 0.0 and self.is_cost_aware:
            # One more credit when a miss would cost over twice the running mean (a long prefill rather than
            # a quick load), none when under a quarter of it.
            mean = self._mean_cost = self._mean_cost + 0.01 * (cost - self._mean_cost) if self._mean_cost else cost
            gain = 2 if cost > 2.0 * mean else (1 if cost > 0.25 * mean else 0)
        credit = self._credit[key] + gain
        if credit > self.max_credit:
            credit = self.max_credit
        if meta.position == self._touch_position + 1 and credit > self._parent_credit:
            # The previous touch was this chunk's parent (lookups run head to tail): never hold more credit
            # than the parent, or the chunk would outlive the prefix it needs.
            credit = self._parent_credit
        self._credit[key] = credit
        self._touch_position = meta.position
        self._parent_credit = credit

    def _start_tuner(self) -> None:
        """Sample 1 key in 64 for the shadow caches (1 in 16 to 32 below 8k keys, so that a shadow holds about
        64 keys or more); no tuning below 1024 keys, where the shadows would be mostly noise."""
        self.is_tuned = False
        num_keys = len(self._credit)
        if num_keys < 1024:
            return
        sample = max(16, min(64, 1 << ((num_keys // 128).bit_length() - 1)))
        ghost_mult, max_credit, is_tail_first, is_cost_aware = (self.ghost_mult, self.max_credit,
                                                                self.is_tail_first, self.is_cost_aware)

        def make_shadow(capacity: int, share: float) -> PrefixHeat:
            return PrefixHeat(capacity, share, ghost_mult, max_credit, is_tail_first, is_cost_aware, False)
        self._tuner = ShareTuner(self.capacity_bytes, make_shadow, self.shares, sample,
                                 current=self.small_frac)

    @staticmethod
    def _bucket(key: Key) -> int:
        """sample_bucket(key), its int case inlined (this runs on every access; bytes keys are cheaper still)."""
        return ((key * GOLDEN) & MASK64) >> 56 if key.__class__ is int else sample_bucket(key)

    def _observe(self, key: Key, size: int, meta: AccessMeta) -> None:
        """Replay a sampled key's access through the tuner's shadows (the caller checked the sample bucket)."""
        share = self._tuner.observe(key, size, meta)
        if share is not None:
            self.small_frac = share

    def _add_bytes(self, queue: OrderedDict, size: int) -> None:
        if queue is self._small:
            self._small_bytes += size
        else:
            self._main_bytes += size

    def _flush_chain(self) -> None:
        # Share 1 (no probation): new chains go straight to main, a CLOCK with 2-bit credit (close to LRU),
        # which the tuner picks where probation costs more first reuses than it saves (large caches).
        queue, credit = (self._small if self.small_frac < 1.0 else self._main), self._credit
        for key in reversed(self._chain):  # tail first: evicted before the chunks it depends on
            if key in credit and key not in self._main and key not in self._small:
                queue[key] = None
                if queue is self._main:
                    size = self._size[key]
                    self._small_bytes -= size
                    self._main_bytes += size
        self._chain.clear()
        self._chain_position = -1

    # ---- eviction -----------------------------------------------------------------------------------------
    def victim(self, pinned: Container[Key]) -> Key | None:
        if self.is_tuned:
            self._start_tuner()
        small, main, credit = self._small, self._main, self._credit
        num_pinned = 0  # every other pass spends a credit or promotes a key, so only pinned keys can loop
        num_small_pinned = 0  # in a row in probation: when all of it is pinned, evict from main
        while num_pinned <= len(credit):
            self._steps += 1
            if small and num_small_pinned < len(small) and (
                    self._small_bytes >= self.small_frac * (self._small_bytes + self._main_bytes) or not main):
                key = small.popitem(last=False)[0]
                if key in pinned:
                    small[key] = None
                    num_pinned += 1
                    num_small_pinned += 1
                elif credit[key] > 0:  # hit while on probation: promote
                    size = self._size[key]
                    self._small_bytes -= size
                    self._main_bytes += size
                    credit[key] -= 1
                    main[key] = None
                else:
                    self._small_bytes -= self._size.pop(key)
                    break
            elif main:
                key = main.popitem(last=False)[0]
                if key in pinned:
                    main[key] = None
                    num_pinned += 1
                elif credit[key] > 0:
                    credit[key] -= 1
                    main[key] = None
                else:
                    self._main_bytes -= self._size.pop(key)
                    break
            elif self._chain:
                self._flush_chain()  # only the prompt being stored is left
            else:
                return None
        else:
            return None
        del credit[key]
        ghost = self._ghost
        ghost[key] = None
        limit = self.ghost_mult * len(credit) + 1
        while len(ghost) > limit:
            ghost.popitem(last=False)
            self._steps += 1
        return key

    def remove(self, key: Key) -> None:
        if key not in self._credit:
            return
        size = self._size.pop(key)
        del self._credit[key]
        if self._main.pop(key, 0) is None:
            self._main_bytes -= size
        else:
            self._small_bytes -= size
            self._small.pop(key, None)  # absent while the key waits in the chain buffer

    def clear(self) -> None:
        for part in (self._small, self._main, self._ghost, self._credit, self._size):
            part.clear()
        self._chain.clear()
        self._chain_position = -1
        self._small_bytes = self._main_bytes = 0
        self._tuner = None
        self.is_tuned = self._wants_tuning
        self.small_frac = self._initial_small_frac
