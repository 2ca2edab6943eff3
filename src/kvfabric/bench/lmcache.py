"""LMCache for the benchmarks: its venv's Python (scripts/setup_lmcache_venv.sh) and its standalone server.

LMCache runs in its multi-process mode, the one that runs on CPU: `lmcache server` owns the KV cache (its L1 is
process memory) and each vLLM engine connects to it with vLLM's own `LMCacheMPConnector`
(`extra_config()` is that connector's `kv_connector_extra_config`). The server is given the chunk size the
kvfabric runs use and both transfer modes ("auto": vLLM's adapter on CPU registers its KV cache engine-driven),
and a shared-memory segment (`--shm-name`): without one LMCache moves every chunk between vLLM and its server
pickled over ZeroMQ ("pickle non-GPU transfer strategy" in its log), its slowest path; with it, through /dev/shm.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from kvfabric.bench.vllm_server import free_ports

CHUNK = 256


def find_lmcache_python() -> str | None:
    """The LMCache venv's Python (scripts/setup_lmcache_venv.sh; `$KVFABRIC_LMCACHE_VENV`, else the repository's
    .venv-lmcache), or None: the LMCache column is then skipped."""
    venv = os.environ.get("KVFABRIC_LMCACHE_VENV") or str(Path(__file__).resolve().parents[3] / ".venv-lmcache")
    candidate = Path(venv) / "bin" / "python"
    if candidate.exists() and subprocess.run([str(candidate), "-c", "import lmcache, vllm"],
                                             capture_output=True).returncode == 0:
        return str(candidate)
    return None


class LMCacheServer:
    """LMCache's standalone server (its multi-process mode, the one that runs on CPU), on 127.0.0.1."""

    def __init__(self, python: str, workdir: Path, l1_gb: float = 4.0) -> None:
        self.port, http_port = free_ports(2)
        self.log = workdir / "lmcache-server.log"
        lmcache = str(Path(python).parent / "lmcache")
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [lmcache, "server", "--host", "127.0.0.1", "--port", str(self.port), "--chunk-size", str(CHUNK),
                 "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
                 "--http-host", "127.0.0.1", "--http-port", str(http_port), "--disable-observability",
                 "--shm-name", f"kvfabric-bench-lmcache-{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 180
        while "cache server is running" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"lmcache server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)  # its log line is the only readiness signal it gives

    def extra_config(self) -> dict[str, Any]:
        return {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
