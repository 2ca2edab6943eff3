"""Reaching into an emulated host from this process (bench/hosts.py): a socket made inside a host's network
namespace, and the raw TCP rate between two hosts.

Contract:
- `join_namespace(name)`: moves the calling thread (only) into the named network namespace (setns); sockets it makes
  afterwards, the threads it starts and the processes it forks live there.
- `inside(name, make)`: make() run on a short-lived thread inside the namespace; what it returns (a socket) stays
  in that namespace, the caller's thread stays where it is; an exception is raised on the caller's thread.
- `link_mbit(bed)`: raw TCP from host 0 to host 1 as the links are shaped now (one sendall, received into one
  buffer): the baseline of the benchmarks across hosts.
"""
from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvfabric.bench.hosts import HostBed

CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def join_namespace(name: str) -> None:
    """Move the calling thread into the named network namespace (sockets it makes from now on live there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def inside(name: str, make: Callable[[], T]) -> T:
    """make() run on a short-lived thread inside the namespace: a socket it returns stays in that namespace,
    while this thread (and the process's others) stay where they are."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            join_namespace(name)
            box["value"] = make()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc
    thread = threading.Thread(target=target, name="kvfabric-netns")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def link_mbit(bed: HostBed, num_bytes: int = 32 << 20) -> float:
    """Raw TCP from host 0 to host 1 on the link as shaped now: one sendall of num_bytes, received into one buffer."""
    srv = inside(bed.namespace(1), lambda: _listener(bed.address(1)))
    cli = inside(bed.namespace(0), lambda: socket.create_connection(srv.getsockname(), timeout=30))
    conn, _ = srv.accept()
    got = [0]

    def drain() -> None:
        buf = bytearray(1 << 20)
        while got[0] < num_bytes:
            n = conn.recv_into(buf)
            if not n:
                return
            got[0] += n
    thread = threading.Thread(target=drain)
    started = time.perf_counter()
    thread.start()
    cli.sendall(bytes(num_bytes))
    thread.join()
    took = time.perf_counter() - started
    for s in (cli, conn, srv):
        s.close()
    return num_bytes * 8 / took / 1e6


def _listener(address: str) -> socket.socket:
    srv = socket.socket()
    srv.bind((address, 0))
    srv.listen(1)
    return srv
