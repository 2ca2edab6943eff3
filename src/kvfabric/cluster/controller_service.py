"""`Controller`: the state and logic behind the controller's HTTP routes (usable without HTTP in tests).

- An instance whose last heartbeat is older than `instance_ttl_s` is gone for every operation, even before
  `sweep` drops it and its entries from the index; so is one whose heartbeat is stamped more than that in the
  future (the wall clock was set back since).
- A lookup keys the prompt once per distinct namespace and locates all keys in one index call; each instance's
  hit is its longest cached prefix, each chunk read from its fastest tier.
- Commands that need a worker (pin, unpin, delete, clear, fetch for move) go over the P2P control channel in
  batches of `CONTROL_BATCH` keys; an unreachable worker is an error result (502), never a hang past
  `control_timeout_s`. Client errors raise `HTTPException` (404 unknown instance, 400 / 502 for move).
- Tenants: a selection by tokens is keyed in each instance's namespace, or in tenant T's namespace inside it
  (`KeySpace.tenant`) when it names T. A tenant caller's lookup, pin, unpin and move are keyed only in its own
  tenants' namespaces (a tenant it does not hold, or chunk keys given directly, are 403): it can neither find
  nor touch another tenant's chunks, nor the shared namespace's.
"""
from __future__ import annotations

import logging
import ssl
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from fastapi import HTTPException

from kvfabric.cluster.controller_guard import Metrics
from kvfabric.cluster.controller_models import (
    ClearRequest,
    CommandResponse,
    EventsRequest,
    HeartbeatRequest,
    HistoryEvent,
    HistoryPoint,
    HistoryResponse,
    InstanceHit,
    InstanceResult,
    InstancesResponse,
    InstanceView,
    KnownResponse,
    LookupRequest,
    LookupResponse,
    MoveRequest,
    MoveResponse,
    NamespaceModel,
    PinRequest,
    RegisterRequest,
    RegisterResponse,
    Selection,
    TierModel,
)
from kvfabric.cluster.controller_tenants import Caller
from kvfabric.cluster.index import ChunkIndex, InstanceInfo, Namespace, TierInfo
from kvfabric.cluster.p2p_client import PeerError, PeerPool

log = logging.getLogger(__name__)

CONTROL_BATCH = 4096  # keys per control message to a worker (stays under the P2P request bound)
HISTORY_POINTS = 1800  # points kept per instance (an hour at the 2 s spacing)
HISTORY_SPACING_S = 2.0  # at most one point per instance this often
RECENT_EVENTS = 200
EVENT_KINDS = ("evictions", "errors")


