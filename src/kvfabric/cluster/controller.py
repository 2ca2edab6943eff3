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

Tenants (`--tenant-tokens FILE`, a YAML mapping tenant -> token): a tenant's token may look up, pin, unpin and
move by tokens, keyed only in its own tenants' namespaces (a vLLM request's cache_salt); every other route is 403.

Security: binds 127.0.0.1 unless told otherwise, and refuses to bind elsewhere without a token, nor without TLS
(`--tls-cert` / `--tls-key`; `--tls-ca` with `--tls-require-client-cert` for mTLS, and to check the workers' P2P
servers) unless `--insecure` (then a logged warning); the token is
compared in constant time; request bodies are bounded (`max_body_bytes`, 413) and every field is validated
(422): a malformed or hostile request gets a 4xx. Worker addresses must be IP literals (no DNS lookups on
behalf of a client). Commands that need a worker (pin, clear, move) reach it over the P2P protocol with the
same token; an unreachable worker gives 502 for that call, never a hang past `control_timeout_s`.

Modules: `controller_models` (the API schema and limits), `controller_guard` (`Guard`, `Metrics`),
`controller_service` (`Controller`), `controller_app` (`create_app`, the ASGI app to embed); this one serves it
(`run_controller`, `main`, `check_bind`).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kvfabric.cluster.controller_app import create_app
from kvfabric.cluster.controller_models import MAX_BODY_BYTES
from kvfabric.cluster.controller_tenants import TenantTokens
from kvfabric.cluster.index import open_index
from kvfabric.net.tls import TLSFiles, check_exposure, client_context, is_loopback, server_context

DEFAULT_PORT = 8470


def check_bind(host: str, token: str | None) -> None:
    if not token and not is_loopback(host):
        raise ValueError(f"the controller binds {host!r}, beyond loopback: a token is required")


def run_controller(host: str = "127.0.0.1", port: int = DEFAULT_PORT, token: str | None = None,
                   index_url: str | None = "memory", *, index_is_cluster: bool = False, index_prefix: str = "kvfc:",
                   instance_ttl_s: float = 10.0, max_body_bytes: int = MAX_BODY_BYTES,
                   control_timeout_s: float = 30.0, log_level: str = "warning", metrics_port: int = 0,
                   metrics_host: str = "127.0.0.1", tls: TLSFiles = TLSFiles(), insecure: bool = False,
                   tenant_tokens: str | None = None) -> None:
    """Serve the controller until interrupted (blocks). Raises ValueError for an unsafe bind (TLSConfigError, a
    ValueError, for plain text beyond loopback or unreadable TLS files). With `metrics_port`, /metrics is also
    served there without a token (for a Prometheus on this host). `tls`: the API over HTTPS (uvicorn's TLS), and
    the CA the workers' P2P servers are checked against. `tenant_tokens`: the tenants' tokens file."""
    import uvicorn

    from kvfabric.observe.metrics import MetricsEndpoint
    check_bind(host, token)
    check_exposure(host, tls.is_enabled, insecure, "the controller")
    server_context(tls)  # a missing or unreadable file: one line now, not a uvicorn traceback
    tenants = TenantTokens.load(tenant_tokens, token) if tenant_tokens else TenantTokens()
    if metrics_port and not is_loopback(metrics_host):
        raise ValueError(f"the metrics endpoint binds {metrics_host!r}: metrics are served without a token, on "
                         "loopback only")
    index = open_index(index_url, is_cluster=index_is_cluster, prefix=index_prefix)
    app = create_app(index, token=token, instance_ttl_s=instance_ttl_s, max_body_bytes=max_body_bytes,
                     control_timeout_s=control_timeout_s, peer_tls=client_context(tls), tenants=tenants)
    ssl_options: dict = {}
    if tls.is_enabled:
        import ssl
        ssl_options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key or None, "ssl_ca_certs": tls.ca or None,
                       "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE}
    if metrics_port:
        MetricsEndpoint(app.controller.metrics.registry, metrics_host, metrics_port)  # a daemon thread
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, limit_concurrency=512,
                timeout_keep_alive=30, h11_max_incomplete_event_size=64 * 1024, server_header=False, **ssl_options)


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
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="also serve /metrics without a token on 127.0.0.1:PORT (0: only on the API port)")
    parser.add_argument("--tls-cert", default="", help="PEM certificate: serve the API over HTTPS")
    parser.add_argument("--tls-key", default="", help="its private key (PEM)")
    parser.add_argument("--tls-ca", default="",
                        help="PEM CA bundle: checks client certificates (mTLS) and the workers' P2P servers")
    parser.add_argument("--tls-require-client-cert", action="store_true",
                        help="accept only clients with a certificate the CA signed (mTLS)")
    parser.add_argument("--tenant-tokens", default=None, metavar="FILE",
                        help="YAML mapping tenant -> token: tokens that see only their tenants' chunks")
    parser.add_argument("--insecure", action="store_true",
                        help="allow plain HTTP beyond loopback (the token crosses the network in clear)")
    args = parser.parse_args(argv)
    token = os.environ.get("KVFABRIC_CLUSTER__TOKEN") or None
    logging.basicConfig(level=args.log_level.upper())
    try:
        if args.token_file:
            token = read_token(args.token_file)
        run_controller(args.host, args.port, token, args.index, index_prefix=args.index_prefix,
                       instance_ttl_s=args.instance_ttl, max_body_bytes=args.max_body_bytes,
                       log_level=args.log_level, metrics_port=args.metrics_port,
                       tls=TLSFiles(args.tls_cert, args.tls_key, args.tls_ca, args.tls_require_client_cert),
                       insecure=args.insecure, tenant_tokens=args.tenant_tokens)
    except ValueError as exc:
        print(f"kvfabric controller: {exc}", file=sys.stderr)
        return 2
    return 0


def read_token(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError as exc:
        raise ValueError(f"token file {path!r}: {exc.strerror or exc}") from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
