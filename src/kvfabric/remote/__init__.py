"""The engine side of `kvfabric server`: what an engine process needs to use the host's cache process.

    protocol.py    control frames over the Unix socket (header + msgpack body), field checks
    pool.py        the shared-memory slot pool: created by the server, mapped by every client, zero-copy views
    connection.py  one client connection: hello, requests under a deadline, lease bookkeeping
    client.py      RemoteCache: CacheEngine's public seam (lookup / store / retrieve / read_chunk / store_chunk)
                   over the server; faults become misses

`open_cache(config, layout, model_id)` is how engines pick their cache: a RemoteCache with `mode: server`, else an
in-process CacheEngine (the default). The server itself is `kvfabric.server`, a layer above this one.
"""
from __future__ import annotations

from kvfabric.config import Config
from kvfabric.engine import CacheEngine
from kvfabric.layout import KVLayout
from kvfabric.remote.client import RemoteCache, StreamFetch

__all__ = ["RemoteCache", "StreamFetch", "open_cache"]


def open_cache(config: Config | None, layout: KVLayout, model_id: str, *,
               name: str | None = None) -> CacheEngine | RemoteCache:
    config = config or Config()
    if config.mode == "server":
        return RemoteCache(config, layout, model_id, name=name)
    return CacheEngine(config, layout, model_id)
