"""A Redis Cluster across emulated hosts (kvfabric.bench.hosts), and a redis tier driven over its stdin: for the
fault test of one cluster node partitioned.

- `server_argv(address, workdir)`: the redis-server command line of one cluster node bound to its host's address
  (port 6379, no persistence, `cluster-require-full-coverage no`: the other nodes keep serving their slots while
  one is unreachable; with the default `yes` the whole cluster refuses every key once a node is marked failed).
- `python -m kvfabric.bench.hosts_redis client ADDRESS ... --timeout S`: in the client's host; makes the cluster
  of the nodes at ADDRESS:6379 (`redis-cli --cluster create`, unless --no-create), waits (30 s at most) for
  `cluster_state:ok`, then a `RedisTier(is_cluster=True, timeout_s=S)`. Writes `{"ready": true, "nodes": [...]}`,
  then answers each JSON line read from stdin with one line:
  `{"op": "put" | "get", "keys": [A, B]}`: for each key A..B-1 a put of its blob (16 KiB, a function of the key,
  as a chunk's KV is), or a get compared with that blob; the reply, per node address holding the key's slot:
  `{"ok", "failed", "wrong", "max_s"}` (put: stored / refused; get: equal / a miss / other bytes; the slowest
  call in seconds), `breaker_opened` (times the tier's circuit opened so far) and `ended` (time.monotonic()).
Runs until its stdin closes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import time

MODULE = "kvfabric.bench.hosts_redis"
PORT = 6379
BLOB_BYTES = 16 << 10


def server_argv(address: str, workdir: str) -> list[str]:
    return [shutil.which("redis-server") or "redis-server", "--bind", address, "--port", str(PORT),
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
            "--cluster-require-full-coverage", "no", "--dir", workdir, "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--logfile", f"{workdir}/redis.log"]


def key_of(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def blob_of(i: int) -> bytes:
    seed = hashlib.sha256(key_of(i) + b"blob").digest()
    return seed * (BLOB_BYTES // len(seed))


def wait_until(address: str, is_ready, what: str, timeout_s: float) -> None:
    """Poll the node at address until is_ready(client) (a refused connection: not yet), at most timeout_s."""
    import redis

    deadline = time.monotonic() + timeout_s
    client = redis.Redis(address, PORT, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        while True:
            try:
                if is_ready(client):
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address}: not {what} within {timeout_s} s")
            time.sleep(0.05)  # polling the node: a pace, not a wait for an event
    finally:
        client.close()


def slot_owners(address: str) -> dict[int, str]:
    """Slot -> the address of the node serving it (CLUSTER SLOTS, asked of one node)."""
    import redis

    client = redis.Redis(address, PORT, socket_timeout=1.0)
    try:
        owners = {}
        for first, last, primary, *_ in client.execute_command("CLUSTER SLOTS"):
            host = primary[0].decode() if isinstance(primary[0], bytes) else primary[0]
            owners.update(dict.fromkeys(range(first, last + 1), host))
        return owners
    finally:
        client.close()


def client(addresses: list[str], timeout_s: float, create: bool, breaker_failures: int) -> None:
    from redis.crc import key_slot

    from kvfabric.tiers.redis import RedisTier, redis_key

    logging.getLogger("kvfabric").setLevel(logging.ERROR)  # the breaker's warnings: counted by the test instead
    for address in addresses:
        wait_until(address, lambda c: c.ping(), "answering", 30)
    if create:
        subprocess.run(["redis-cli", "--cluster", "create", *[f"{a}:{PORT}" for a in addresses],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60)
    for address in addresses:
        wait_until(address, lambda c: c.cluster("info").get("cluster_state") == "ok", "cluster_state:ok", 30)
    owners = slot_owners(addresses[0])
    tier = RedisTier(f"redis://{addresses[0]}:{PORT}", is_cluster=True, timeout_s=timeout_s,
                     breaker_failures=breaker_failures)
    print(json.dumps({"ready": True, "nodes": sorted(set(owners.values()))}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        per_node: dict[str, dict] = {}
        for i in range(*request["keys"]):
            key, blob = key_of(i), blob_of(i)
            row = per_node.setdefault(owners[key_slot(redis_key(key))],
                                      {"ok": 0, "failed": 0, "wrong": 0, "max_s": 0.0})
            started = time.monotonic()
            if request["op"] == "put":
                outcome = "ok" if tier.put(key, blob) else "failed"
            else:
                got = tier.get(key)
                outcome = "failed" if got is None else "ok" if bytes(got) == blob else "wrong"
            row[outcome] += 1
            row["max_s"] = max(row["max_s"], time.monotonic() - started)
        print(json.dumps({"nodes": per_node, "breaker_opened": tier.counters.snapshot().get("breaker.opened", 0),
                          "ended": time.monotonic()}), flush=True)
    tier.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = parser.add_subparsers(dest="verb", required=True)
    c = sub.add_parser("client")
    c.add_argument("addresses", nargs="+")
    c.add_argument("--timeout", type=float, default=0.5, help="the redis tier's timeout_s")
    c.add_argument("--breaker-failures", type=int, default=3, help="the redis tier's breaker_failures")
    c.add_argument("--no-create", action="store_true", help="the cluster exists already")
    args = parser.parse_args(argv)
    client(args.addresses, args.timeout, not args.no_create, args.breaker_failures)


if __name__ == "__main__":
    main()
