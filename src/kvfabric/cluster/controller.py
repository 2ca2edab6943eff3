"""The cluster controller: a global chunk index over every kvfabric instance, and the management API.

Run it with `run_controller(...)` / `main(argv)` (`python -m kvfabric.cluster.controller --help`). JSON over
HTTP (FastAPI + uvicorn); the OpenAPI schema is at /openapi.json, Prometheus metrics at /metrics.

Workers (kvfabric.cluster.worker.ClusterNode) register their P2P address, tiers and key namespaces, send
heartbeats, and report the chunks their served tiers admit and evict in batches. An instance whose heartbeat is
older than `instance_ttl_s` is dropped, with its entries (lookups filter it out even before the sweep).

API (all under /v1 and all requiring `Authorization: Bearer <token>` when a token is configured, except
/v1/health):
  POST /v1/lookup      tokens (or chunk keys) -> for each instance the longest cached prefix and its tiers
  POST /v1/pin, /v1/unpin  pin / unpin a prompt's chunks on the instances holding them (or one instance, tier)
  POST /v1/clear       clear one instance, one tier, or the whole fleet
  POST /v1/move        copy or migrate a prompt's chunks from one instance/tier to another (peer-to-peer)
  GET  /v1/instances   every live worker: address, tiers, usage, indexed chunks
  GET  /v1/health      liveness and the index backend's state
  POST /v1/workers/register, /v1/workers/{id}/heartbeat, /v1/workers/{id}/events; DELETE /v1/workers/{id}

Security: binds 127.0.0.1 unless told otherwise, and refuses to bind elsewhere without a token; the token is
compared in constant time; request bodies are bounded (`max_body_bytes`, 413) and every field is validated
(422): a malformed or hostile request gets a 4xx. Worker addresses must be IP literals (no DNS lookups on
behalf of a client). Commands that need a worker (pin, clear, move) reach it over the P2P protocol with the
same token; an unreachable worker gives 502 for that call, never a hang past `control_timeout_s`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    WithJsonSchema,
    model_validator,
)

from kvfabric.cluster.index import ChunkIndex, InstanceInfo, Namespace, TierInfo, open_index
from kvfabric.cluster.p2p import PeerClient, PeerError, is_loopback
from kvfabric.hashing import HASH_NAMES, chunk_keys

log = logging.getLogger(__name__)

DEFAULT_PORT = 8470
MAX_BODY_BYTES = 4 << 20
MAX_TOKENS = 262_144
MAX_KEYS = 16_384
CONTROL_BATCH = 4096  # keys per control message to a worker (stays under the P2P request bound)


# ---- request / response models -------------------------------------------------------------------------------
def _json_int(value: Any) -> Any:
    """JSON Schema integers: numbers with no fraction (1 and 1.0), never strings or booleans."""
    if isinstance(value, (str, bytes, bool)):
        raise ValueError("expected an integer")
    return value


def _ip_literal(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError("must be an IPv4 or IPv6 address literal") from None
    return value


InstanceId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]
TierName = Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,32}$")]
KeyHex = Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")]
TokenId = Annotated[int, Field(ge=0, lt=2**32), BeforeValidator(_json_int)]
Host = Annotated[str, Field(min_length=2, max_length=45), AfterValidator(_ip_literal),
                 WithJsonSchema({"anyOf": [{"type": "string", "format": "ipv4"}, {"type": "string", "format": "ipv6"}],
                                 "description": "an IPv4 or IPv6 address literal (no host names)"})]
Port = Annotated[int, Field(ge=1, le=65535), BeforeValidator(_json_int)]
Count = Annotated[int, Field(ge=0, le=2**53), BeforeValidator(_json_int)]  # exact in a JSON double
Flag = StrictBool


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TierModel(Strict):
    name: TierName
    capacity_bytes: Count = 0
    num_chunks: Count = 0
    num_bytes: Count = 0


class NamespaceModel(Strict):
    model_id: Annotated[str, Field(min_length=1, max_length=256)]
    root: KeyHex
    chunk_size: Annotated[int, Field(ge=1, le=1 << 20), BeforeValidator(_json_int)]
    hash: Literal[HASH_NAMES] = "sha256"  # type: ignore[valid-type]
    partial: Flag = False


class RegisterRequest(Strict):
    instance_id: InstanceId
    host: Host
    port: Port
    tiers: Annotated[list[TierModel], Field(max_length=16)] = []
    namespaces: Annotated[list[NamespaceModel], Field(max_length=64)] = []
    reset: Flag = True


class RegisterResponse(BaseModel):
    ok: bool
    instance_ttl_s: float


class HeartbeatRequest(Strict):
    tiers: Annotated[list[TierModel], Field(max_length=16)] | None = None


class KnownResponse(BaseModel):
    ok: bool
    known: bool


TierKeys = Annotated[dict[TierName, Annotated[list[KeyHex], Field(max_length=MAX_KEYS)]],
                     Field(max_length=16, json_schema_extra={"additionalProperties": False})]


class EventsRequest(Strict):
    admit: TierKeys = {}
    evict: TierKeys = {}


class Selection(Strict):
    """A prompt (token ids, keyed with each instance's namespace) or explicit chunk keys: exactly one."""
    model_config = ConfigDict(extra="forbid",
                              json_schema_extra={"oneOf": [{"required": ["tokens"]}, {"required": ["keys"]}]})
    tokens: Annotated[list[TokenId], Field(max_length=MAX_TOKENS)] = None  # type: ignore[assignment]
    keys: Annotated[list[KeyHex], Field(max_length=MAX_KEYS)] = None  # type: ignore[assignment]
    model_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> Selection:
        if (self.tokens is None) == (self.keys is None):
            raise ValueError("give exactly one of tokens or keys")
        return self


class LookupRequest(Selection):
    detail: Flag = False  # per-chunk tiers, for every instance holding at least one of the chunks
    exclude: Annotated[list[InstanceId], Field(max_length=64)] = []


class InstanceHit(BaseModel):
    instance_id: str
    host: str
    port: int
    num_chunks: int  # chunks of the prompt in this instance's namespace
    prefix_chunks: int
    prefix_tokens: int | None = None
    tier: str | None = None  # the slowest tier the prefix is read from (each chunk from its fastest tier)
    tiers: dict[str, int] = {}  # prefix chunks per tier they are read from
    chunk_tiers: list[list[str]] | None = None  # detail: every tier holding each chunk


class LookupResponse(BaseModel):
    instances: list[InstanceHit]


class PinRequest(Selection):
    instance: InstanceId | None = None  # None: every instance holding the chunks
    tier: TierName | None = None


class ClearRequest(Strict):
    instance: InstanceId | None = None  # None: every instance
    tier: TierName | None = None  # None: every served tier


class MoveRequest(Selection):
    src: InstanceId
    src_tier: TierName | None = None
    dst: InstanceId
    dst_tier: TierName
    mode: Literal["copy", "migrate"] = "copy"


class MoveResponse(BaseModel):
    chunks: int
    bytes: int
    missing: int
    seconds: float


class InstanceResult(BaseModel):
    ok: bool
    chunks: int = 0
    error: str | None = None


class CommandResponse(BaseModel):
    instances: dict[str, InstanceResult]


class InstanceView(BaseModel):
    instance_id: str
    host: str
    port: int
    tiers: list[TierModel]
    namespaces: list[NamespaceModel]
    indexed_chunks: dict[str, int]
    registered_at: float
    last_seen: float
    age_s: float


class InstancesResponse(BaseModel):
    instances: list[InstanceView]


class HealthResponse(BaseModel):
    status: Literal["ok", "degraded"]
    index: str
    index_ok: bool
    instances: int


class ErrorResponse(BaseModel):
    detail: Any


# ---- the ASGI guard: body size bound + request metrics ---------------------------------------------------
class Guard:
    """Rejects bodies over `max_body_bytes` with 413 before the app reads them (Content-Length or streamed),
    then hands the app the buffered body; counts requests per route template and status."""

    def __init__(self, app: Any, max_body_bytes: int, metrics: Metrics) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            for name, value in scope.get("headers", []):
                if name == b"content-length":
                    if not value.isdigit() or int(value) > self.max_body_bytes:
                        await self._reject(send_wrapper, 413, "request body too large")
                        return
            chunks, size = [], 0
            if scope.get("method") in ("POST", "PUT", "PATCH", "DELETE"):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body = message.get("body", b"")
                    size += len(body)
                    if size > self.max_body_bytes:
                        await self._reject(send_wrapper, 413, "request body too large")
                        return
                    chunks.append(body)
                    if not message.get("more_body", False):
                        break
            buffered = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            delivered = False

            async def replay() -> dict:
                nonlocal delivered
                if not delivered:
                    delivered = True
                    return buffered
                return await receive()

            await self.app(scope, replay, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, str(status["code"])).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - started)

    @staticmethod
    async def _reject(send: Any, code: int, detail: str) -> None:
        body = ('{"detail":"%s"}' % detail).encode()
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvfabric_controller_requests", "HTTP requests", ["route", "status"], registry=r)
        self.latency = Histogram("kvfabric_controller_request_seconds", "HTTP request latency", ["route"],
                                 registry=r, buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5))
        self.events = Counter("kvfabric_controller_events", "chunk events applied", ["op"], registry=r)
        self.lookups = Counter("kvfabric_controller_lookups", "lookups served", registry=r)
        self.lookup_keys = Counter("kvfabric_controller_lookup_keys", "chunk keys looked up", registry=r)
        self.expired = Counter("kvfabric_controller_instances_expired", "instances dropped for missed heartbeats",
                               registry=r)
        self.instances = Gauge("kvfabric_controller_instances", "live instances", registry=r)
        self.indexed = Gauge("kvfabric_controller_indexed_chunks", "index entries per tier (last /instances or sweep)",
                             ["tier"], registry=r)
        self.moved_bytes = Counter("kvfabric_controller_moved_bytes", "bytes copied by move", registry=r)


