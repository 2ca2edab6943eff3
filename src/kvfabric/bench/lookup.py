"""`kvfabric bench lookup`: what a parallel engine's scheduler pays to ask whether a prompt's chunks can be loaded,
by lookup authority and tensor-parallel size (issue #53: "one lookup authority ... choose by measurement").

Each rank is a process of its own, as vLLM's workers are: its cache (a CacheEngine over process memory, or with
`mode: server` a RemoteCache to one `kvfabric server` process) holds its share of a stored prompt, and it answers
the scheduler's lookups on a Unix socket (kvfabric.connectors.lookup.LookupService). The scheduler is this process.
Authorities:
- `ranks`: every rank's cache, all asked before any answer is read (`EveryRank`: what the connector does);
- `ranks_serial`: the same, one rank after another (how EveryRank asked before it pipelined);
- `server_ranks`: every rank's cache is a RemoteCache to one server; asked as `ranks`;
- `server_direct`: the scheduler asks the server itself, share by share (one RemoteCache per share, no worker).
Baseline, measured in the same run: one round trip of a lookup-sized frame to a process that answers at once
(`rtt_s`). Each figure is the median of `samples` lookups, for a stored prompt (`hit`) and a new one (`miss`).
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import torch

from kvfabric.bench.common import emit
from kvfabric.bench.interference import start_server
from kvfabric.cache.builder import build_engine
from kvfabric.config import Config
from kvfabric.connectors.lookup import EveryRank, LookupClient, LookupService
from kvfabric.kv.hashing import KeySpace
from kvfabric.kv.layout import KVLayout
from kvfabric.kv.shares import rank_share

LAYOUT = KVLayout(4, 8, 16, "float16")  # 8 KV heads: up to TP=8 splits them; lookups read no KV, so it is small
CHUNK = 256
MODEL_ID = "bench-lookup"
AUTHORITIES = ("ranks", "ranks_serial", "server_ranks", "server_direct")
COLUMNS = ["tp", "case", "authority", "chunks", "lookup_us", "lookup_p99_us", "vs_rtt", "rtt_us"]


def _prompt(seed: int, num_tokens: int) -> list[int]:
    return torch.randint(0, 50_000, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def _config(socket_path: str | None) -> Config:
    data: dict = {"tiers": ["cpu"], "chunk_size": CHUNK, "cpu": {"capacity": "1GiB"}}
    if socket_path:
        data |= {"mode": "server", "server": {"socket": socket_path, "timeout_s": 5.0}}
    return Config.from_dict(data)


def rank_main(spec: dict) -> None:
    """A rank's process: its cache stores its share of the prompt, then answers lookups until stdin closes."""
    share = rank_share(LAYOUT, 0, 1, spec["rank"], spec["tp"])
    cache = build_engine(_config(spec["server"]), LAYOUT, MODEL_ID, share=share, parallel=(1, spec["tp"]))
    tokens = _prompt(spec["seed"], spec["tokens"])
    kv = torch.zeros(cache.layout.shape(len(tokens)), dtype=torch.float16)
    stored = cache.store(tokens, kv)
    cache.flush()
    service = LookupService(cache, spec["path"])
    print(json.dumps({"ready": True, "stored": stored}), flush=True)
    sys.stdin.read()  # the bench closes our stdin when it is done
    service.close()
    cache.close()


def echo_main(path: str) -> None:
    """The baseline's other end: answers each frame at once with a lookup-sized answer."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    print(json.dumps({"ready": True}), flush=True)
    conn, _ = listener.accept()
    answer = msgpack.packb({"num_chunks": 1, "num_in_memory": 1})
    with conn:
        while head := conn.recv(4, socket.MSG_WAITALL):
            conn.recv(int.from_bytes(head, "little"), socket.MSG_WAITALL)
            conn.sendall(len(answer).to_bytes(4, "little") + answer)


def _spawn(args: list[str], num_chunks: int = 0) -> subprocess.Popen:
    """A bench process, once it is ready (a rank: once it stored `num_chunks` chunks of its share)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvfabric.bench.lookup", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if '"ready"' not in line or json.loads(line).get("stored", num_chunks) != num_chunks:
        proc.kill()
        raise RuntimeError(f"a bench process did not start (or store {num_chunks} chunks): {line!r}")
    return proc


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.stdin:
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _times(fn, samples: int) -> list[float]:
    fn()  # the first call opens connections
    out = []
    for _ in range(samples):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def _rtt(folder: str, num_keys: int, samples: int) -> float:
    path = f"{folder}/echo.sock"
    proc = _spawn(["--echo", path])
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        body = msgpack.packb({"keys": [b"k" * 32] * num_keys, "num_tokens": num_keys * CHUNK})
        frame = len(body).to_bytes(4, "little") + body

        def ask() -> None:
            sock.sendall(frame)
            sock.recv(int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "little"), socket.MSG_WAITALL)

        got = statistics.median(_times(ask, 500))
        sock.close()
        return got
    finally:
        _stop([proc])


