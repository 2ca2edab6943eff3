"""`kvfabric bench tiers --mooncake`: the mooncake tier beside raw Mooncake and a raw loopback socket, same bytes.

Set-up (all on loopback, MC_TCP_BIND_ADDRESS=127.0.0.1, each client named 127.0.0.1:<free port>): a private
`mooncake_master`, and one storage process that lends the only memory segment, so every byte read or written by
the clients here crosses Mooncake's transfer engine (TCP) to that process. The tier and the raw client mount
no segment of their own.
- store: tier.put vs the raw client's `upsert_from` of the same bytes from the same memory, same master (a raw
  `put` of a key that exists is a no-op, so it cannot be timed in a loop); and vs sendall of the bytes on a
  loopback socket to a reader thread;
- retrieve: tier.get_into a reused scratch vs the raw client's `get_into` a registered buffer; and vs recv_into
  a reused buffer from a loopback socket (kvfabric.bench.cluster's raw server).
Sizes are one chunk of each benchmark layout (tiers_shared.SIZES). Medians of `repeats`, ours and the baseline
alternated. `gbps` is GB/s; the target is ratio >= 0.9 against raw Mooncake.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from kvfabric.bench.tiers_shared import SIZES, _payload, _row
from kvfabric.bench.vllm_server import free_port, free_ports

SEGMENT_BYTES = 1 << 30
TARGET = 0.9


def master_binary() -> Path:
    """The `mooncake_master` the pip package installs next to this Python (or the one on PATH)."""
    return Path(shutil.which("mooncake_master") or Path(sys.executable).parent / "mooncake_master")


class LoopbackMaster:
    """A `mooncake_master` with its HTTP metadata server on free loopback ports, which survive a restart
    (`stop` kills it: a crash, everything it knew is gone; `start` brings up a fresh one). Also the tests' master."""

    def __init__(self, workdir: Path) -> None:
        self.binary = str(master_binary())
        self.workdir = workdir
        self.rpc_port, self.metadata_port, self.metrics_port = free_ports(3)
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def start(self) -> LoopbackMaster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}", "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}", "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
                "--rpc_thread_num=2", "--enable_metric_reporting=false"]
        with open(self.workdir / "master.log", "ab") as log:
            self.proc = subprocess.Popen(args, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:  # ready once the admin server answers: it starts after the RPC and metadata servers
            try:
                with urllib.request.urlopen(self.metrics_url + "/health", timeout=0.5) as response:
                    if b'"ok"' in response.read():
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start; see {self.workdir / 'master.log'}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


def _storage(master: str, metadata_url: str, conn) -> None:
    """The storage process: mount one segment into the store, say so, hold it until told to stop."""
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    conn.send(store.setup(f"127.0.0.1:{free_port()}", metadata_url, SEGMENT_BYTES, 16 << 20, "tcp", "", master))
    conn.recv()
    store.close()


class _Sink:
    """The socket baseline of a store: a thread reading whole blobs into a reused buffer, acknowledging each."""

    def __init__(self, size: int) -> None:
        server = socket.create_server(("127.0.0.1", 0))
        self.sock = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        server.close()
        threading.Thread(target=self._run, args=(peer, size), daemon=True).start()

    @staticmethod
    def _run(peer: socket.socket, size: int) -> None:
        view = memoryview(bytearray(size))
        with peer:
            while True:
                pos = 0
                while pos < size:
                    n = peer.recv_into(view[pos:])
                    if n == 0:
                        return
                    pos += n
                peer.sendall(b"k")

    def send(self, blob: bytes) -> None:
        self.sock.sendall(blob)
        self.sock.recv(1)

    def close(self) -> None:
        self.sock.close()


def bench_mooncake(repeats: int = 3, sizes: dict[str, int] | None = None) -> list[dict]:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # the network rule: every client advertises loopback
    from mooncake.store import MooncakeDistributedStore

    from kvfabric.tiers.mooncake import MooncakeTier

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-mooncake-") as tmp:
        master = LoopbackMaster(Path(tmp)).start()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        storage = ctx.Process(target=_storage, args=(master.address, master.metadata_url, child), daemon=True)
        storage.start()
        raw = MooncakeDistributedStore()
        tier = None
        try:
            if not parent.poll(60) or parent.recv() != 0:
                raise RuntimeError("the Mooncake storage process did not mount its segment")
            if raw.setup(f"127.0.0.1:{free_port()}", master.metadata_url, 0, 16 << 20, "tcp", "", master.address):
                raise RuntimeError("raw Mooncake client set-up failed")
            tier = MooncakeTier(master.address, master.metadata_url, segment_bytes=0, buffer_bytes=16 << 20,
                                timeout_s=30.0)
            for name, size in (sizes or SIZES).items():
                rows += _bench_size(tier, raw, name, size, repeats)
        finally:
            if tier is not None:
                tier.close()
            raw.close()
            parent.send("stop")
            storage.join(30)
            master.stop()
    return rows


def _medians(fns: list, repeats: int) -> list[float]:
    """Median time of each function, run in turn `repeats` times, the starting one rotating."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeats):
        for j in range(len(fns)):
            which = (i + j) % len(fns)
            start = time.perf_counter()
            fns[which]()
            times[which].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _bench_size(tier, raw, name: str, size: int, repeats: int) -> list[dict]:
    from kvfabric.bench.cluster import RawClient, RawServer
    from kvfabric.host.pages import Scratch

    blob = _payload(size, seed=size)
    data = np.frombuffer(blob, dtype=np.uint8)
    key = hashlib.sha256(b"kvfabric-bench-mooncake" + size.to_bytes(8, "little")).digest()
    raw_key = "kvfbench:raw:" + key.hex()
    dst = np.empty(size, dtype=np.uint8)
    raw.register_buffer(dst.ctypes.data, size)
    scratch = Scratch()
    got: list[object] = [None]

    def put() -> None:
        if not tier.put(key, blob):
            raise RuntimeError(f"mooncake tier put failed: {tier.counters}")

    def raw_put() -> None:
        if raw.upsert_from(raw_key, data.ctypes.data, size) != 0:
            raise RuntimeError("raw Mooncake upsert_from failed")

    def get() -> None:
        got[0] = tier.get_into(key, scratch)

    def raw_get() -> None:
        if raw.get_into(raw_key, dst.ctypes.data, size) != size:
            raise RuntimeError("raw Mooncake get_into failed")

    sink, server = _Sink(size), RawServer([blob])
    client = RawClient(server.port, [size])

    def send() -> None:
        sink.send(blob)

    def fetch() -> None:
        client.fetch(fresh=False)

    try:
        for fn in (put, raw_put, get, raw_get, send, fetch):
            fn()  # warm up: connections, registrations, the storage side's pages
        store_s, raw_store_s, sock_store_s = _medians([put, raw_put, send], repeats)
        get_s, raw_get_s, sock_get_s = _medians([get, raw_get, fetch], repeats)
    finally:
        sink.close(), client.close(), server.close()
    if got[0] is None or bytes(got[0]) != blob or dst.tobytes() != blob:
        raise RuntimeError("mooncake returned different bytes")
    raw.unregister_buffer(dst.ctypes.data)
    tier.delete(key), raw.remove(raw_key, True)
    raw_base = "raw MooncakeDistributedStore {}, same bytes, same master"
    return [{**_row("mooncake", "store", name, size, store_s, raw_store_s, raw_base.format("upsert_from")),
             "target": TARGET},
            {**_row("mooncake", "retrieve", name, size, get_s, raw_get_s,
                    raw_base.format("get_into a registered buffer")), "target": TARGET},
            _row("mooncake", "store", name, size, store_s, sock_store_s, "raw loopback socket sendall, same bytes"),
            _row("mooncake", "retrieve", name, size, get_s, sock_get_s, "raw loopback socket recv_into a reused buffer")]
