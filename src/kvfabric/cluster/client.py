"""A small synchronous client of the controller's HTTP API (workers, PeerTier, tests, scripts).

Every call has a timeout; `try_*` helpers used on the engine's path return None instead of raising.
One ControllerClient per thread of use is the simple rule (httpx pools connections per client).
"""
from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import Any

import httpx


class ControllerError(Exception):
    """The controller could not be reached or refused the call."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ControllerClient:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 2.0,
                 tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the client context (kvfabric.net.tls.client_context) an https:// controller is checked with."""
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, trust_env=False,
                                  verify=tls if tls is not None else True)

    def call(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None) -> Any:
        try:
            kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
            response = self._http.request(method, path, json=body, **kwargs)
        except httpx.HTTPError as exc:
            raise ControllerError(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 400:
            raise ControllerError(f"{method} {path}: HTTP {response.status_code}: {response.text[:500]}",
                                  response.status_code)
        try:
            return response.json()
        except ValueError:
            return response.text

    # ---- management API ------------------------------------------------------------------------------------
    def lookup(self, *, tokens: Sequence[int] | None = None, keys: Sequence[bytes] | None = None,
               model_id: str | None = None, detail: bool = False, exclude: Sequence[str] = (),
               timeout_s: float | None = None) -> dict:
        body: dict[str, Any] = {"detail": detail, "exclude": list(exclude)}
        if tokens is not None:
            body["tokens"] = [int(t) for t in tokens]
        if keys is not None:
            body["keys"] = [k.hex() for k in keys]
        if model_id is not None:
            body["model_id"] = model_id
        return self.call("POST", "/v1/lookup", body, timeout_s)

    def instances(self) -> list[dict]:
        return self.call("GET", "/v1/instances")["instances"]

    def health(self) -> dict:
        return self.call("GET", "/v1/health")

    def pin(self, op: str = "pin", **selection: Any) -> dict:
        return self.call("POST", f"/v1/{op}", _selection(selection))

    def clear(self, instance: str | None = None, tier: str | None = None) -> dict:
        return self.call("POST", "/v1/clear", {"instance": instance, "tier": tier})

    def move(self, *, src: str, dst: str, dst_tier: str, src_tier: str | None = None, mode: str = "copy",
             timeout_s: float | None = 120.0, **selection: Any) -> dict:
        body = {"src": src, "dst": dst, "dst_tier": dst_tier, "src_tier": src_tier, "mode": mode,
                **_selection(selection)}
        return self.call("POST", "/v1/move", body, timeout_s)

    def metrics(self) -> str:
        return self.call("GET", "/metrics")

    # ---- worker API ----------------------------------------------------------------------------------------
    def register(self, body: dict) -> dict:
        return self.call("POST", "/v1/workers/register", body)

    def heartbeat(self, instance_id: str, tiers: list[dict] | None, stats: dict[str, int] | None = None) -> dict:
        body: dict[str, Any] = {"tiers": tiers}
        if stats:
            body["stats"] = stats
        return self.call("POST", f"/v1/workers/{instance_id}/heartbeat", body)

    def history(self) -> dict:
        return self.call("GET", "/v1/history")

    def events(self, instance_id: str, admit: dict[str, list[str]], evict: dict[str, list[str]]) -> dict:
        return self.call("POST", f"/v1/workers/{instance_id}/events", {"admit": admit, "evict": evict})

    def unregister(self, instance_id: str, timeout_s: float | None = None) -> dict:
        return self.call("DELETE", f"/v1/workers/{instance_id}", None, timeout_s)

    def close(self) -> None:
        self._http.close()


def _selection(selection: dict[str, Any]) -> dict[str, Any]:
    out = dict(selection)
    if out.get("tokens") is not None:
        out["tokens"] = [int(t) for t in out["tokens"]]
    if out.get("keys") is not None:
        out["keys"] = [k.hex() if isinstance(k, (bytes, bytearray)) else k for k in out["keys"]]
    return out
