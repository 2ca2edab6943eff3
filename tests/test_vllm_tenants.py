"""Tenant mode through a real `vllm serve` and its HTTP API (.venv-vllm; skips without vllm; slow):

- tenant A's prompt (cache_salt "tenant-a") is stored under A's namespace;
- tenant B's identical prompt (cache_salt "tenant-b") finds none of A's chunks: no kvfabric hit and no vLLM hit
  (vLLM's own prefix cache folds the salt in too), so it is served as a miss; its time to first token is logged
  beside A's cold one;
- a request without a cache_salt is served without kvfabric's cache: nothing looked up, loaded or stored, also the
  second time;
- a fresh server (vLLM's own cache empty) loads A's prompt for tenant A from kvfabric's disk tier, never for B.

    .venv-vllm/bin/python -m pytest -m slow tests/test_vllm_tenants.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
import httpx  # noqa: E402

from tests.cluster_scripts.helpers import free_port, wait_for  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK = 256
PROMPT = [(i * 7919) % 20000 + 100 for i in range(3 * CHUNK + 40)]  # token ids: 3 whole chunks


def _model() -> str:
    from tests.test_vllm_connector import _model_dir
    return _model_dir()


class Server:
    def __init__(self, tmp_path: Path, name: str) -> None:
        self.port = free_port()
        extra = {"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path / "cache")},
                 "model_id": "kvfabric-test-smollm2", "tenant_mode": True}
        transfer = {"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric.connectors.vllm",
                    "kv_role": "kv_both", "kv_connector_extra_config": extra}
        argv = [str(Path(sys.executable).parent / "vllm"), "serve", _model(), "--host", "127.0.0.1", "--port",
                str(self.port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                "--max-num-seqs", "2", "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0",
                "--kv-transfer-config", json.dumps(transfer)]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")}
        self.log_path = tmp_path / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"

        def ready() -> bool:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            try:
                return httpx.get(self.base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(ready, 900, 1.0)
        self.model = httpx.get(self.base + "/v1/models", timeout=30).json()["data"][0]["id"]

    def ask(self, salt: str | None) -> tuple[dict, float]:
        """(kvfabric's stats of the request, seconds to its one token)."""
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        started = time.perf_counter()
        reply = httpx.post(self.base + "/v1/completions", json=body, timeout=600)
        seconds = time.perf_counter() - started
        assert reply.status_code == 200, reply.text
        params = reply.json().get("kv_transfer_params") or {}
        return params.get("kvfabric") or {}, seconds

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)
        self.log.close()


def test_tenant_b_never_hits_tenant_a_and_no_tenant_means_no_cache(tmp_path):
    first = Server(tmp_path, "first")
    try:
        a_cold, a_s = first.ask("tenant-a")
        b, b_s = first.ask("tenant-b")
        anon, _ = first.ask(None)
        anon_again, _ = first.ask(None)
    finally:
        first.close()
    assert a_cold.get("external_hit_tokens", 0) == 0
    assert b.get("external_hit_tokens", 0) == 0 and b.get("local_hit_tokens", 0) == 0  # B's prompt: a miss
    for stats in (anon, anon_again):  # no tenant: served without the cache
        assert stats.get("external_hit_tokens", 0) == 0 and stats.get("loaded_tokens", 0) == 0
    # A's 3 chunks and B's 3 (the same prompt under B's own namespace); none for the requests without a tenant
    assert len(list((tmp_path / "cache").rglob("*.kvc"))) == 6
    print(f"time to first token: tenant A cold {a_s:.3f} s, tenant B (A's prompt) {b_s:.3f} s")

    second = Server(tmp_path, "second")  # vLLM's own cache empty: only kvfabric's disk tier can serve a hit
    try:
        a_hit, _ = second.ask("tenant-a")
        other, _ = second.ask("tenant-c")
    finally:
        second.close()
    assert a_hit.get("external_hit_tokens") == 3 * CHUNK and a_hit.get("loaded_tokens") == 3 * CHUNK
    assert other.get("external_hit_tokens", 0) == 0
