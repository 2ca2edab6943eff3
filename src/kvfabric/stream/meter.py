"""The rate a TCP link delivers, as the kernel counts it, for the sender's policy.

Why: a send returns once its bytes are in the socket's send buffer, which Linux autotunes to megabytes. A chunk
smaller than the free buffer "sends" at memory speed whatever the link, so timing send calls tells a policy that the
link is many times faster than it is right after a few small chunks, and it picks big options it cannot afford
(docs/design/measurements.md has the figures). The
kernel's count of the bytes the receiver acknowledged (TCP_INFO `tcpi_bytes_acked`) moves at the link's pace.

Contract:
- `LinkMeter(sock)`: `is_available` where the socket is TCP on Linux (TCP_INFO with `tcpi_bytes_acked`, Linux
  4.1+); otherwise callers time their sends as before.
- `queued_bytes()`: bytes sent into the socket that the receiver has not acknowledged yet (the link's backlog;
  SIOCOUTQ), 0 where not available.
- `rate_bps()`: bytes acknowledged per second since the meter's last reading at least `min_window_s` ago (the
  readings taken within it are skipped, so one sample spans enough of the link's time); None until such a window
  has passed, or while nothing was acknowledged in it. Reading costs one getsockopt.
"""
from __future__ import annotations

import array
import fcntl
import socket
import struct
import sys
import termios
import time

# struct tcp_info (include/uapi/linux/tcp.h): 8 one-byte fields, 24 u32 (rto ... total_retrans), then u64
# pacing_rate, max_pacing_rate, bytes_acked: bytes_acked at offset 8 + 24 * 4 + 2 * 8 = 120
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_AT = 120
_TCP_INFO_BYTES = 232


class LinkMeter:
    def __init__(self, sock: socket.socket, min_window_s: float = 0.002) -> None:
        self.sock = getattr(sock, "sock", sock)  # a ThrottledSocket's own socket
        self.min_window_s = min_window_s
        acked = self._acked() if sys.platform.startswith("linux") else None
        self.is_available = acked is not None
        self._last = (time.perf_counter(), acked or 0)

    def _acked(self) -> int | None:
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        except (OSError, AttributeError):
            return None
        if len(info) < _BYTES_ACKED_AT + _BYTES_ACKED.size:
            return None
        return int(_BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0])

    def queued_bytes(self) -> int:
        if not self.is_available:
            return 0
        count = array.array("i", [0])
        try:
            fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, count, True)  # SIOCOUTQ on a TCP socket
        except OSError:
            return 0
        return count[0]

    def rate_bps(self) -> float | None:
        if not self.is_available:
            return None
        now, acked = time.perf_counter(), self._acked()
        since, before = self._last
        if acked is None or now - since < self.min_window_s:
            return None
        self._last = (now, acked)
        if acked <= before:
            return None
        return (acked - before) / (now - since)
