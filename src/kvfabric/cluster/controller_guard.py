"""Request accounting for the controller: the ASGI `Guard` and the Prometheus `Metrics` registry.

- `Guard` wraps the FastAPI app: it rejects request bodies over `max_body_bytes` with 413 before the app reads
  them (by Content-Length, or while streaming), hands the app the buffered body, and counts every request and
  its latency per route template and status.
- `Metrics` is one registry per controller (served at /metrics): the Guard's request counters plus what the
  `Controller` records (events applied, lookups, expired instances, live instances, indexed chunks, moved bytes).
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector


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
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_open_fds, ...

