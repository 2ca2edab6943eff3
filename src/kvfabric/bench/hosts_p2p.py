"""`kvfabric bench p2p --hosts`: P2P chunk fetch between two emulated hosts (kvfabric.bench.hosts) beside raw TCP
moving the same bytes over the same shaped link, in the same run.

- `serve` (a process in host A): a PeerServer on A's address (token; no TLS: the bed's links are private, so the
  server runs `insecure` and its warning is not logged) serving N chunks of the SmolLM2-135M layout
  (`bench.cluster.make_chunks`, 5.9 MB each) from a cpu tier, and a `RawServer` that `sendall`s the same blobs.
  Writes `{"port", "raw_port"}`, then serves until its stdin closes.
- `fetch` (a process in host B): a PeerClient and a `RawClient` (a new buffer per chunk, the same allocator).
  Writes `{"ready": true}`; then, for each line read from stdin, checks both return the stored bytes and times
  `PeerClient.fetch_all` of the N chunks against the raw fetch, alternated (`bench.common.paired`), and writes
  `{"p2p_s", "raw_s", "bytes", "is_equal"}` (median seconds).
- `fetch-checked` (a process in host B, for the fault tests): a PeerClient with the deadlines a peer tier uses
  (`--fetch-timeout`, `--connect-timeout`: ClusterConfig's). For each line read from stdin, one fetch of the N
  chunks: writes `{"event": "first"}` once the first answer is in, then `{"received", "is_correct", "error",
  "started", "ended", "max_wait_s"}`: the chunks that arrived (the rest are misses), whether each is an intact
  chunk under its key and equal to the stored bytes, the PeerError if the fetch failed, time.monotonic() at its
  start and end, and the longest wait for one answer (or for the error) from the previous one or the start.
- `run` (the benchmark, in the root namespace): a bed of two hosts; for each rate both links are reshaped
  (`LinkShape(rate, delay)`; the delay only where the kernel has sch_netem, said on stderr otherwise) and the fetch
  process measures once. Rows: `rate_mbit`, `delay_ms` (as shaped), `mb`, `gbps`, `baseline_gbps`, `ratio`
  (target >= 0.9), `chunks`, `repeats`.
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time

from kvfabric.bench.cluster import TOKEN, RawClient, RawServer, make_chunks
from kvfabric.bench.common import emit, paired, threads_note
from kvfabric.bench.hosts import HostBed, LinkShape, read_line
from kvfabric.config import ClusterConfig

MODULE = "kvfabric.bench.hosts_p2p"
TARGET = 0.9


def serve(address: str, num_chunks: int) -> None:
    from kvfabric.cluster.p2p_server import PeerServer
    from kvfabric.tiers.cpu import CpuTier

    logging.getLogger("kvfabric").setLevel(logging.ERROR)  # the insecure bind's warning: a private bed link
    keys, blobs = make_chunks(num_chunks)
    tier = CpuTier(sum(map(len, blobs)) * 2)
    for key, blob in zip(keys, blobs):
        tier.put(key, blob)
    server = PeerServer([tier], token=TOKEN, host=address, insecure=True).start()
    raw = RawServer(blobs, host=address)
    print(json.dumps({"port": server.port, "raw_port": raw.port}), flush=True)
    sys.stdin.read()
    raw.close()
    server.close()


def fetch(address: str, port: int, raw_port: int, num_chunks: int, repeats: int) -> None:
    from kvfabric.cluster.p2p_client import PeerClient

    keys, blobs = make_chunks(num_chunks)
    client = PeerClient(address, port, TOKEN, connect_timeout_s=5.0, io_timeout_s=30.0)
    raw = RawClient(raw_port, [len(b) for b in blobs], host=address)
    print(json.dumps({"ready": True}), flush=True)
    while sys.stdin.readline():
        got = client.fetch_all(keys)
        is_equal = all(got[k] == b for k, b in zip(keys, blobs)) and [bytes(b) for b in raw.fetch()] == blobs
        p2p_s, raw_s = paired(lambda: client.fetch_all(keys), raw.fetch, repeats)
        print(json.dumps({"p2p_s": p2p_s, "raw_s": raw_s, "bytes": sum(map(len, blobs)), "is_equal": is_equal}),
              flush=True)
    raw.close()
    client.close()


def fetch_checked(address: str, port: int, num_chunks: int, fetch_timeout_s: float, connect_timeout_s: float,
                  ) -> None:
    from kvfabric.cluster.p2p_client import PeerClient, PeerError
    from kvfabric.codec.format import ChunkFormatError, parse

    keys, blobs = make_chunks(num_chunks)
    stored = dict(zip(keys, blobs))
    client = PeerClient(address, port, TOKEN, connect_timeout_s=connect_timeout_s, io_timeout_s=fetch_timeout_s)
    print(json.dumps({"ready": True}), flush=True)
    while sys.stdin.readline():
        received, answers, is_correct, error = 0, 0, True, None
        started = last = time.monotonic()
        max_wait = 0.0
        try:
            for key, blob in client.fetch(keys):
                max_wait, last = max(max_wait, time.monotonic() - last), time.monotonic()
                answers += 1
                if answers == 1:
                    print(json.dumps({"event": "first"}), flush=True)
                if blob is None:  # the peer lacks it: a miss
                    continue
                received += 1
                try:
                    is_correct &= parse(blob, key) is not None and blob == stored[key]
                except ChunkFormatError:
                    is_correct = False
        except PeerError as exc:
            error = str(exc)
        ended = time.monotonic()
        print(json.dumps({"received": received, "is_correct": is_correct, "error": error, "started": started,
                          "ended": ended, "max_wait_s": max(max_wait, ended - last)}), flush=True)
    client.close()


def run(as_json: bool = False, repeats: int = 5, quick: bool = False, num_chunks: int | None = None,
        rates: tuple[float, ...] = (1000.0, 10000.0), delay_ms: float = 0.25) -> list[dict]:
    chunks = num_chunks or (4 if quick else 16)
    rows = []
    with HostBed(2) as bed:
        delay = delay_ms if bed.is_netem else 0.0
        if delay != delay_ms:
            print(f"note: this kernel has no sch_netem: links shaped by rate only (delay {delay_ms} ms not "
                  "applied)", file=sys.stderr)
        server = bed.python(0, MODULE, "serve", bed.address(0), "--chunks", str(chunks), stdin=subprocess.PIPE)
        ports = json.loads(read_line(server, 300))
        client = bed.python(1, MODULE, "fetch", bed.address(0), str(ports["port"]), str(ports["raw_port"]),
                            "--chunks", str(chunks), "--repeats", str(repeats), stdin=subprocess.PIPE)
        read_line(client, 300)
        assert client.stdin is not None
        for rate in rates:
            for host in (0, 1):
                bed.reshape(host, LinkShape(rate, delay))
            client.stdin.write(b"go\n")
            client.stdin.flush()
            got = json.loads(read_line(client, 600))
            if not got["is_equal"]:
                raise RuntimeError(f"P2P across hosts at {rate} Mbit returned different bytes")
            gbps, base = got["bytes"] / got["p2p_s"] / 1e9, got["bytes"] / got["raw_s"] / 1e9
            rows.append({"op": "fetch across hosts", "rate_mbit": rate, "delay_ms": delay,
                         "mb": round(got["bytes"] / 1e6, 1), "gbps": round(gbps, 3), "baseline_gbps": round(base, 3),
                         "ratio": round(gbps / base, 3), "target": TARGET, "chunks": chunks, "repeats": repeats,
                         "baseline": "raw TCP, same link, same bytes, a new buffer per chunk"})
    emit(rows, as_json, f"kvfabric bench p2p --hosts ({threads_note()}, {time.strftime('%H:%M:%S')})",
         ["op", "rate_mbit", "delay_ms", "mb", "gbps", "baseline_gbps", "ratio", "target"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = parser.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("serve")
    s.add_argument("address")
    s.add_argument("--chunks", type=int, default=16)
    f = sub.add_parser("fetch")
    f.add_argument("address")
    f.add_argument("port", type=int)
    f.add_argument("raw_port", type=int)
    f.add_argument("--chunks", type=int, default=16)
    f.add_argument("--repeats", type=int, default=5)
    c = sub.add_parser("fetch-checked")
    c.add_argument("address")
    c.add_argument("port", type=int)
    c.add_argument("--chunks", type=int, default=16)
    c.add_argument("--fetch-timeout", type=float, default=ClusterConfig().fetch_timeout_s)
    c.add_argument("--connect-timeout", type=float, default=ClusterConfig().connect_timeout_s)
    args = parser.parse_args(argv)
    if args.verb == "serve":
        serve(args.address, args.chunks)
    elif args.verb == "fetch-checked":
        fetch_checked(args.address, args.port, args.chunks, args.fetch_timeout, args.connect_timeout)
    else:
        fetch(args.address, args.port, args.raw_port, args.chunks, args.repeats)


if __name__ == "__main__":
    main()
