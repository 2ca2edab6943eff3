"""The controller's ASGI app: `create_app` builds the FastAPI routes over a `Controller`, wrapped in a `Guard`.

- Every route except /v1/health requires `Authorization: Bearer <token>` when a token is configured (compared in
  constant time, 401 otherwise). A tenant's token (`TenantTokens`) opens lookup, pin, unpin and move only, scoped
  to its tenants (see `Controller`); every other route answers it 403. HTTP Basic with the token as password is
  the same credential, for browsers: the status page `/ui` (static HTML and a small script over /v1/instances and
  /v1/history) answers 401 with a Basic challenge, and the browser then sends the credential with the page's own
  API calls.
- Validation errors are answered 422 without echoing the input; an unreachable index backend (`backend_errors`)
  is answered 503.
- A background task sweeps instances that missed their heartbeats every `sweep_interval_s` (default: half the
  TTL, between 0.1 and 5 s); shutting the app down closes the Controller (its peer clients and the index).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import ssl
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfabric.cluster.controller_guard import Guard
from kvfabric.cluster.controller_models import (
    MAX_BODY_BYTES,
    ClearRequest,
    CommandResponse,
    ErrorResponse,
    EventsRequest,
    HealthResponse,
    HeartbeatRequest,
    HistoryResponse,
    InstanceId,
    InstancesResponse,
    KnownResponse,
    LookupRequest,
    LookupResponse,
    MoveRequest,
    MoveResponse,
    PinRequest,
    RegisterRequest,
    RegisterResponse,
)
from kvfabric.cluster.controller_service import Controller
from kvfabric.cluster.controller_tenants import Caller, TenantTokens
from kvfabric.cluster.index import ChunkIndex, open_index

log = logging.getLogger(__name__)


def create_app(index: ChunkIndex | None = None, *, token: str | None = None, instance_ttl_s: float = 10.0,
               max_body_bytes: int = MAX_BODY_BYTES, sweep_interval_s: float | None = None,
               control_timeout_s: float = 30.0, connect_timeout_s: float = 1.0,
               peer_tls: ssl.SSLContext | None = None, tenants: TenantTokens = TenantTokens()) -> Any:
    """The ASGI app (FastAPI wrapped in the body-size guard). `app.state.controller` is the Controller
    (on the inner FastAPI app; the returned object exposes it as `.controller` too)."""
    ctl = Controller(index if index is not None else open_index("memory"), token=token,
                     instance_ttl_s=instance_ttl_s, control_timeout_s=control_timeout_s,
                     connect_timeout_s=connect_timeout_s, peer_tls=peer_tls)
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

    bearer = HTTPBearer(auto_error=False,
                        description="the cluster token, or a tenant's token (required when a token is configured)")

    def caller_of(request: Request) -> Caller | None:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        given = b""
        if scheme.lower() == "bearer":
            given = value.strip().encode()
        elif scheme.lower() == "basic":  # a browser: user name ignored, the token is the password
            try:
                given = base64.b64decode(value.strip(), validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                given = b""
        return tenants.identify(given, ctl.token)

    def authorize(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Caller:
        caller = caller_of(request)
        if caller is None:
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
        return caller

    def operator(caller: Caller = Depends(authorize)) -> Caller:
        if not caller.is_admin:
            raise HTTPException(403, "a tenant's token may only look up, pin, unpin and move its own chunks")
        return caller

    errors = {code: {"model": ErrorResponse} for code in (400, 401, 403, 413, 422)}
    app = FastAPI(title="kvfabric controller", version="1", lifespan=lifespan, responses=errors)
    app.state.controller = ctl
    auth = [Depends(operator)]

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

    @app.get("/v1/history", dependencies=auth, response_model=HistoryResponse)
    def history() -> HistoryResponse:
        return ctl.history()

    page = resources.files("kvfabric.cluster").joinpath("ui/status.html").read_text()

    @app.get("/ui", response_class=HTMLResponse, include_in_schema=False)
    def status_page(request: Request) -> HTMLResponse:
        caller = caller_of(request)
        if caller is None or not caller.is_admin:
            return HTMLResponse("<p>kvfabric controller: the cluster token is the password</p>", status_code=401,
                                headers={"WWW-Authenticate": 'Basic realm="kvfabric", charset="UTF-8"'})
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.post("/v1/lookup", response_model=LookupResponse)
    def lookup(req: LookupRequest, caller: Caller = Depends(authorize)) -> LookupResponse:
        return ctl.lookup(req, caller)

    @app.get("/v1/instances", dependencies=auth, response_model=InstancesResponse)
    def instances() -> InstancesResponse:
        return ctl.instances()

    @app.post("/v1/pin", response_model=CommandResponse, responses={404: {"model": ErrorResponse}})
    def pin(req: PinRequest, caller: Caller = Depends(authorize)) -> CommandResponse:
        return ctl.pin(req, "pin", caller)

    @app.post("/v1/unpin", response_model=CommandResponse, responses={404: {"model": ErrorResponse}})
    def unpin(req: PinRequest, caller: Caller = Depends(authorize)) -> CommandResponse:
        return ctl.pin(req, "unpin", caller)

    @app.post("/v1/clear", dependencies=auth, response_model=CommandResponse,
              responses={404: {"model": ErrorResponse}})
    def clear(req: ClearRequest) -> CommandResponse:
        return ctl.clear(req)

    @app.post("/v1/move", response_model=MoveResponse,
              responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 502: {"model": ErrorResponse}})
    def move(req: MoveRequest, caller: Caller = Depends(authorize)) -> MoveResponse:
        return ctl.move(req, caller)

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

