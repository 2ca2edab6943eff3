"""`kvfabric server`: one cache process per host, shared by every engine process (ShadowServe's data plane on a
CPU core of its own; LMCache's separate cache process).

    main.py        start-up: pinning to the given cores, thread pools sized to them, pool, tiers, signals
    listener.py    the Unix control socket (0600, optional token): admission, a thread per connection
    service.py     the requests: lookup, retrieve (decode into pool slots), lease / commit (stores persisted in
                   the background), prefetch, pin / unpin, stats, flush
    streams.py     FETCH_STREAM: a KV stream (kvfabric.stream) received and decoded into pool slots
    slots.py       the slot table: READY / ALLOCATED / FREE, leases per connection, LRU of decoded chunks
    namespaces.py  one CacheEngine per key namespace over the server's one set of tiers (and P2P node)
    metrics.py     Prometheus collectors (per client requests, bytes, hit tokens; decode and fetch time)

The engine side (protocol, pool mapping, RemoteCache) is `kvfabric.cache.remote`, a layer below: engines and connectors
import that, never this package.
"""
from kvfabric.server.main import parse_cpus, serve

__all__ = ["parse_cpus", "serve"]
