"""Shared helpers of the cluster and remote-tier tests: a controller served by uvicorn in a thread, chunk blobs,
waiting on a condition or a call with a generous deadline, and a clock that only moves when told to."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import torch

from kvfabric.codec.raw import RawCodec
from kvfabric.kv.layout import KVLayout

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


def wait_for(predicate: Callable[[], object], timeout_s: float = 30.0, interval_s: float = 0.02) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval_s)


def finishes(fn: Callable[[], object], timeout_s: float = 60.0) -> object:
    """fn() run in a thread; its result, or its exception re-raised. Fails if it is still running after the
    (generous) deadline: for calls whose contract is "never hangs"."""
    out: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"still running after {timeout_s} s")
    if errors:
        raise errors[0]
    return out[0]


class FakeClock:
    """A monotonic clock for circuit breakers that moves only by `advance` (no sleeping in tests)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


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