# ---- the service ---------------------------------------------------------------------------------------------
class Controller:
    """State and logic behind the HTTP routes (usable directly in tests)."""

    def __init__(self, index: ChunkIndex, *, token: str | None = None, instance_ttl_s: float = 10.0,
                 control_timeout_s: float = 30.0, connect_timeout_s: float = 1.0) -> None:
        self.index = index
        self.token = token or None
        self.instance_ttl_s = instance_ttl_s
        self.control_timeout_s = control_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.metrics = Metrics()
        self._clients: dict[tuple[str, int], PeerClient] = {}
        self._lock = threading.Lock()

    # ---- helpers ---------------------------------------------------------------------------------------------
    def alive(self, exclude: Sequence[str] = ()) -> list[InstanceInfo]:
        cutoff = time.time() - self.instance_ttl_s
        return [i for i in self.index.instances() if i.last_seen >= cutoff and i.instance_id not in exclude]

    def instance(self, instance_id: str) -> InstanceInfo:
        info = self.index.get_instance(instance_id)
        if info is None or info.last_seen < time.time() - self.instance_ttl_s:
            raise HTTPException(404, f"no live instance {instance_id!r}")
        return info

    def client(self, info: InstanceInfo) -> PeerClient:
        with self._lock:
            client = self._clients.get((info.host, info.port))
            if client is None:
                client = PeerClient(info.host, info.port, self.token, connect_timeout_s=self.connect_timeout_s,
                                    io_timeout_s=self.control_timeout_s, pool_size=2)
                self._clients[(info.host, info.port)] = client
            return client

    def command(self, info: InstanceInfo, message: dict) -> dict:
        try:
            reply = self.client(info).control(message, timeout_s=self.control_timeout_s)
        except PeerError as exc:
            return {"ok": False, "error": str(exc), "code": 502}
        return reply

    @staticmethod
    def keys_for(ns: Namespace, tokens: Sequence[int]) -> list[bytes]:
        return chunk_keys(tokens, bytes.fromhex(ns.root), ns.chunk_size, ns.partial, ns.hash)

    def selection(self, sel: Selection, info: InstanceInfo) -> tuple[list[bytes], Namespace | None]:
        """The chunk keys `sel` names on this instance (tokens: with its namespace; [] if it has none)."""
        if sel.keys is not None:
            return [bytes.fromhex(k) for k in sel.keys], None
        for ns in info.namespaces:
            if sel.model_id is None or ns.model_id == sel.model_id:
                return self.keys_for(ns, sel.tokens or []), ns
        return [], None

    # ---- operations ------------------------------------------------------------------------------------------
    def lookup(self, req: LookupRequest) -> LookupResponse:
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
                sig = (ns.root, ns.chunk_size, ns.hash, ns.partial)
                if sig not in keyed:
                    keyed[sig] = (self.keys_for(ns, req.tokens or []), ns)
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
        known = self.index.heartbeat(instance_id, tiers, time.time())
        return KnownResponse(ok=known, known=known)

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

    def pin(self, req: PinRequest, op: str) -> CommandResponse:
        results: dict[str, InstanceResult] = {}
        for info in self.targets(req.instance):
            keys, _ = self.selection(req, info)
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

    def move(self, req: MoveRequest) -> MoveResponse:
        started = time.perf_counter()
        src, dst = self.instance(req.src), self.instance(req.dst)
        if req.dst_tier not in {t.name for t in dst.tiers}:
            raise HTTPException(400, f"instance {dst.instance_id!r} has no tier {req.dst_tier!r}")
        if req.src == req.dst and req.src_tier in (None, req.dst_tier):
            raise HTTPException(400, "source and destination are the same instance and tier")
        keys, _ = self.selection(req, src)
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
                age_s=max(0.0, now - info.last_seen)))
        self.metrics.instances.set(len(views))
        for tier, n in totals.items():
            self.metrics.indexed.labels(tier).set(n)
        return InstancesResponse(instances=sorted(views, key=lambda v: v.instance_id))

    def sweep(self) -> list[str]:
        gone = self.index.expire(time.time() - self.instance_ttl_s)
        if gone:
            log.info("dropped instances that missed their heartbeats: %s", ", ".join(gone))
            self.metrics.expired.inc(len(gone))
        return gone

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
        self.index.close()


