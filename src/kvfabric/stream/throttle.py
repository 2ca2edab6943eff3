"""Token-bucket rate limiting for a sending socket (a slow link emulated on loopback).

`TokenBucket(rate_bytes_per_s, burst_bytes)`: `take(n)` blocks until n bytes of credit have accrued (credit
accrues at `rate`, up to `burst`). `ThrottledSocket(sock, bucket)` sends in slices of at most one burst, each
after taking its credit, so the bytes leave at the bucket's rate however large the send. rate=None: no limit.
"""
from __future__ import annotations

import socket
import threading
import time


class TokenBucket:
    def __init__(self, rate_bytes_per_s: float | None, burst_bytes: int = 64 * 1024) -> None:
        if rate_bytes_per_s is not None and rate_bytes_per_s <= 0:
            raise ValueError(f"rate must be positive or None, got {rate_bytes_per_s}")
        if burst_bytes <= 0:
            raise ValueError(f"burst must be positive, got {burst_bytes}")
        self.rate = rate_bytes_per_s
        self.burst = burst_bytes
        self._credit = float(burst_bytes)
        self._last = time.perf_counter()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Block until `n` bytes (<= burst) may be sent."""
        if self.rate is None or n <= 0:
            return
        if n > self.burst:
            raise ValueError(f"take({n}) exceeds the burst of {self.burst}")
        with self._lock:
            while True:
                now = time.perf_counter()
                self._credit = min(self.burst, self._credit + (now - self._last) * self.rate)
                self._last = now
                if self._credit >= n:
                    self._credit -= n
                    return
                time.sleep((n - self._credit) / self.rate)


class ThrottledSocket:
    """sendall() through a token bucket; everything else is the wrapped socket's."""

    def __init__(self, sock: socket.socket, bucket: TokenBucket) -> None:
        self.sock = sock
        self.bucket = bucket

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        step = self.bucket.burst if self.bucket.rate is not None else len(view) or 1
        for i in range(0, len(view), step):
            part = view[i:i + step]
            self.bucket.take(len(part))
            self.sock.sendall(part)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.sock, name)


def loopback_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of TCP sockets over 127.0.0.1 (Nagle off): a real loopback link for benchmarks and tests."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    srv.close()
    for sock in (cli, conn):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return cli, conn
