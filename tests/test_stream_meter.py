"""stream/meter.py: the rate the kernel saw acknowledged on a real loopback TCP connection."""
from __future__ import annotations

import socket
import threading
import time

from kvfabric.stream import ThrottledSocket, TokenBucket, loopback_pair
from kvfabric.stream.meter import LinkMeter


def _drain(conn: socket.socket, num_bytes: int) -> threading.Thread:
    def run() -> None:
        buf, got = bytearray(1 << 20), 0
        while got < num_bytes:
            n = conn.recv_into(buf)
            if not n:
                return
            got += n
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_the_meter_reads_what_the_receiver_acknowledged_at_the_links_pace():
    cli, conn = loopback_pair()
    with cli, conn:
        meter = LinkMeter(ThrottledSocket(cli, TokenBucket(50e6, 256 * 1024)))  # a 50 MB/s link
        assert meter.is_available
        assert meter.rate_bps() is None  # nothing sent, and no window has passed
        reader = _drain(conn, 5_000_000)
        started = time.perf_counter()
        ThrottledSocket(cli, TokenBucket(50e6, 256 * 1024)).sendall(bytes(5_000_000))
        reader.join()
        took = time.perf_counter() - started
        rate = meter.rate_bps()
        assert rate is not None and 0.6 * 50e6 <= rate <= 1.3 * 5_000_000 / took, (rate, took)
        assert meter.rate_bps() is None  # read again at once: inside the minimum window


def test_without_tcp_info_the_meter_is_not_available():
    a, b = socket.socketpair()
    with a, b:
        meter = LinkMeter(a)
        assert not meter.is_available and meter.rate_bps() is None
