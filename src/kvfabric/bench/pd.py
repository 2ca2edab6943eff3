"""`kvfabric bench pd`: prefill/decode disaggregation with real `vllm serve` processes, against one colocated instance.

Paths (each started here, one after the other, never two pairs at once):

    colocated  one vLLM instance, no connector, both cores
    shm        a prefill instance (kv_role kv_producer) and a decode instance (kv_consumer), each on its own core,
               sharing KV through one shared-memory pool, behind `kvfabric pd-proxy` (ProxyThread)

Per (path, prompt size, concurrency): TTFT mean and P99 measured on the client through the proxy (prefill + decode
first token), `transfer_s`: the decode instance's mean KV load time per request (its connector's counters),
`memcpy_s`: the same bytes copied in memory once, `socket_s`: the same bytes over a raw loopback socket, both
measured in this run; `same_output`: greedy text equal to the colocated instance's on every prompt.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from kvfabric.bench.serve import server_argv
from kvfabric.bench.vllm_server import VllmServer, free_port

CHUNK = 256


def pd_extra(pool: str, stats: Path, capacity: str = "2GiB") -> dict[str, Any]:
    """kv_connector_extra_config of both instances of a pair: one shm pool, nothing else."""
    return {"chunk_size": CHUNK, "tiers": ["shm"], "shm": {"name": pool, "capacity": capacity},
            "model_id": "kvfabric-bench-pd", "stats_path": str(stats)}


def start_instance(python: str, model: str, work: Path, name: str, cores: str, kv_role: str | None = None,
                   extra: dict[str, Any] | None = None, max_len: int = 2048,
                   kv_bytes: int = 1 << 30) -> VllmServer:
    """A `vllm serve` process pinned to `cores` (not yet ready: call wait_ready); with kv_role, KVFabricConnector."""
    port = free_port()
    argv = server_argv(python, model, port, kv_bytes, max_len)
    if kv_role is not None:
        argv += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric.connectors.vllm",
            "kv_role": kv_role, "kv_connector_extra_config": extra or {}})]
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores, "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}
    return VllmServer(argv, port, work / f"serve-{name}.log", env)


def pool_name() -> str:
    return f"pd-{os.getpid()}-{uuid.uuid4().hex[:8]}"