def _measure(tp: int, tokens: int, samples: int, folder: str, server: str | None) -> dict[str, dict]:
    """{"authority/case": {chunks, times}} for one tensor-parallel size, every rank's cache inproc or on `server`."""
    paths = [f"{folder}/r{rank}.sock" for rank in range(tp)]
    space = KeySpace.of(MODEL_ID, LAYOUT, CHUNK)
    # a prompt of this run's own: what another TP stored would count for this one's shares (and is not stored again)
    seed = 2 * tp + (server is not None)
    keys = {"hit": list(space.keys(_prompt(seed, tokens))), "miss": list(space.keys(_prompt(1000, tokens)))}
    found: dict[str, dict] = {}
    procs: list[subprocess.Popen] = []
    every = EveryRank([LookupClient(path) for path in paths])
    clients = every.clients
    direct = []
    try:
        for rank, path in enumerate(paths):
            spec = {"rank": rank, "tp": tp, "tokens": tokens, "path": path, "server": server, "seed": seed}
            procs.append(_spawn(["--rank", json.dumps(spec)], tokens // CHUNK))
        ways = {"ranks": lambda k: every.lookup(k, tokens).num_chunks,
                "ranks_serial": lambda k: min(c.lookup(k, tokens).num_chunks for c in clients)}
        if server:
            config = _config(server)
            direct = [build_engine(config, LAYOUT, MODEL_ID, share=rank_share(LAYOUT, 0, 1, r, tp), parallel=(1, tp))
                      for r in range(tp)]
            ways = {"server_ranks": ways["ranks"],
                    "server_direct": lambda k: min(c.lookup_keys(k, tokens).num_chunks for c in direct)}
        for name, way in ways.items():
            for case, asked in keys.items():
                chunks = way(asked)
                found[f"{name}/{case}"] = {"chunks": chunks, "times": _times(lambda: way(asked), samples)}
    finally:
        every.close()
        for cache in direct:
            cache.close()
        _stop(procs)
    return found


def run(tps: tuple[int, ...] = (1, 2, 4, 8), tokens: int = 8000, samples: int = 200,
        as_json: bool = False) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvf-lookup-") as folder:
        num_keys = tokens // CHUNK
        rtt = _rtt(folder, num_keys, samples)
        server_config = {"tiers": ["cpu"], "chunk_size": CHUNK, "cpu": {"capacity": "1GiB"},
                         "server": {"socket": f"{folder}/server.sock", "pool_capacity": "64MiB",
                                    "slot_bytes": "512KiB", "max_store_queue": 64}}
        server = start_server(server_config, Path(folder) / "server.yaml", None)
        try:
            for tp in tps:
                found = _measure(tp, tokens, samples, folder, None)
                found |= _measure(tp, tokens, samples, folder, server_config["server"]["socket"])
                for label, got in found.items():
                    authority, case = label.split("/")
                    times = sorted(got["times"])
                    median = statistics.median(times)
                    rows.append({"tp": tp, "tokens": tokens, "case": case, "authority": authority,
                                 "chunks": got["chunks"], "lookup_s": median,
                                 "lookup_p99_s": times[min(len(times) - 1, int(0.99 * len(times)))],
                                 "rtt_s": rtt, "vs_rtt": median / rtt, "samples": samples,
                                 "load_avg": os.getloadavg()[0]})
                    rows[-1] |= {f"{name[:-2]}_us": round(rows[-1][name] * 1e6, 1)
                                 for name in ("lookup_s", "lookup_p99_s", "rtt_s")}
        finally:
            server.terminate()
            server.wait(30)
    rows.sort(key=lambda r: (r["case"], r["tp"], AUTHORITIES.index(r["authority"])))
    emit(rows, as_json, f"scheduler lookups of a {tokens}-token prompt, by authority and TP "
         "(vs_rtt: / one raw Unix-socket round trip)", COLUMNS)
    return rows


if __name__ == "__main__":
    if sys.argv[1] == "--echo":
        echo_main(sys.argv[2])
    else:
        rank_main(json.loads(sys.argv[2]))
