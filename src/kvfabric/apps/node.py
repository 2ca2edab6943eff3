"""`kvfabric node`: a long-running cache instance (a server-style process) that can drive the synthetic workload
(kvfabric.engines.synthetic).

A node is a CacheEngine over the configured tiers with no model: with tier "peer" it joins the cluster (serves
its chunks to peers, reports to the controller), with `metrics.port` it serves /metrics, with `kv_events` it
publishes KV events. `--load OPS` runs a `Workload` on it, so that dashboards and `kvfabric stats` have
something to show.
"""
from __future__ import annotations

import signal
import threading
import time

import numpy as np

from kvfabric.cache.builder import build_engine
from kvfabric.config import Config
from kvfabric.engines.synthetic import MODEL_ID, SMALL_LAYOUT, Workload
from kvfabric.kv.layout import KVLayout


def run_node(config: Config, *, load_ops: float = 0.0, duration_s: float = 0.0, seed: int = 0,
             layout: KVLayout = SMALL_LAYOUT, on_ready=print) -> dict:
    """Serve until SIGINT / SIGTERM (or `duration_s`); with `load_ops` > 0 run the workload at about that many
    operations per second. Returns the workload's totals."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    totals = {"ops": 0, "wrong": 0, "checked": 0}
    with build_engine(config, layout, MODEL_ID) as engine:
        parts = [f"kvfabric node: tiers {','.join(config.tiers)}"]
        if engine.metrics_endpoint is not None:
            parts.append(f"metrics {engine.metrics_endpoint.url}")
        if engine.node is not None:
            parts.append(f"p2p 127.0.0.1:{engine.node.server.port} instance {engine.node.instance_id}")
        on_ready("; ".join(parts))
        workload = Workload(engine, seed=seed) if load_ops > 0 else None
        rng = np.random.default_rng(seed)
        deadline = time.monotonic() + duration_s if duration_s > 0 else float("inf")
        while not stop.is_set() and time.monotonic() < deadline:
            if workload is None:
                stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            started = time.monotonic()
            result = workload.step(rng)
            totals["ops"] += 1
            totals["wrong"] += result.num_wrong
            totals["checked"] += result.num_checked
            stop.wait(max(0.0, 1.0 / load_ops - (time.monotonic() - started)))
    return totals