def vars_of(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


def create_app(index: ChunkIndex | None = None, *, token: str | None = None, instance_ttl_s: float = 10.0,
               max_body_bytes: int = MAX_BODY_BYTES, sweep_interval_s: float | None = None,
               control_timeout_s: float = 30.0, connect_timeout_s: float = 1.0) -> Any:
    """The ASGI app (FastAPI wrapped in the body-size guard). `app.state.controller` is the Controller
    (on the inner FastAPI app; the returned object exposes it as `.controller` too)."""
    ctl = Controller(index if index is not None else open_index("memory"), token=token,
                     instance_ttl_s=instance_ttl_s, control_timeout_s=control_timeout_s,
                     connect_timeout_s=connect_timeout_s)
    interval = sweep_interval_s if sweep_interval_s is not None else max(0.1, min(instance_ttl_s / 2, 5.0))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        async def sweeper() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await run_in_threadpool(ctl.sweep)
                except Exception:
                    log.exception("index sweep failed")

        task = asyncio.create_task(sweeper())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await run_in_threadpool(ctl.close)

    bearer = HTTPBearer(auto_error=False, description="the cluster token (required when one is configured)")

    def authorize(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if ctl.token is None:
            return
        given = credentials.credentials.encode() if credentials is not None else b""
        if not hmac.compare_digest(given, ctl.token.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    errors = {code: {"model": ErrorResponse} for code in (400, 401, 413, 422)}
    app = FastAPI(title="kvfabric controller", version="1", lifespan=lifespan, responses=errors)
    app.state.controller = ctl
    auth = [Depends(authorize)]

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Not the default handler: it echoes the input back (a large or non-JSON value such as 1e999 -> inf
        # would make the error itself fail to render, and echoing inputs amplifies hostile requests).
        detail = [{"type": str(e.get("type")), "loc": [str(part) for part in e.get("loc", ())][:16],
                   "msg": str(e.get("msg"))[:500]} for e in exc.errors()[:20]]
        return JSONResponse({"detail": detail}, status_code=422)

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.warning("index backend error: %s", exc)
        return JSONResponse({"detail": "index backend unavailable"}, status_code=503)

    for error in backend_errors():
        app.add_exception_handler(error, unavailable)

    @app.get("/v1/health", response_model=HealthResponse)
    def health() -> HealthResponse:
        index_ok = ctl.index.ping()
        count = len(ctl.alive()) if index_ok else 0
        return HealthResponse(status="ok" if index_ok else "degraded", index=ctl.index.backend, index_ok=index_ok,
                              instances=count)

    @app.get("/metrics", dependencies=auth, response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        return Response(generate_latest(ctl.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/lookup", dependencies=auth, response_model=LookupResponse)
    def lookup(req: LookupRequest) -> LookupResponse:
        return ctl.lookup(req)

    @app.get("/v1/instances", dependencies=auth, response_model=InstancesResponse)
    def instances() -> InstancesResponse:
        return ctl.instances()

    @app.post("/v1/pin", dependencies=auth, response_model=CommandResponse, responses={404: {"model": ErrorResponse}})
    def pin(req: PinRequest) -> CommandResponse:
        return ctl.pin(req, "pin")

    @app.post("/v1/unpin", dependencies=auth, response_model=CommandResponse,
              responses={404: {"model": ErrorResponse}})
    def unpin(req: PinRequest) -> CommandResponse:
        return ctl.pin(req, "unpin")

    @app.post("/v1/clear", dependencies=auth, response_model=CommandResponse,
              responses={404: {"model": ErrorResponse}})
    def clear(req: ClearRequest) -> CommandResponse:
        return ctl.clear(req)

    @app.post("/v1/move", dependencies=auth, response_model=MoveResponse,
              responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 502: {"model": ErrorResponse}})
    def move(req: MoveRequest) -> MoveResponse:
        return ctl.move(req)

    @app.post("/v1/workers/register", dependencies=auth, response_model=RegisterResponse)
    def register(req: RegisterRequest) -> RegisterResponse:
        return ctl.register(req)

    @app.post("/v1/workers/{instance_id}/heartbeat", dependencies=auth, response_model=KnownResponse)
    def heartbeat(instance_id: InstanceId, req: HeartbeatRequest) -> KnownResponse:
        return ctl.heartbeat(instance_id, req)

    @app.post("/v1/workers/{instance_id}/events", dependencies=auth, response_model=KnownResponse)
    def events(instance_id: InstanceId, req: EventsRequest) -> KnownResponse:
        return ctl.events(instance_id, req)

    @app.delete("/v1/workers/{instance_id}", dependencies=auth, response_model=KnownResponse)
    def unregister(instance_id: InstanceId) -> KnownResponse:
        known = ctl.index.unregister(instance_id)
        return KnownResponse(ok=known, known=known)

    guarded = Guard(app, max_body_bytes, ctl.metrics)
    guarded.controller = ctl  # type: ignore[attr-defined]
    guarded.fastapi = app  # type: ignore[attr-defined]
    return guarded


def backend_errors() -> tuple[type[Exception], ...]:
    """What an index backend raises when it is unreachable (answered 503)."""
    import redis
    return (redis.RedisError, ConnectionError, TimeoutError)


def check_bind(host: str, token: str | None) -> None:
    if not token and not is_loopback(host):
        raise ValueError(f"the controller binds {host!r}, beyond loopback: a token is required")


def run_controller(host: str = "127.0.0.1", port: int = DEFAULT_PORT, token: str | None = None,
                   index_url: str | None = "memory", *, index_is_cluster: bool = False, index_prefix: str = "kvfc:",
                   instance_ttl_s: float = 10.0, max_body_bytes: int = MAX_BODY_BYTES,
                   control_timeout_s: float = 30.0, log_level: str = "warning") -> None:
    """Serve the controller until interrupted (blocks). Raises ValueError for an unsafe bind."""
    import uvicorn
    check_bind(host, token)
    index = open_index(index_url, is_cluster=index_is_cluster, prefix=index_prefix)
    app = create_app(index, token=token, instance_ttl_s=instance_ttl_s, max_body_bytes=max_body_bytes,
                     control_timeout_s=control_timeout_s)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, limit_concurrency=512,
                timeout_keep_alive=30, h11_max_incomplete_event_size=64 * 1024, server_header=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfabric controller", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--token-file", help="file holding the bearer token (default: $KVFABRIC_CLUSTER__TOKEN)")
    parser.add_argument("--index", default="memory",
                        help="'memory' or a Redis URL (redis://, rediss://, unix://; redis+cluster:// for a cluster)")
    parser.add_argument("--index-prefix", default="kvfc:", help="key prefix in Redis (one per fleet)")
    parser.add_argument("--instance-ttl", type=float, default=10.0, help="drop instances silent this long (s)")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    token = os.environ.get("KVFABRIC_CLUSTER__TOKEN") or None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip() or None
    logging.basicConfig(level=args.log_level.upper())
    try:
        run_controller(args.host, args.port, token, args.index, index_prefix=args.index_prefix,
                       instance_ttl_s=args.instance_ttl, max_body_bytes=args.max_body_bytes,
                       log_level=args.log_level)
    except ValueError as exc:
        print(f"kvfabric controller: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
