"""The cluster end to end, as separate processes on loopback: a redis-server, a controller with the Redis index,
and two reference engines (the real SmolLM2-135M, short prompts, chunk_size 16).

- B finds A's chunks through the controller, fetches them peer-to-peer, and its output equals a full prefill;
- a restarted controller (same Redis index) still answers lookups;
- killing A in the middle of a transfer leaves B correct (it recomputes what did not arrive).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvfabric.cluster.client import ControllerClient, ControllerError
from tests.cluster_scripts.helpers import free_port, wait_for
from tests.redis_fixtures import HAVE_REDIS, RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAVE_REDIS, reason="redis-server is not installed")]

SCRIPTS = Path(__file__).parent / "cluster_scripts"
TOKEN = "e2e-cluster-token"
CHUNK = 16


def prompt_ids(seed: int, n: int = 100) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


class Proc:
    """A subprocess speaking JSON lines on stdin/stdout (stderr goes to a log file)."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.log = log
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"),
                                     text=True, env=env, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float = 120.0) -> dict:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no reply in {timeout_s} s; log:\n{self.tail()}") from None
        if line is None:
            raise RuntimeError(f"process exited with {self.proc.wait()}; log:\n{self.tail()}")
        return json.loads(line)

    def call(self, message: dict, timeout_s: float = 120.0) -> dict:
        self.send(message)
        return self.recv(timeout_s)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


class Cluster:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.token_file = workdir / "token"
        self.token_file.write_text(TOKEN)
        self.redis = RedisServer(workdir / "redis").start()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.controller: subprocess.Popen | None = None
        self.api = ControllerClient(self.url, TOKEN, timeout_s=5.0)
        self.engines: dict[str, Proc] = {}

    def start_controller(self) -> None:
        log = open(self.workdir / "controller.log", "ab")
        self.controller = subprocess.Popen(
            [sys.executable, "-m", "kvfabric.cluster.controller", "--port", str(self.port), "--index",
             self.redis.url, "--token-file", str(self.token_file), "--instance-ttl", "10"],
            stdout=log, stderr=log, env=self.env)

        def up() -> bool:
            if self.controller.poll() is not None:
                raise RuntimeError((self.workdir / "controller.log").read_text()[-2000:])
            try:
                return self.api.health()["status"] == "ok"
            except ControllerError:
                return False

        wait_for(up, 60, 0.1)

    def kill_controller(self) -> None:
        self.controller.send_signal(signal.SIGKILL)
        self.controller.wait(timeout=10)

    def start_engine(self, name: str) -> Proc:
        proc = Proc([sys.executable, str(SCRIPTS / "engine_node.py"), "--controller", self.url, "--token-file",
                     str(self.token_file), "--id", name, "--cache", str(self.workdir / f"cache-{name}"),
                     "--chunk", str(CHUNK)], self.workdir / f"{name}.log", self.env)
        self.engines[name] = proc
        return proc

    def close(self) -> None:
        for proc in self.engines.values():
            if proc.proc.poll() is None:
                try:
                    proc.call({"cmd": "exit"}, 20)
                    proc.proc.wait(timeout=20)
                except (RuntimeError, TimeoutError, OSError, subprocess.TimeoutExpired):
                    proc.kill()
        if self.controller is not None and self.controller.poll() is None:
            self.controller.terminate()
            self.controller.wait(timeout=10)
        self.api.close()
        self.redis.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start_controller()
        a, b = c.start_engine("a"), c.start_engine("b")  # both load the model at the same time
        assert a.recv(180)["ready"] and b.recv(180)["ready"]
        yield c
    finally:
        c.close()


def lookup_hits(cluster: Cluster, ids: list[int]) -> dict[str, dict]:
    return {h["instance_id"]: h for h in cluster.api.lookup(tokens=ids)["instances"]}


def test_b_fetches_a_chunks_and_equals_a_full_prefill(cluster):
    a, b = cluster.engines["a"], cluster.engines["b"]
    ids = prompt_ids(1)
    full = (len(ids) // CHUNK) * CHUNK
    first = a.call({"cmd": "generate", "ids": ids, "max_new": 4})
    assert first["hit_tokens"] == 0 and first["stored_chunks"] == len(ids) // CHUNK
    assert a.call({"cmd": "flush"})["ok"]
    hits = lookup_hits(cluster, ids)
    assert hits["a"]["prefix_tokens"] == full and hits["b"]["prefix_tokens"] == 0

    res = b.call({"cmd": "generate", "ids": ids, "max_new": 4})
    assert res["hit_tokens"] == full  # every whole chunk came from A
    assert res["peer"]["chunks_fetched"] == len(ids) // CHUNK
    assert res["counters"].get("corrupt.peer", 0) == 0 and res["counters"]["hit.peer"] == len(ids) // CHUNK
    assert res["max_diff"] < 1e-4 and res["max_diff_plain"] < 1e-4  # fp32 KV: same logits as a full prefill
    assert res["tokens"] == res["ref_tokens"] == first["tokens"]
    assert b.call({"cmd": "flush"})["ok"]  # B kept a copy, and says so
    assert lookup_hits(cluster, ids)["b"]["prefix_tokens"] == full


def test_restarted_controller_with_redis_index_still_answers(cluster):
    ids = prompt_ids(1)
    before = lookup_hits(cluster, ids)
    assert before["a"]["prefix_chunks"] > 0
    cluster.kill_controller()
    cluster.start_controller()  # same port, same Redis: nothing was lost
    after = lookup_hits(cluster, ids)
    assert {k: v["prefix_chunks"] for k, v in after.items()} == {k: v["prefix_chunks"] for k, v in before.items()}
    assert {i["instance_id"] for i in cluster.api.instances()} == {"a", "b"}


def test_killing_a_mid_transfer_leaves_b_correct(cluster, tmp_path):
    a, b = cluster.engines["a"], cluster.engines["b"]
    ids = prompt_ids(2)
    full = (len(ids) // CHUNK) * CHUNK
    assert a.call({"cmd": "generate", "ids": ids, "max_new": 4})["stored_chunks"] == len(ids) // CHUNK
    assert a.call({"cmd": "flush"})["ok"]
    assert lookup_hits(cluster, ids)["a"]["prefix_tokens"] == full
    marker = tmp_path / "stalled"
    assert a.call({"cmd": "stall", "after": 2, "marker": str(marker)})["ok"]

    b.send({"cmd": "generate", "ids": ids, "max_new": 4})
    wait_for(marker.exists, 120, 0.01)  # A has sent B two chunks and is stuck reading the third
    a.kill()
    res = b.recv(120)
    assert res["hit_tokens"] == 2 * CHUNK  # exactly what A sent before the kill (a closed socket delivers it)
    assert res["peer"]["fetch_errors"] >= 1
    assert res["max_diff"] < 1e-4 and res["max_diff_plain"] < 1e-4  # recomputed the rest: still exact
    assert res["tokens"] == res["ref_tokens"]
    assert res["stored_chunks"] == (full - res["hit_tokens"]) // CHUNK  # and stored what it computed
