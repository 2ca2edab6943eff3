"""Helpers for the server tests: a `kvfabric server` in its own process, or (fast tests) its parts in a thread of the
test process; configs for both ends; random KV of a small layout."""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from kvfabric.cache.remote.pool import SlotPool
from kvfabric.config import Config
from kvfabric.kv.layout import KVLayout
from kvfabric.server.listener import Listener
from kvfabric.server.main import pool_path
from kvfabric.server.service import Service

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout(2, 2, 16, "float16")  # 256-token chunk: 32 KiB
CHUNK = 256


def server_config(tmp_path: Path, **server: Any) -> dict[str, Any]:
    """A server config dict: a private socket and disk, small slots."""
    settings = {"socket": str(tmp_path / "kvf.sock"), "pool_capacity": "4MiB", "slot_bytes": "64KiB",
                "timeout_s": 2.0, "retry_s": 0.2, **server}
    return {"tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path / "disk")}, "server": settings}


def client_config(data: dict[str, Any]) -> Config:
    return Config.from_dict({**data, "mode": "server"})


def random_kv(num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(num_tokens), generator=gen).to(torch.float16)


def tokens_of(num_tokens: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (num_tokens,), generator=gen).tolist()


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    ready_line: str
    config: dict[str, Any]

    @property
    def socket(self) -> Path:
        return Path(self.config["server"]["socket"])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def start_server(tmp_path: Path, data: dict[str, Any], *extra: str) -> ServerProcess:
    path = tmp_path / f"server-{secrets.token_hex(3)}.yaml"
    path.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "KVFABRIC_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "kvfabric.apps.cli", "server", "--config", str(path), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline() if proc.stdout else ""
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line}{proc.stderr.read() if proc.stderr else ''}")
    return ServerProcess(proc, line, data)


@contextlib.contextmanager
def server_in_thread(tmp_path: Path, data: dict[str, Any]) -> Iterator[Service]:
    """The server's parts (pool, service, listener) in a thread of this process: fast tests of the protocol."""
    config = Config.from_dict(data)
    sock = Path(data["server"]["socket"])
    pool = SlotPool.create(pool_path(sock), config.server.slot_bytes, config.server.pool_capacity
                           // config.server.slot_bytes)
    service = Service(config, pool, 1)
    listener = Listener(service, sock, config.server)
    thread = threading.Thread(target=listener.serve_forever, daemon=True)
    thread.start()
    try:
        yield service
    finally:
        listener.close()
        thread.join(10)
        service.close()
        pool.unlink()
        pool.close()
