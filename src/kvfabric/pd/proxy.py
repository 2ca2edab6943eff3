"""`kvfabric pd-proxy`: an OpenAI-compatible HTTP front for one prefill and one decode vLLM instance.

Contract:
- POST /v1/completions and /v1/chat/completions: the request goes to the prefill instance with max_tokens=1 (and
  max_completion_tokens=1, no streaming), whose connector (kv_role kv_producer) answers only once the prompt's
  KV is in the shared tiers; then, unchanged, to the decode instance (kv_consumer), which loads that KV and
  decodes. The decode instance's answer is returned as it is: status, JSON body, or the event stream as it comes.
- A prefill instance that fails or cannot be reached within `prefill_timeout_s` is counted and skipped: the
  decode instance then computes the prompt itself (a miss in the pool), so the request is still answered.
- GET /v1/models and /health are the decode instance's; GET /pd/stats: the proxy's counters.
- Listens on 127.0.0.1 only. No state but the two HTTP clients and the counters. `serve` runs it in the
  foreground (the CLI); `ProxyThread` in a thread of this process (benchmarks, tests).
"""
from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvfabric.observe.counters import Counters

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


def base_url(url: str) -> str:
    """'http://host:port', 'http://host:port/' or 'http://host:port/v1' -> 'http://host:port'."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, no stream."""
    out = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def make_app(prefill_url: str, decode_url: str, *, prefill_timeout_s: float = 600.0,
             decode_timeout_s: float = 600.0) -> FastAPI:
    counters = Counters()
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        clients["prefill"] = httpx.AsyncClient(base_url=base_url(prefill_url), timeout=prefill_timeout_s)
        clients["decode"] = httpx.AsyncClient(base_url=base_url(decode_url), timeout=decode_timeout_s)
        yield
        for client in clients.values():
            await client.aclose()

    app = FastAPI(title="kvfabric pd-proxy", lifespan=lifespan)

    async def prefill(path: str, body: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            reply = await clients["prefill"].post(path, json=prefill_body(body))
            ok = reply.status_code == 200
        except httpx.HTTPError:
            ok = False
        counters.add("prefill_ns", int((time.perf_counter() - started) * 1e9))
        counters.add("prefills" if ok else "prefill_failures")

    async def completion(request: Request) -> Response:
        body = await request.json()
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the request body must be a JSON object"}}, status_code=400)
        path = request.url.path
        await prefill(path, body)
        decode = clients["decode"]
        counters.add("requests")
        try:
            if not body.get("stream"):
                reply = await decode.post(path, json=body)
                return Response(reply.content, status_code=reply.status_code,
                                media_type=reply.headers.get("content-type"))
            upstream = await decode.send(decode.build_request("POST", path, json=body), stream=True)
        except httpx.HTTPError as exc:
            counters.add("decode_failures")
            return JSONResponse({"error": {"message": f"decode instance unreachable: {exc}"}}, status_code=502)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for part in upstream.aiter_raw():
                    yield part
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    for path in COMPLETION_PATHS:
        app.add_api_route(path, completion, methods=["POST"])

    async def passthrough(request: Request) -> Response:
        try:
            reply = await clients["decode"].get(request.url.path)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": {"message": f"decode instance unreachable: {exc}"}}, status_code=502)
        return Response(reply.content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))

    app.add_api_route("/v1/models", passthrough, methods=["GET"])
    app.add_api_route("/health", passthrough, methods=["GET"])
    app.add_api_route("/pd/stats", lambda: counters.snapshot(), methods=["GET"])
    return app


def serve(prefill_url: str, decode_url: str, port: int) -> None:
    import uvicorn

    uvicorn.run(make_app(prefill_url, decode_url), host="127.0.0.1", port=port, log_level="warning")


class ProxyThread:
    """The proxy on 127.0.0.1:`port` in a daemon thread of this process; a context manager."""

    def __init__(self, prefill_url: str, decode_url: str, port: int, start_timeout_s: float = 30.0) -> None:
        import uvicorn

        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(make_app(prefill_url, decode_url), host="127.0.0.1", port=port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="kvfabric-pd-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:  # uvicorn sets the flag and offers no event to wait on
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.close()
                raise RuntimeError(f"pd-proxy did not start on {self.url}")
            time.sleep(0.01)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> ProxyThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
