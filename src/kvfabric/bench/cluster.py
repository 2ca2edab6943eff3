"""`kvfabric bench p2p`: peer-to-peer chunk transfer beside a raw loopback socket moving the same bytes, and a
controller `move` of a 4k-token prompt's chunks.

- fetch: PeerClient.fetch of N chunks served by a PeerServer from a cpu tier (SmolLM2-135M layout: 30 x 3 x 64
  fp16, 256 tokens = 5.9 MB a chunk), framed, authenticated, each chunk received into its own new buffer.
  Baseline, run alternately in the same process: a bare TCP server that `sendall`s the same blobs back to back,
  and a client that `recv_into`s each into its own new buffer (the same allocator, p2p.new_buffer; nothing else).
  `ratio` = P2P throughput / raw throughput (target >= 0.7). A second row also times a raw client that reuses one
  buffer (no allocation at all), the strictest reference.
- fetch (disk tier): the same chunks served from a disk tier (sendfile, page cache warm).
- fetch+verify: the same through a PeerTier inside a TierStack (controller lookup, prefetch stream, both
  checksums and the key checked per chunk, promotion into the local cpu tier): the real miss path.
- move: POST /v1/move of a 4096-token prompt's chunks from instance A's cpu tier to instance B's cpu or disk
  tier (controller, two nodes, all on loopback); time, bytes and GB/s, beside the raw socket time of the bytes.
- with `--tls`: the same fetches (cpu tier, and disk tier: TLS has no sendfile) over TLS (a throw-away
  self-signed certificate, kvfabric.net.tls), paired with the plain P2P fetch of the same chunks in the same run: rows
  with `tls: true` carry `ratio_vs_plain` (TLS throughput / plain P2P throughput; target >= 0.8).
"""
from __future__ import annotations

import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvfabric.bench.common import emit, paired, threads_note, timed
from kvfabric.bench.vllm_server import free_port
from kvfabric.cache.builder import build_engine
from kvfabric.cache.engine import CacheEngine
from kvfabric.cluster.p2p_client import PeerClient, new_buffer
from kvfabric.cluster.p2p_server import PeerServer
from kvfabric.codec.raw import RawCodec
from kvfabric.config import ClusterConfig, Config, CpuTierConfig, DiskTierConfig
from kvfabric.kv.layout import KVLayout
from kvfabric.tiers.cpu import CpuTier
from kvfabric.tiers.disk import DiskTier

LAYOUT = KVLayout(30, 3, 64, "float16")  # SmolLM2-135M
CHUNK = 256
TOKEN = "bench-token"


def make_chunks(num_chunks: int) -> tuple[list[bytes], list[bytes]]:
    codec = RawCodec()
    keys = [i.to_bytes(4, "little") * 8 for i in range(num_chunks)]
    gen = torch.Generator().manual_seed(0)
    blobs = [bytes(codec.encode(torch.randn(LAYOUT.shape(CHUNK), generator=gen).half(), k, LAYOUT)) for k in keys]
    return keys, blobs


class RawServer:
    """The baseline: one request byte in, the blobs out with sendall, back to back (no framing, no auth)."""

    def __init__(self, blobs: list[bytes], host: str = "127.0.0.1") -> None:
        self.blobs = blobs
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while conn.recv(1):
                for blob in self.blobs:
                    conn.sendall(blob)

    def close(self) -> None:
        self.sock.close()


