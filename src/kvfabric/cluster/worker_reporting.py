"""Keeping the controller's view of an instance's served tiers current: `ObservedTier` and `Reporter`.

- `ObservedTier` wraps a served local tier: the Tier protocol unchanged (what it does not define is the wrapped
  tier's), plus a "this tier changed" mark on every put / delete / clear. With `refuse` it
  declines puts of the keys it names (chunks fetched from peers).
- `Reporter` is a background thread: it registers the instance, sends heartbeats with tier usage, and every
  `interval_s` diffs each changed tier's key set against what the controller was told and sends the admits /
  evicts in batches of `EVENT_BATCH`. Diffing key sets also catches LRU evictions inside a tier (which no
  put/delete hook sees), chunks another process wrote into a shared disk directory (a full reconcile every
  `reconcile_interval_s`), and recovers from anything lost: if the controller forgets the instance (restart with
  an in-memory index, missed heartbeats) the reporter registers again and re-sends everything.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvfabric.cluster.client import ControllerClient, ControllerError
from kvfabric.host.pages import Scratch
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob, Tier
from kvfabric.tiers.policies import NO_META, AccessMeta

log = logging.getLogger(__name__)

EVENT_BATCH = 4096  # keys per events request (the controller accepts up to 16384 per tier)


class ObservedTier:
    """A tier that tells `on_change(name)` when its contents may have changed. With `refuse`, puts of the keys
    it names are declined (used to not keep copies of chunks fetched from peers). What it does not define (the
    declarations, contains_many, reads in batches, new_blob, prefetch, file_of, keys, usage, pins, counters,
    breaker, close) is the inner tier's, looked up at each access."""

    def __init__(self, inner: Tier, on_change: Callable[[str], None],
                 refuse: Callable[[bytes], bool] | None = None) -> None:
        self.inner = inner
        self._on_change = on_change
        self.refuse = refuse

    def __getattr__(self, name: str) -> Any:  # called only for names this class does not define
        return getattr(self.inner, name)

    def get(self, key: bytes, meta: AccessMeta = NO_META) -> Blob | None:
        return self.inner.get(key, meta=meta) if self.is_policy_driven else self.inner.get(key)

    def get_into(self, key: bytes, scratch: Scratch, meta: AccessMeta = NO_META) -> Blob | None:
        if self.is_policy_driven:
            return self.inner.get_into(key, scratch, meta=meta)
        return self.inner.get_into(key, scratch)

    def put(self, key: bytes, blob: Blob, meta: AccessMeta = NO_META) -> bool:
        if self.refuse is not None and self.refuse(key):
            return False
        ok = self.inner.put(key, blob, meta=meta) if self.is_policy_driven else self.inner.put(key, blob)
        self._on_change(self.name)
        return ok

    def put_many(self, items: Sequence[tuple[bytes, Blob]]) -> list[bool]:
        return [self.put(key, blob) for key, blob in items]  # each through put: refused keys, the change mark

    def delete(self, key: bytes) -> bool:
        ok = self.inner.delete(key)
        if ok:
            self._on_change(self.name)
        return ok

    def clear(self) -> None:
        self.inner.clear()
        self._on_change(self.name)


class Reporter:
    """Background thread keeping the controller's view of this instance's served tiers up to date."""

    def __init__(self, client: ControllerClient, instance_id: str, info: Callable[[], dict],
                 tiers: Mapping[str, Tier], *, interval_s: float = 0.25, heartbeat_interval_s: float = 2.0,
                 reconcile_interval_s: float = 10.0, stats: Callable[[], dict[str, int]] | None = None) -> None:
        self.client = client
        self.instance_id = instance_id
        self.info = info
        self.stats = stats  # cumulative counts sent with each heartbeat (the controller's status page)
        self.tiers = dict(tiers)
        self.interval_s = interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.reconcile_interval_s = reconcile_interval_s
        self.registered = False
        self.counters = Counters({"registers": 0, "heartbeats": 0, "admits": 0, "evicts": 0, "errors": 0})
        self._reported: dict[str, set[bytes]] = {name: set() for name in self.tiers}
        self._dirty: set[str] = set(self.tiers)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ticks_started = 0
        self._ticks_done = 0
        self._last_heartbeat = 0.0
        self._last_reconcile = 0.0
        self._thread = threading.Thread(target=self._loop, name="kvfabric-reporter", daemon=True)

    def start(self) -> Reporter:
        self._thread.start()
        return self

    def mark(self, tier_name: str) -> None:
        with self._lock:
            self._dirty.add(tier_name)

    def mark_all(self) -> None:
        with self._lock:
            self._dirty.update(self.tiers)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Run a report now and wait for it; True if the controller is up to date with this instance."""
        with self._cond:
            target = self._ticks_started + 1
            self._wake.set()
            done = self._cond.wait_for(lambda: self._ticks_done >= target or self._stop.is_set(), timeout_s)
            return done and self.registered and not self._dirty

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                self._ticks_started += 1
                tick = self._ticks_started
            try:
                self._tick()
            except Exception:
                log.exception("cluster report failed")
                self.counters.add("errors")
            with self._cond:
                self._ticks_done = tick
                self._cond.notify_all()
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def _tick(self) -> None:
        now = time.monotonic()
        try:
            if not self.registered:
                self.client.register({**self.info(), "reset": True})
                self.counters.add("registers")
                self._reported = {name: set() for name in self.tiers}
                self.mark_all()
                self.registered = True
                self._last_heartbeat = now
            if now - self._last_reconcile >= self.reconcile_interval_s:
                self._last_reconcile = now
                self.mark_all()
            with self._lock:
                dirty, self._dirty = self._dirty, set()
            try:
                for name in sorted(dirty):
                    self._sync(name)
            except BaseException:
                with self._lock:
                    self._dirty |= dirty  # try again next tick
                raise
            if dirty or now - self._last_heartbeat >= self.heartbeat_interval_s:  # usage changed, or due
                reply = self.client.heartbeat(self.instance_id, self.info()["tiers"],
                                              self.stats() if self.stats is not None else None)
                self.counters.add("heartbeats")
                self._last_heartbeat = now
                if not reply.get("known", False):
                    self.registered = False  # the controller forgot us: register and re-send everything
                    self._wake.set()
        except ControllerError as exc:
            self.counters.add("errors")
            log.debug("controller unreachable: %s", exc)
            if exc.status == 404:
                self.registered = False

    def _sync(self, name: str) -> None:
        tier = self.tiers[name]
        current = set(tier.keys())
        reported = self._reported[name]
        admit, evict = list(current - reported), list(reported - current)
        for start in range(0, max(len(admit), len(evict)), EVENT_BATCH):
            a, e = admit[start:start + EVENT_BATCH], evict[start:start + EVENT_BATCH]
            reply = self.client.events(self.instance_id, {name: [k.hex() for k in a]} if a else {},
                                       {name: [k.hex() for k in e]} if e else {})
            if not reply.get("known", False):
                self.registered = False
                self._wake.set()
                raise ControllerError("the controller does not know this instance")
            reported.update(a)
            reported.difference_update(e)
            self.counters.add("admits", len(a))
            self.counters.add("evicts", len(e))

    def close(self, unregister: bool = True) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._cond:
            self._cond.notify_all()
        if unregister and self.registered:
            try:
                self.client.unregister(self.instance_id, timeout_s=1.0)
            except ControllerError:
                pass
        self.client.close()