class Controller:
    """State and logic behind the HTTP routes (usable directly in tests)."""

    def __init__(self, index: ChunkIndex, *, token: str | None = None, instance_ttl_s: float = 10.0,
                 control_timeout_s: float = 30.0, connect_timeout_s: float = 1.0,
                 peer_tls: ssl.SSLContext | None = None) -> None:
        self.index = index
        self.token = token or None
        self.instance_ttl_s = instance_ttl_s
        self.control_timeout_s = control_timeout_s
        self.metrics = Metrics()
        self.peers = PeerPool(self.token, connect_timeout_s=connect_timeout_s, io_timeout_s=control_timeout_s,
                              pool_size=2, tls=peer_tls)  # workers' P2P servers, TLS where they use it
        # the status page's memory (this process only; a restarted controller starts a new history)
        self._history: dict[str, deque[HistoryPoint]] = {}
        self._recent: deque[HistoryEvent] = deque(maxlen=RECENT_EVENTS)
        self._latest: dict[str, dict[str, int]] = {}
        self._history_lock = threading.Lock()

    # ---- helpers ---------------------------------------------------------------------------------------------
    def is_live(self, info: InstanceInfo, now: float) -> bool:
        """Seen within the TTL. A last_seen more than a TTL in the future was stamped before the wall clock was
        set back: stale too, else an instance that died just before the jump would look alive until the clock
        caught up (a live one heartbeats again within the TTL and gets a fresh stamp)."""
        return now - self.instance_ttl_s <= info.last_seen <= now + self.instance_ttl_s

    def alive(self, exclude: Sequence[str] = ()) -> list[InstanceInfo]:
        now = time.time()
        return [i for i in self.index.instances() if self.is_live(i, now) and i.instance_id not in exclude]

    def instance(self, instance_id: str) -> InstanceInfo:
        info = self.index.get_instance(instance_id)
        if info is None or not self.is_live(info, time.time()):
            raise HTTPException(404, f"no live instance {instance_id!r}")
        return info

    def command(self, info: InstanceInfo, message: dict) -> dict:
        try:
            reply = self.peers.client(info.host, info.port).control(message, timeout_s=self.control_timeout_s)
        except PeerError as exc:
            return {"ok": False, "error": str(exc), "code": 502}
        return reply

    @staticmethod
    def keys_for(ns: Namespace, tokens: Sequence[int], tenant: str | None = None) -> list[bytes]:
        space = ns.key_space()
        return (space if tenant is None else space.tenant(tenant)).keys(tokens)

    @staticmethod
    def scope(sel: Selection, caller: Caller) -> tuple[str | None, ...]:
        """The tenants whose namespaces `sel`'s tokens are keyed in (None: the instance's own namespace)."""
        if caller.is_admin:
            return (sel.tenant,)
        if sel.keys is not None:
            raise HTTPException(403, "a tenant's token names chunks by tokens, not by keys")
        if sel.tenant is not None:
            if sel.tenant not in caller.tenants:
                raise HTTPException(403, "this token does not act for that tenant")
            return (sel.tenant,)
        return tuple(sorted(caller.tenants))

    def selection(self, sel: Selection, info: InstanceInfo, caller: Caller) -> list[bytes]:
        """The chunk keys `sel` names on this instance (tokens: with its namespace, in each tenant of the caller's
        scope; [] if it has none)."""
        tenants = self.scope(sel, caller)
        if sel.keys is not None:
            return [bytes.fromhex(k) for k in sel.keys]
        for ns in info.namespaces:
            if sel.model_id is None or ns.model_id == sel.model_id:
                keyed = (self.keys_for(ns, sel.tokens or [], tenant) for tenant in tenants)
                return list(dict.fromkeys(key for keys in keyed for key in keys))
        return []

    # ---- operations ------------------------------------------------------------------------------------------
    def lookup(self, req: LookupRequest, caller: Caller = Caller.ADMIN) -> LookupResponse:
        tenants = self.scope(req, caller)
        instances = self.alive(req.exclude)
        per_instance: list[tuple[InstanceInfo, list[bytes], Namespace | None]] = []
        wanted: dict[bytes, None] = {}
        keyed: dict[tuple, tuple[list[bytes], Namespace]] = {}
        for info in instances:
            if req.keys is not None:
                keys, ns = [bytes.fromhex(k) for k in req.keys], None
                per_instance.append((info, keys, ns))
                wanted.update(dict.fromkeys(keys))
                continue
            for ns in info.namespaces:  # an instance may serve several models: each namespace is a candidate
                if req.model_id is not None and ns.model_id != req.model_id:
                    continue
                for tenant in tenants:  # ... and so is each tenant's namespace in it that the caller may see
                    sig = (ns.root, ns.chunk_size, ns.hash, ns.partial, tenant)
                    if sig not in keyed:
                        keyed[sig] = (self.keys_for(ns, req.tokens or [], tenant), ns)
                    keys = keyed[sig][0]
                    per_instance.append((info, keys, ns))
                    wanted.update(dict.fromkeys(keys))
        order = list(wanted)
        located = dict(zip(order, self.index.locate(order))) if order else {}
        self.metrics.lookups.inc()
        self.metrics.lookup_keys.inc(len(order))
        best: dict[str, InstanceHit] = {}
        for info, keys, ns in per_instance:
            rank = {t.name: i for i, t in enumerate(info.tiers)}
            held = [located[k].get(info.instance_id, []) for k in keys]
            if req.detail and not any(held):
                continue  # detail answers (peers locating chunks) list only instances holding some
            prefix = next((i for i, tiers in enumerate(held) if not tiers), len(held))
            counts: dict[str, int] = {}
            slowest: str | None = None
            for tiers in held[:prefix]:
                fastest = min(tiers, key=lambda t: rank.get(t, len(rank)))
                counts[fastest] = counts.get(fastest, 0) + 1
                if slowest is None or rank.get(fastest, len(rank)) > rank.get(slowest, len(rank)):
                    slowest = fastest
            hit = InstanceHit(
                instance_id=info.instance_id, host=info.host, port=info.port, num_chunks=len(keys),
                prefix_chunks=prefix, tier=slowest, tiers=counts,
                prefix_tokens=None if ns is None else min(prefix * ns.chunk_size, len(req.tokens or [])),
                chunk_tiers=[sorted(t, key=lambda t: rank.get(t, len(rank))) for t in held] if req.detail else None)
            old = best.get(info.instance_id)
            if old is None or (hit.prefix_tokens or hit.prefix_chunks) > (old.prefix_tokens or old.prefix_chunks):
                best[info.instance_id] = hit
        hits = sorted(best.values(), key=lambda h: (-(h.prefix_tokens or h.prefix_chunks), h.instance_id))
        return LookupResponse(instances=hits)

    def register(self, req: RegisterRequest) -> RegisterResponse:
        info = InstanceInfo(
            instance_id=req.instance_id, host=req.host, port=req.port,
            tiers=[TierInfo(**t.model_dump()) for t in req.tiers],
            namespaces=[Namespace(**n.model_dump()) for n in req.namespaces], last_seen=time.time())
        self.index.register(info, reset=req.reset)
        return RegisterResponse(ok=True, instance_ttl_s=self.instance_ttl_s)

    def heartbeat(self, instance_id: str, req: HeartbeatRequest) -> KnownResponse:
        tiers = None if req.tiers is None else [TierInfo(**t.model_dump()) for t in req.tiers]
        now = time.time()
        known = self.index.heartbeat(instance_id, tiers, now)
        if known and req.stats is not None:
            self._record(instance_id, dict(req.stats), now)
        return KnownResponse(ok=known, known=known)

    def _record(self, instance_id: str, stats: dict[str, int], now: float) -> None:
        with self._history_lock:
            prev = self._latest.get(instance_id)
            for kind in EVENT_KINDS if prev is not None else ():
                grew = stats.get(kind, 0) - prev.get(kind, 0)
                if grew > 0:
                    self._recent.append(HistoryEvent(t=now, instance_id=instance_id, kind=kind, count=grew))
            self._latest[instance_id] = stats
            points = self._history.setdefault(instance_id, deque(maxlen=HISTORY_POINTS))
            if not points or now - points[-1].t >= HISTORY_SPACING_S:
                points.append(HistoryPoint(t=now, stats=stats))

    def history(self) -> HistoryResponse:
        alive = {info.instance_id for info in self.alive()}
        with self._history_lock:
            for gone in [i for i in self._history if i not in alive]:
                del self._history[gone]
                self._latest.pop(gone, None)
            return HistoryResponse(instances={i: list(p) for i, p in self._history.items()},
                                   events=list(self._recent))

    def latest_stats(self, instance_id: str) -> dict[str, int]:
        with self._history_lock:
            return dict(self._latest.get(instance_id, {}))

    def events(self, instance_id: str, req: EventsRequest) -> KnownResponse:
        admit = {t: [bytes.fromhex(k) for k in keys] for t, keys in req.admit.items()}
        evict = {t: [bytes.fromhex(k) for k in keys] for t, keys in req.evict.items()}
        known = self.index.apply(instance_id, admit, evict)
        if known:
            self.metrics.events.labels("admit").inc(sum(map(len, admit.values())))
            self.metrics.events.labels("evict").inc(sum(map(len, evict.values())))
        return KnownResponse(ok=known, known=known)

    def targets(self, instance_id: str | None) -> list[InstanceInfo]:
        return [self.instance(instance_id)] if instance_id is not None else self.alive()

    def pin(self, req: PinRequest, op: str, caller: Caller = Caller.ADMIN) -> CommandResponse:
        results: dict[str, InstanceResult] = {}
        for info in self.targets(req.instance):
            keys = self.selection(req, info, caller)
            located = self.index.locate(keys) if keys else []
            mine = [k for k, loc in zip(keys, located)
                    if info.instance_id in loc and (req.tier is None or req.tier in loc[info.instance_id])]
            if not mine:
                if req.instance is not None:
                    results[info.instance_id] = InstanceResult(ok=True, chunks=0)
                continue
            results[info.instance_id] = self._batched(info, {"op": op, "tier": req.tier}, mine)
        return CommandResponse(instances=results)

    def _batched(self, info: InstanceInfo, message: dict, keys: list[bytes]) -> InstanceResult:
        done = 0
        for start in range(0, len(keys), CONTROL_BATCH):
            reply = self.command(info, {**message, "keys": [k.hex() for k in keys[start:start + CONTROL_BATCH]]})
            if not reply.get("ok"):
                return InstanceResult(ok=False, chunks=done, error=str(reply.get("error")))
            done += int(reply.get("chunks", 0))
        return InstanceResult(ok=True, chunks=done)

    def clear(self, req: ClearRequest) -> CommandResponse:
        results: dict[str, InstanceResult] = {}
        for info in self.targets(req.instance):
            reply = self.command(info, {"op": "clear", "tier": req.tier})
            dropped = self.index.drop(info.instance_id, req.tier)  # the operator's intent holds even if unreachable
            results[info.instance_id] = InstanceResult(ok=bool(reply.get("ok")), chunks=dropped,
                                                       error=reply.get("error"))
        return CommandResponse(instances=results)

    def move(self, req: MoveRequest, caller: Caller = Caller.ADMIN) -> MoveResponse:
        started = time.perf_counter()
        self.scope(req, caller)  # a tenant's 403 before any instance is named
        src, dst = self.instance(req.src), self.instance(req.dst)
        if req.dst_tier not in {t.name for t in dst.tiers}:
            raise HTTPException(400, f"instance {dst.instance_id!r} has no tier {req.dst_tier!r}")
        if req.src == req.dst and req.src_tier in (None, req.dst_tier):
            raise HTTPException(400, "source and destination are the same instance and tier")
        keys = self.selection(req, src, caller)
        located = self.index.locate(keys) if keys else []
        held = [k for k, loc in zip(keys, located)
                if src.instance_id in loc and (req.src_tier is None or req.src_tier in loc[src.instance_id])]
        moved, num_bytes, missing = [], 0, 0
        for start in range(0, len(held), CONTROL_BATCH):
            batch = held[start:start + CONTROL_BATCH]
            reply = self.command(dst, {"op": "fetch", "keys": [k.hex() for k in batch], "tier": req.dst_tier,
                                       "source": {"instance_id": src.instance_id, "host": src.host, "port": src.port},
                                       "source_tier": req.src_tier or ""})
            if not reply.get("ok"):
                code = int(reply.get("code", 502))
                raise HTTPException(400 if code == 400 else 502, f"move failed on {dst.instance_id}: "
                                                                  f"{reply.get('error')}")
            stored = {bytes.fromhex(k) for k in reply.get("stored", [])}
            moved += [k for k in batch if k in stored]
            num_bytes += int(reply.get("bytes", 0))
            missing += int(reply.get("missing", 0))
        if moved:
            self.index.apply(dst.instance_id, {req.dst_tier: moved}, {})  # visible now; the worker confirms later
        if req.mode == "migrate" and moved:
            tiers = [req.src_tier] if req.src_tier else [t.name for t in src.tiers]
            if src.instance_id == dst.instance_id:
                tiers = [t for t in tiers if t != req.dst_tier]
            for tier in tiers:
                result = self._batched(src, {"op": "delete", "tier": tier}, moved)
                if not result.ok:
                    raise HTTPException(502, f"copied, but deleting on {src.instance_id} failed: {result.error}")
                self.index.apply(src.instance_id, {}, {tier: moved})
        self.metrics.moved_bytes.inc(num_bytes)
        return MoveResponse(chunks=len(moved), bytes=num_bytes, missing=missing,
                            seconds=time.perf_counter() - started)

    def instances(self) -> InstancesResponse:
        now = time.time()
        views = []
        totals: dict[str, int] = {}
        for info in self.alive():
            counts = self.index.counts(info.instance_id)
            for tier, n in counts.items():
                totals[tier] = totals.get(tier, 0) + n
            views.append(InstanceView(
                instance_id=info.instance_id, host=info.host, port=info.port,
                tiers=[TierModel(**vars_of(t)) for t in info.tiers],
                namespaces=[NamespaceModel(**vars_of(n)) for n in info.namespaces],
                indexed_chunks=counts, registered_at=info.registered_at, last_seen=info.last_seen,
                age_s=max(0.0, now - info.last_seen), stats=self.latest_stats(info.instance_id)))
        self.metrics.instances.set(len(views))
        for tier, n in totals.items():
            self.metrics.indexed.labels(tier).set(n)
        return InstancesResponse(instances=sorted(views, key=lambda v: v.instance_id))

    def sweep(self) -> list[str]:
        now = time.time()
        gone = self.index.expire(now - self.instance_ttl_s)
        for info in self.index.instances():  # stamped before the clock was set back (see is_live)
            if info.last_seen > now + self.instance_ttl_s and self.index.unregister(info.instance_id):
                gone.append(info.instance_id)
        if gone:
            log.info("dropped instances that missed their heartbeats: %s", ", ".join(gone))
            self.metrics.expired.inc(len(gone))
        return gone

    def close(self) -> None:
        self.peers.close()
        self.index.close()


def vars_of(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}

