"""`kvfabric server`: start, pin, serve until SIGTERM / SIGINT, clean up.

Contract:
- `parse_cpus("1")`, `parse_cpus("0-1,3")`: the set of core ids (ValueError for anything else).
- `serve(config, socket_path, cpus, metrics_port, ready)`: pins the process to `cpus` (os.sched_setaffinity) before
  any thread starts, sizes torch's threads and the server's decode / encode pools (and so the codecs' threads,
  which follow the affinity) to them, removes the pools of dead servers (`SlotPool.reclaim`), creates the slot pool
  (/dev/shm/kvfabric-server-<hash of the socket path>),
  the tiers and the listener, calls `ready(line)` once clients can connect, and serves until a signal. On exit it
  stops accepting, closes the connections, flushes the tiers' queued writes and removes the socket and the pool.
"""
from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

from kvfabric.cache.remote.pool import SlotPool
from kvfabric.config import Config
from kvfabric.server.listener import Listener
from kvfabric.server.service import Service

POOL_ROOT = Path("/dev/shm")


def parse_cpus(spec: str) -> set[int]:
    cpus: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or int(hi or lo) < int(lo):
            raise ValueError(f"cpus: expected core ids like 1 or 0-1,3, got {spec!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"cpus: no core in {spec!r}")
    return cpus


def pin(cpus: set[int]) -> int:
    """Pin this process to `cpus` and size torch's thread pool to them; the number of cores."""
    os.sched_setaffinity(0, cpus)
    import torch
    torch.set_num_threads(len(cpus))
    return len(cpus)


def pool_path(socket_path: Path) -> Path:
    digest = hashlib.sha256(str(socket_path.resolve()).encode()).hexdigest()[:16]
    return POOL_ROOT / f"kvfabric-server-{digest}"


def serve(config: Config, socket_path: str | os.PathLike | None = None, cpus: str | None = None,
          metrics_port: int | None = None, ready: Callable[[str], None] = print) -> None:
    settings = config.server
    path = Path(socket_path).expanduser() if socket_path else settings.resolved_socket()
    spec = settings.cpus if cpus is None else cpus
    num_cpus = pin(parse_cpus(spec)) if spec else len(os.sched_getaffinity(0))
    slot_bytes = settings.slot_bytes // 64 * 64
    SlotPool.reclaim(POOL_ROOT)  # pools of servers that died without cleaning up (SIGKILL, OOM)
    pool = SlotPool.create(pool_path(path), slot_bytes, max(1, settings.pool_capacity // slot_bytes))
    service = listener = None
    try:
        service = Service(config, pool, num_cpus)
        listener = Listener(service, path, settings)
        port = settings.metrics_port if metrics_port is None else metrics_port
        metrics = f" metrics=http://127.0.0.1:{service.metrics.serve(port)}/metrics" if port else ""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: listener.stop())
        ready(f"kvfabric server: ready socket={path} pool={pool.path} slots={pool.num_slots}x{slot_bytes} "
              f"cpus={sorted(os.sched_getaffinity(0))} tiers={','.join(config.tiers)} codec={config.codec}{metrics}")
        listener.serve_forever()
    finally:
        if listener is not None:
            listener.close()
        if service is not None:
            service.close()
        pool.unlink()
        pool.close()
