"""Raw TCP over a test-bed link: what the link gives, measured with bare sockets (no iperf on this machine).

Run inside a host of a `HostBed` (kvfabric.bench.hosts):
- `python -m kvfabric.bench.hosts_probe serve ADDRESS`: listens on ADDRESS (a free port), writes one JSON line
  `{"port": N}`, then serves one connection at a time: request b"e" + 1 byte: that byte echoed; request b"s" + 8
  bytes (little endian) n: n bytes sent back with sendall. It runs until killed.
- `python -m kvfabric.bench.hosts_probe measure ADDRESS PORT --bytes N --pings K`: connects, times K one-byte
  round trips (median) and one transfer of N bytes received with recv_into into one reused buffer; writes one JSON
  line `{"rtt_ms", "mbit", "seconds", "bytes"}`; a failure (unreachable, `--timeout` s of silence) writes
  `{"error": "..."}` instead and exits 1.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

BLOCK = 1 << 20


def serve(address: str) -> None:
    sock = socket.socket()
    sock.bind((address, 0))
    sock.listen(4)
    print(json.dumps({"port": sock.getsockname()[1]}), flush=True)
    payload = memoryview(bytes(BLOCK))
    while True:
        conn, _ = sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while request := conn.recv(1):
                if request == b"e":
                    conn.sendall(conn.recv(1))
                    continue
                left = int.from_bytes(_exact(conn, 8), "little")
                while left:
                    n = min(left, BLOCK)
                    conn.sendall(payload[:n])
                    left -= n


def _exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            raise ConnectionError("closed mid-request")
        data += got
    return data


def measure(address: str, port: int, num_bytes: int, num_pings: int, timeout_s: float = 30.0) -> dict:
    with socket.create_connection((address, port), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(num_pings):
            start = time.perf_counter()
            conn.sendall(b"ex")
            if _exact(conn, 1) != b"x":
                raise ConnectionError("echo mismatch")
            rtts.append(time.perf_counter() - start)
        buf = memoryview(bytearray(BLOCK))
        start = time.perf_counter()
        conn.sendall(b"s" + num_bytes.to_bytes(8, "little"))
        left = num_bytes
        while left:
            n = conn.recv_into(buf[:min(left, BLOCK)])
            if not n:
                raise ConnectionError("closed mid-transfer")
            left -= n
        seconds = time.perf_counter() - start
    return {"rtt_ms": round(statistics.median(rtts) * 1e3, 4) if rtts else None, "bytes": num_bytes,
            "seconds": round(seconds, 4), "mbit": round(num_bytes * 8 / seconds / 1e6, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvfabric.bench.hosts_probe")
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("serve").add_argument("address")
    m = sub.add_parser("measure")
    m.add_argument("address")
    m.add_argument("port", type=int)
    m.add_argument("--bytes", type=int, default=10 << 20)
    m.add_argument("--pings", type=int, default=20)
    m.add_argument("--timeout", type=float, default=30.0, help="seconds of silence before giving up")
    args = parser.parse_args(argv)
    if args.verb == "serve":
        serve(args.address)
    else:
        try:
            print(json.dumps(measure(args.address, args.port, args.bytes, args.pings, args.timeout)), flush=True)
        except OSError as exc:
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main()
