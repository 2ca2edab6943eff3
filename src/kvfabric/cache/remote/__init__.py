"""The engine side of `kvfabric server`: what an engine process needs to use the host's cache process.

    protocol.py    control frames over the Unix socket (header + msgpack body), field checks
    pool.py        the shared-memory slot pool: created by the server, mapped by every client, zero-copy views
    connection.py  one client connection: hello, requests under a deadline, lease bookkeeping
    client.py      RemoteCache: CacheEngine's public seam (lookup / store / retrieve / read_chunk / store_chunk)
                   over the server; faults become misses

`kvfabric.cache.builder.build_engine(config, layout, model_id)` is how engines pick their cache: a RemoteCache with
`mode: server`, else an in-process CacheEngine (the default). The server itself is `kvfabric.server`, a layer above.
"""
from __future__ import annotations

from kvfabric.cache.remote.client import RemoteCache, StreamFetch

__all__ = ["RemoteCache", "StreamFetch"]
