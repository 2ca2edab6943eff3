"""Real redis-server processes for tests: a single server (stop / restart on the same port) and a 3-node cluster.

Import the fixtures into a test module (`from tests.redis_fixtures import redis_server, redis_url`) to use them.
Tests using them are skipped when redis-server is not installed.
"""
from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
HAVE_REDIS = Path(REDIS_SERVER).exists()
needs_redis = pytest.mark.skipif(not HAVE_REDIS, reason="redis-server is not installed")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A free TCP port; with cluster_bus also port + 10000 (Redis Cluster's bus), so the port is below 55536."""
    if not cluster_bus:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 55000)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_ping(port: int, timeout_s: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.2, socket_connect_timeout=0.2)
    try:
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                pass
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {port} did not answer PING in {timeout_s} s")
            time.sleep(0.02)
    finally:
        client.close()


class RedisServer:
    """One redis-server process in its own directory; `stop()` / `start()` keep the port (a restart)."""

    def __init__(self, workdir: Path, *extra_args: str, port: int | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(cluster_bus="--cluster-enabled" in extra_args)
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log"), *self.extra_args]
        for attempt in range(50):  # right after a kill the port can be briefly unavailable
            self.proc = subprocess.Popen(args, cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_ping(self.port, proc=self.proc)
                return self
            except RuntimeError:
                time.sleep(0.05)
        raise RuntimeError(f"could not start redis-server on port {self.port}; see {self.workdir / 'redis.log'}")

    def stop(self) -> None:
        """Kill the server at once (SIGKILL: a crash, no goodbye to clients)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator:
    """make(*extra_args) -> a started RedisServer, e.g. make("--maxmemory", "20mb")."""
    servers: list[RedisServer] = []

    def make(*extra_args: str) -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(servers)}", *extra_args).start()
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.stop()


class RedisClusterProcs:
    """Three masters, no replicas, slots spread by `redis-cli --cluster create`."""

    def __init__(self, workdir: Path, num_nodes: int = 3) -> None:
        self.nodes = [RedisServer(workdir / f"node{i}", "--cluster-enabled", "yes",
                                  "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
                      for i in range(num_nodes)]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterProcs:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        deadline = time.monotonic() + 15
        for node in self.nodes:
            client = node.client()
            while client.cluster("info").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise TimeoutError("cluster did not reach cluster_state:ok")
                time.sleep(0.05)
            client.close()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    cluster = RedisClusterProcs(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def make_blob(key: bytes, payload_bytes: int, seed: int = 0) -> bytearray:
    """A valid chunk blob (codec.format) for `key` with a deterministic pseudo-random payload."""
    import numpy as np

    from kvfabric.codec.format import HEADER_BYTES, ChunkHeader, write_blob

    blob = bytearray(HEADER_BYTES + payload_bytes)
    rng = np.random.default_rng(seed)
    blob[HEADER_BYTES:] = rng.integers(0, 256, payload_bytes, dtype=np.uint8).tobytes()
    header = ChunkHeader(0, 0, 0, b"\0" * 8, (1, 2, 1, 16, 8), key, payload_bytes)
    write_blob(header, blob)
    return blob
