"""Shared helpers of the cluster tests: a controller served by uvicorn in a thread, chunk blobs, waiting."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import torch

from kvfabric.codec.raw import RawCodec
from kvfabric.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def make_blob(k: bytes, num_tokens: int = 16, seed: int = 0, layout: KVLayout = LAYOUT) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return bytes(RawCodec().encode(torch.randn(layout.shape(num_tokens), generator=gen), k, layout))


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.02) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval_s)


class ControllerThread:
    """A controller app served by uvicorn on a free loopback port, in a daemon thread."""

    def __init__(self, app, port: int | None = None) -> None:
        import uvicorn
        self.app = app
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def controller(self):
        return self.app.controller

    def start(self) -> ControllerThread:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), 20)
        if not self.server.started:
            raise RuntimeError("controller did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
