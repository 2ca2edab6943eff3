"""Redis / Valkey tier: chunk blobs as plain string values on a Redis server or Redis Cluster.

Contract:
- A chunk lives under `kvf:<key hex>` (the chunk key already names model, layout and tenant). Values are the
  chunk blobs, passed to SET as they are (bytes, bytearray or memoryview; redis-py sends large arguments
  without copying) and returned from GET as the bytes redis-py built: no extra copy on either side.
- `contains_many` is one pipelined round trip (one EXISTS per key; a single multi-key EXISTS only counts).
  In cluster mode (`is_cluster`) the keys are grouped by the node serving their slot: one pipeline (one round
  trip) per node touched, each under that node's breaker.
- The server owns the bound: `ttl_s > 0` stores with SET EX, and the server's maxmemory policy evicts. An
  evicted or expired key is a clean miss. `capacity_bytes` is informational (and rejects a single blob larger
  than it); pin/unpin are no-ops because this process cannot stop the server from evicting a key.
- Not trusted: the stack verifies every blob read from here, so a value damaged on the server is a counted miss.
- Faults never reach the caller and never hang it: every socket operation has `timeout_s` (connect too); a
  failed call is a miss / False / [False, ...]. After `breaker_failures` consecutive connection failures a
  circuit breaker (kvfabric.net.breaker) opens: calls answer at once without touching the network, and one probe
  call is let through after a backoff (0.1 s, doubling, capped at `backoff_max_s`); its success closes it. redis-py
  reconnects by itself, so the tier recovers when the server comes back. Failed or skipped stores are dropped
  and counted in `counters`, never retried.
- One breaker (`breaker`) for a single server. In cluster mode a keyed call (get, put, delete, contains_many's
  per-node batch) goes under the breaker of the node serving the key's slot (`node_breakers`,
  kvfabric.tiers.redis_nodes; the node read from the client's slot map, no network): an unreachable node's keys
  miss at once once its breaker opens, the other nodes' keys are served. `breaker` then guards the client's set-up,
  the calls to every node (keys, usage, clear) and keys whose slot the map does not cover. The client is kept
  when a node fails: redis-py refreshes its slot map itself (from the other nodes first) after a node's error.
- Thread safe: redis-py's clients use a connection pool; the breakers have their own locks.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.exceptions import ClusterError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from kvfabric.net.breaker import CircuitBreaker
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob, TierBase, TierUsage
from kvfabric.tiers.redis_nodes import NodeBreakers, by_node, node_of

log = logging.getLogger(__name__)

PREFIX = b"kvf:"
SCAN_COUNT = 1000
DELETE_BATCH = 1000
T = TypeVar("T")


class _Unavailable(Exception):
    """Internal: the breaker is open, the call was not attempted."""


def redis_key(key: bytes) -> bytes:
    return PREFIX + key.hex().encode()


class RedisTier(TierBase):
    name = "redis"
    is_trusted = False
    is_read_only = False
    is_persistent = True  # the data lives on the server, beyond any client
    is_shared = True
    honors_capacity = False  # the server's maxmemory policy evicts; capacity_bytes only refuses larger blobs
    honors_pins = False  # a client cannot stop the server from evicting a key

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, is_cluster: bool = False, ttl_s: int = 0,
                 timeout_s: float = 0.5, capacity_bytes: int = 2**40, breaker_failures: int = 3,
                 backoff_max_s: float = 30.0, keys_limit: int = 1_000_000) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.url = url
        self.is_cluster = is_cluster
        self.ttl_s = int(ttl_s)
        self.timeout_s = float(timeout_s)
        self.capacity_bytes = capacity_bytes
        self.keys_limit = keys_limit
        self.counters = Counters()
        self.breaker = CircuitBreaker(breaker_failures, backoff_max_s)
        self.node_breakers = NodeBreakers(breaker_failures, backoff_max_s)  # cluster mode: per node, see above
        self._client: Any = None
        self._client_lock = threading.Lock()

    @property
    def is_breaker_open(self) -> bool:
        """The tier's breaker or (cluster mode) any node's is open: what the engine reports for this tier."""
        return self.breaker.is_open or bool(self.node_breakers.open_nodes())

    # ---- connection + fault handling ---------------------------------------------------------------------
    def _make_client(self) -> Any:
        common = dict(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                      health_check_interval=0, decode_responses=False)
        if self.is_cluster:
            # Cluster construction connects (it reads the slot map), so it happens lazily, under the breaker.
            # No client-side retries: the breaker decides when to try again.
            return redis.cluster.RedisCluster.from_url(self.url, retry=Retry(NoBackoff(), 0), **common)
        # One immediate retry on a connection error only: a pooled connection that died with a restarted server
        # is replaced at once. Timeouts are not retried (the caller would wait twice).
        return redis.Redis.from_url(self.url, retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
                                    **common)

    def client(self) -> Any:
        client = self._client
        if client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = self._make_client()
                client = self._client
        return client

    def _node(self, name: bytes) -> str | None:
        """Cluster mode: the node serving key `name` (None: no client yet, or a slot not in the map)."""
        client = self._client
        return None if not self.is_cluster or client is None else node_of(client, name)

    def _call(self, op: str, fn: Callable[[Any], T], node: str | None = None) -> T:
        """Run fn(client) under the breaker of `node` (None: the tier's); raise _Unavailable (that breaker is open)
        or the error after counting it."""
        breaker = self.breaker if node is None else self.node_breakers.get(node)
        where = self.url if node is None else f"{self.url} node {node}"
        if not breaker.allow():
            self.counters.add(f"{op}.skipped")
            raise _Unavailable
        try:
            result = fn(self.client())
        except (RedisError, RedisClusterException, OSError) as exc:
            if isinstance(exc, ResponseError) and not isinstance(exc, ClusterError):
                # The server answered (e.g. OOM under maxmemory noeviction): it is alive, the breaker stays shut.
                breaker.success()
                self.counters.add(f"{op}.rejected")
                log.debug("redis %s rejected: %s", op, exc)
                raise
            self.counters.add(f"{op}.errors")
            if breaker.failure():
                self.counters.add("breaker.opened")
                log.warning("redis tier %s unreachable (%s: %s); circuit open", where, type(exc).__name__, exc)
            raise
        if breaker.success():
            self.counters.add("breaker.closed")
            log.warning("redis tier %s reachable again; circuit closed", where)
        return result

    def _reset_client(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken client must not raise
                pass

    # ---- Tier protocol -----------------------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        names = [redis_key(key) for key in keys]
        found = [False] * len(keys)
        batches = by_node(self._client, names) if self.is_cluster else by_node(None, names)
        for batch in batches:
            def run(client: Any, positions: tuple[int, ...] = batch.positions) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for position in positions:
                    pipe.exists(names[position])
                return pipe.execute()

            try:
                for position, n in zip(batch.positions, self._call("contains", run, batch.node), strict=True):
                    found[position] = bool(n)
            except Exception:  # noqa: BLE001 - a fault is a miss, never an error for the caller
                continue
        return found

    def get(self, key: bytes) -> Blob | None:
        try:
            name = redis_key(key)
            value = self._call("get", lambda client: client.get(name), self._node(name))
        except Exception:  # noqa: BLE001
            return None
        if value is None:
            self.counters.add("get.miss")
        return value

    def put(self, key: bytes, blob: Blob) -> bool:
        if isinstance(blob, memoryview) and (blob.format != "B" or blob.ndim != 1):
            blob = blob.cast("B")  # redis-py writes len(arg) as the length: it must count bytes
        if len(blob) > self.capacity_bytes:
            self.counters.add("put.too_large")
            return False
        name = redis_key(key)
        ttl = self.ttl_s if self.ttl_s > 0 else None
        try:
            self._call("put", lambda client: client.set(name, blob, ex=ttl), self._node(name))
        except Exception:  # noqa: BLE001 - dropped and counted (counters["put.*"]), never retried
            self.counters.add("put.dropped")
            return False
        return True

    def delete(self, key: bytes) -> bool:
        try:
            name = redis_key(key)
            return bool(self._call("delete", lambda client: client.unlink(name), self._node(name)))
        except Exception:  # noqa: BLE001
            return False

    def _scan(self, client: Any, limit: int) -> list[bytes]:
        names: list[bytes] = []
        for name in client.scan_iter(match=PREFIX + b"*", count=SCAN_COUNT):
            names.append(name)
            if len(names) >= limit:
                break
        return names

    def keys(self) -> list[bytes]:
        """Keys on the server under the kvf: prefix (SCAN, at most `keys_limit`; [] when unreachable)."""
        try:
            names = self._call("keys", lambda client: self._scan(client, self.keys_limit))
        except Exception:  # noqa: BLE001
            return []
        out = []
        for name in names:
            try:
                out.append(bytes.fromhex(name[len(PREFIX):].decode()))
            except ValueError:
                continue  # a foreign key under our prefix
        return out

    def usage(self) -> TierUsage:
        """Best effort: DBSIZE (every key of the db) and INFO memory's used_memory_dataset; zeros when down."""
        def run(client: Any) -> tuple[int, int]:
            if self.is_cluster:
                primaries = redis.cluster.RedisCluster.PRIMARIES
                num_chunks = int(client.dbsize(target_nodes=primaries))  # summed over the primaries
                infos = client.info("memory", target_nodes=primaries)
                infos = list(infos.values()) if all(isinstance(v, dict) for v in infos.values()) else [infos]
            else:
                num_chunks, infos = int(client.dbsize()), [client.info("memory")]
            num_bytes = sum(int(info.get("used_memory_dataset", info.get("used_memory", 0))) for info in infos)
            return num_chunks, num_bytes

        try:
            num_chunks, num_bytes = self._call("usage", run)
        except Exception:  # noqa: BLE001
            num_chunks, num_bytes = 0, 0
        return TierUsage(self.name, num_chunks, num_bytes, self.capacity_bytes)

    def pin(self, keys: Iterable[bytes]) -> None:
        """No-op: the server owns eviction (maxmemory policy, TTL); a client cannot hold a key there. A chunk
        evicted between lookup and read is a clean miss, which the engine handles."""

    def unpin(self, keys: Iterable[bytes]) -> None:
        """No-op, see `pin`."""

    def clear(self) -> None:
        """Delete every kvf: key (SCAN + pipelined UNLINK); other keys on the server are left alone."""
        def run(client: Any) -> int:
            total = 0
            batch: list[bytes] = []
            # Deleting while scanning is safe: SCAN returns every key present for the whole scan.
            for name in client.scan_iter(match=PREFIX + b"*", count=SCAN_COUNT):
                batch.append(name)
                if len(batch) >= DELETE_BATCH:
                    total += unlink(client, batch)
            return total + unlink(client, batch)

        def unlink(client: Any, batch: list[bytes]) -> int:
            if batch:
                pipe = client.pipeline(transaction=False)
                for name in batch:
                    pipe.unlink(name)
                pipe.execute()
            num = len(batch)
            batch.clear()
            return num

        try:
            self._call("clear", run)
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        self._reset_client()