class RawClient:
    def __init__(self, port: int, sizes: list[int], host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sizes = sizes
        self.reused = bytearray(max(sizes))

    def fetch(self, fresh: bool = True) -> list[memoryview | bytearray]:
        self.sock.sendall(b"g")
        out = []
        for size in self.sizes:
            buf = new_buffer(size) if fresh else self.reused
            view, pos = memoryview(buf)[:size], 0
            while pos < size:
                n = self.sock.recv_into(view[pos:])
                if n == 0:
                    raise ConnectionError("raw server closed")
                pos += n
            out.append(buf)
        return out

    def close(self) -> None:
        self.sock.close()


def _row(op: str, num_bytes: int, seconds: float, base_seconds: float, baseline: str, **extra: object) -> dict:
    gbps, base = num_bytes / seconds / 1e9, num_bytes / base_seconds / 1e9
    return {"op": op, "mb": round(num_bytes / 1e6, 1), "gbps": round(gbps, 3), "baseline_gbps": round(base, 3),
            "ratio": round(gbps / base, 3), "target": 0.7 if op == "fetch" else None, "baseline": baseline, **extra}


def _served(num_chunks: int, folder: Path) -> tuple[list[bytes], list[bytes], CpuTier, DiskTier]:
    """num_chunks chunks (keys, blobs), each stored in a cpu tier and in a disk tier under folder."""
    keys, blobs = make_chunks(num_chunks)
    num_bytes = sum(map(len, blobs))
    cpu, disk = CpuTier(num_bytes * 2), DiskTier(folder, num_bytes * 2)
    for key, blob in zip(keys, blobs):
        cpu.put(key, blob)
        disk.put(key, blob)
    return keys, blobs, cpu, disk


def bench_fetch(num_chunks: int, repeats: int, root: Path) -> list[dict]:
    keys, blobs, cpu, disk = _served(num_chunks, root / "served")
    num_bytes = sum(map(len, blobs))
    server = PeerServer([cpu], token=TOKEN).start()
    disk_server = PeerServer([disk], token=TOKEN).start()
    client = PeerClient(server.host, server.port, TOKEN)
    disk_client = PeerClient(disk_server.host, disk_server.port, TOKEN)
    raw_server = RawServer(blobs)
    raw = RawClient(raw_server.port, [len(b) for b in blobs])
    try:
        for c in (client, disk_client):
            got = c.fetch_all(keys)
            assert all(got[k] == b for k, b in zip(keys, blobs)), "P2P returned different bytes"
        assert [bytes(b) for b in raw.fetch()] == blobs
        p2p_s, raw_s = paired(lambda: client.fetch_all(keys), raw.fetch, repeats)
        _, reuse_s = paired(lambda: client.fetch_all(keys), lambda: raw.fetch(fresh=False), repeats)
        disk_s, raw_disk_s = paired(lambda: disk_client.fetch_all(keys), raw.fetch, repeats)
        assert disk_server.counters["sendfile"] > 0
    finally:
        raw.close()
        raw_server.close()
        client.close()
        disk_client.close()
        server.close()
        disk_server.close()
    return [_row("fetch", num_bytes, p2p_s, raw_s, "raw socket, a new buffer per chunk", chunks=num_chunks),
            _row("fetch", num_bytes, p2p_s, reuse_s, "raw socket, one reused buffer", chunks=num_chunks),
            _row("fetch (disk tier)", num_bytes, disk_s, raw_disk_s, "raw socket from memory, a new buffer per "
                 "chunk", chunks=num_chunks, path="served with sendfile from the page cache")]


def bench_fetch_tls(num_chunks: int, repeats: int, root: Path) -> list[dict]:
    """P2P fetch over TLS vs plain P2P, cpu and disk tiers, alternated in the same run."""
    from kvfabric.net.tls import client_context, self_signed, server_context

    files = self_signed(root)
    keys, blobs, cpu, disk = _served(num_chunks, root / "served-tls")
    num_bytes = sum(map(len, blobs))
    rows = []
    for name, tier in (("fetch", cpu), ("fetch (disk tier)", disk)):
        plain_server = PeerServer([tier], token=TOKEN).start()
        tls_server = PeerServer([tier], token=TOKEN, tls=server_context(files)).start()
        plain = PeerClient(plain_server.host, plain_server.port, TOKEN)
        secure = PeerClient(tls_server.host, tls_server.port, TOKEN, tls=client_context(files))
        try:
            got = secure.fetch_all(keys)
            assert all(got[k] == b for k, b in zip(keys, blobs)), "P2P over TLS returned different bytes"
            tls_s, plain_s = paired(lambda: secure.fetch_all(keys), lambda: plain.fetch_all(keys), repeats)
        finally:
            for c in (plain, secure):
                c.close()
            plain_server.close()
            tls_server.close()
        row = _row(name, num_bytes, tls_s, plain_s, "plain P2P fetch of the same chunks", chunks=num_chunks,
                   tls=True)
        row["ratio_vs_plain"], row["target"] = row["ratio"], 0.8
        rows.append(row)
    return rows


def start_controller(host: str = "127.0.0.1") -> tuple[Any, threading.Thread, str]:
    """A controller (in-memory index, token TOKEN) on a free port of `host` (loopback by default), served by a
    thread of this process: (uvicorn server, its thread, url). Stop it with `server.should_exit = True;
    thread.join()`."""
    import uvicorn

    from kvfabric.cluster.controller_app import create_app
    from kvfabric.cluster.index_memory import MemoryIndex

    port = free_port()
    app = create_app(MemoryIndex(), token=TOKEN, control_timeout_s=120.0)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the controller did not start")
        time.sleep(0.01)
    return server, thread, f"http://{host}:{port}"


def bench_cluster(num_tokens: int, repeats: int, root: Path) -> list[dict]:
    """fetch+verify through a PeerTier, and controller moves of one prompt's chunks."""
    from kvfabric.cluster.client import ControllerClient
    from kvfabric.cluster.worker import ClusterNode

    server, thread, url = start_controller()
    engines: list[CacheEngine] = []

    def instance(name: str, tiers: tuple[str, ...], capacity: int) -> tuple[ClusterNode, CacheEngine]:
        cluster = ClusterConfig(controller_url=url, token=TOKEN, instance_id=name, report_interval_s=0.05,
                                fetch_timeout_s=30.0, lookup_timeout_s=5.0)
        config = Config(chunk_size=CHUNK, tiers=(*tiers, "peer"), cpu=CpuTierConfig(capacity=capacity),
                        disk=DiskTierConfig(path=str(root / f"{name}-disk"), capacity=capacity), cluster=cluster)
        engine = build_engine(config, LAYOUT, "bench")
        engines.append(engine)
        assert engine.node is not None
        return engine.node, engine

    rows: list[dict] = []
    api = ControllerClient(url, TOKEN, timeout_s=120.0)
    try:
        tokens = list(range(num_tokens))
        kv = torch.randn(LAYOUT.shape(num_tokens), generator=torch.Generator().manual_seed(1)).half()
        node_a, a = instance("a", ("cpu",), kv.numel() * 4)
        node_b, b = instance("b", ("cpu", "disk"), kv.numel() * 4)
        a.store(tokens, kv)
        num_bytes = sum(len(node_a.served["cpu"].get(k)) for k in a.keys(tokens))
        assert node_a.flush_reports() and node_b.flush_reports()
        raw_server = RawServer([node_a.served["cpu"].get(k) for k in a.keys(tokens)])
        raw = RawClient(raw_server.port, [len(node_a.served["cpu"].get(k)) for k in a.keys(tokens)])

        # the miss path: B's tiers are cpu, disk, peer; each round starts with its cpu and disk empty
        out = torch.empty_like(kv)

        def reset_b() -> None:
            b.flush()
            node_b.served["cpu"].inner.clear()
            node_b.served["disk"].inner.clear()
            node_b.peer.clear()

        def retrieve() -> None:
            assert b.retrieve(tokens, out=out).shape[3] == num_tokens

        verify_s, raw_s = paired(retrieve, raw.fetch, repeats, setup_ours=reset_b)
        assert torch.equal(out, kv)
        rows.append(_row("fetch+verify", num_bytes, verify_s, raw_s, "raw socket, a new buffer per chunk",
                         chunks=len(a.keys(tokens)), path="CacheEngine.retrieve via PeerTier (lookup, stream, "
                                                           "checksums, promotion)"))

        for dst_tier in ("cpu", "disk"):
            times, moved = [], 0
            for _ in range(repeats):
                reset_b()
                started = time.perf_counter()
                reply = api.move(src="a", dst="b", dst_tier=dst_tier, tokens=tokens)
                times.append(time.perf_counter() - started)
                moved = reply["bytes"]
                assert reply["chunks"] == len(a.keys(tokens)), reply
            raw_times = [timed(raw.fetch, 1) for _ in range(repeats)]
            seconds, base = statistics.median(times), statistics.median(raw_times)
            rows.append({**_row(f"move a/cpu->b/{dst_tier}", moved, seconds, base, "raw socket, same bytes"),
                         "tokens": num_tokens, "chunks": len(a.keys(tokens)), "seconds": round(seconds, 4),
                         "bytes": moved})
        raw.close()
        raw_server.close()
    finally:
        api.close()
        for engine in engines:
            engine.close()
        server.should_exit = True
        thread.join(timeout=10)
    return rows


def run(as_json: bool = False, repeats: int = 5, quick: bool = False, num_chunks: int | None = None,
        move_tokens: int = 4096, tls: bool = False) -> list[dict]:
    chunks = num_chunks or (8 if quick else 16)
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-p2p-", dir=os.environ.get("KVFABRIC_BENCH_DIR")) as tmp:
        rows = [{**row, "tls": False} for row in bench_fetch(chunks, repeats, Path(tmp))]
        if tls:
            rows += bench_fetch_tls(chunks, repeats, Path(tmp))
        rows += bench_cluster(move_tokens if not quick else min(move_tokens, 2048), max(2, repeats // 2 + 1),
                              Path(tmp))
    emit(rows, as_json, f"kvfabric bench p2p ({threads_note()}, {time.strftime('%H:%M:%S')})",
         ["op", "tls", "mb", "gbps", "baseline_gbps", "ratio", "target", "seconds", "baseline"])
    return rows


if __name__ == "__main__":  # pragma: no cover
    import sys
    run(as_json="--json" in sys.argv, quick="--quick" in sys.argv)
