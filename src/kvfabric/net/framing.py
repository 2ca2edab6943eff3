"""Socket helpers shared by kvfabric's two framed wire protocols (stream/protocol.py, cluster/protocol.py).

Each protocol keeps its own header layout; what they share is here:
- `ProtocolError`: the peer sent something the protocol does not allow. `PeerClosed` (also a ConnectionError)
  is the peer closing the connection before a frame was complete.
- `recv_into` / `recv_exact`: read exactly n bytes. Each wait for data is bounded by `timeout_s` (inactivity;
  None keeps the socket's own timeout) and by `deadline` (time.monotonic()) when given: TimeoutError past either.
- `send_all`: scatter-gather writes of several buffers, no concatenation copy.
"""
from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Sequence

Buffer = bytes | bytearray | memoryview


class ProtocolError(ValueError):
    """The peer sent something this protocol does not allow."""


class PeerClosed(ProtocolError, ConnectionError):
    """The peer closed the connection before the frame was complete."""


def recv_into(sock: socket.socket, view: memoryview, timeout_s: float | None = None,
              deadline: float | None = None) -> None:
    """Fill `view` from `sock`. Raises PeerClosed, TimeoutError or OSError."""
    pos, size = 0, len(view)
    if deadline is None and timeout_s is not None:
        # one timeout for every wait: a TLS socket returns one record (16 KiB) a call, hundreds a chunk
        sock.settimeout(timeout_s)
        timeout_s = None
    while pos < size:
        if timeout_s is not None or deadline is not None:
            wait = timeout_s
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("deadline passed")
                wait = left if wait is None else min(wait, left)
            sock.settimeout(wait)
        n = sock.recv_into(view[pos:])
        if n == 0:
            raise PeerClosed(f"connection closed after {pos} of {size} bytes")
        pos += n


def recv_exact(sock: socket.socket, n: int, timeout_s: float | None = None,
               deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), timeout_s, deadline)
    return buf


def send_all(sock: socket.socket, buffers: Sequence[Buffer]) -> None:
    """Send several buffers with scatter-gather writes (no concatenation copy); loops over partial sends. A TLS
    socket has no sendmsg: each buffer is encrypted and sent in turn."""
    if isinstance(sock, ssl.SSLSocket):
        for buffer in buffers:
            sock.sendall(buffer)
        return
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def no_delay(sock: socket.socket) -> None:
    """No Nagle delay for request/response frames."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
