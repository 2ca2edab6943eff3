"""The vLLM scheduler side over a worker's cache, as the connector wires them: the worker's cache answers on a
lookup socket (connectors/lookup.py), the scheduler asks it. Needs vllm importable (the scheduler module)."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def scheduler_asking(cache, config, layout, *args, block_size: int = 128, key_mode: str = "tokens",
                     **kwargs) -> Iterator:
    """A SchedulerSide(config, layout, "m", block_size, key_mode, *args, **kwargs) whose lookups ask `cache` (a
    CacheEngine or RemoteCache) through a LookupService, closed on exit."""
    from kvfabric.connectors.lookup import LookupClient, LookupService
    from kvfabric.connectors.vllm.scheduler import SchedulerSide

    folder = tempfile.mkdtemp(prefix="kvf-lookup-")  # short: a Unix socket path has at most 107 bytes
    path = str(Path(folder) / "lookup.sock")
    service = LookupService(cache, path)
    side = SchedulerSide(config, layout, "m", block_size, key_mode, *args, client=LookupClient(path), **kwargs)
    try:
        yield side
    finally:
        side.lookup.close()
        service.close()
        shutil.rmtree(folder, ignore_errors=True)
