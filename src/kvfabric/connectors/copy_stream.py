"""Where the paged copies run: one small interface, with a CPU implementation (vLLM's CPU backend, and the tests of
every GPU layout here) and a CUDA one (a side stream, pinned host buffers, events). The copy routines
(`paged_views`) are the same on both; only what this module does around them differs.

Contract:
- `make_copy_stream(device, pinned_bytes)`: a `CpuCopyStream` for a CPU device, a `CudaCopyStream` for a CUDA one.
  Nothing in torch.cuda is called for a CPU device.
- `host_buffer(num_bytes)` is a uint8 host tensor of exactly that size: pinned (page-locked) on CUDA, so that
  copies to and from it are DMA and asynchronous. Buffers come back with `release(buffer)` and are reused; free
  buffers are bounded by `pinned_bytes` (the oldest go first); a buffer that takes the bytes handed out beyond
  the bound is still handed out, and counted in `num_over_budget` (an unbounded pinned pool would lock the
  host's memory; a load that finds no buffer must not fail).
- `run(fn)` runs fn with the side stream current: the copies fn enqueues (non_blocking) run off the engine's
  stream. `after_compute()` makes the next copies wait for what the engine's stream has done so far (a save must
  see the forward's writes of its blocks), without blocking the host.
- `record()` -> `CopyDone` of everything enqueued so far: `is_done()` polls (a request waiting for its save),
  `wait()` blocks the host, `hold_compute()` makes the engine's stream wait for it before its next kernels (a
  layer-wise load: layer l's attention runs only after layer l's blocks landed), never the host.
- `is_staged`: copies to and from the device go through `host_buffer`s (True on CUDA: a copy between a device
  and pageable memory is not asynchronous). A CpuCopyStream is staged only when asked (`staged=True`), so the
  tests here run the CUDA data path's staging code too.
- On a CPU device every copy has happened when `run` returns: `is_done()` is True and the waits return at once.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import torch


class CopyDone(Protocol):
    def is_done(self) -> bool: ...

    def wait(self) -> None: ...

    def hold_compute(self) -> None: ...


class CopyStream(Protocol):
    device: torch.device
    is_staged: bool

    @property
    def num_over_budget(self) -> int: ...

    def host_buffer(self, num_bytes: int) -> torch.Tensor: ...

    def release(self, buffer: torch.Tensor) -> None: ...

    def run(self, fn: Callable[[], object]) -> None: ...

    def after_compute(self) -> None: ...

    def record(self) -> CopyDone: ...


class _HostPool:
    """Free host buffers, oldest first, at most `budget` bytes of them (thread-safe: savers and loaders share it)."""

    def __init__(self, budget: int, make: Callable[[int], torch.Tensor]) -> None:
        self.budget = budget
        self.make = make
        self.num_bytes = 0  # free bytes held
        self.num_out = 0  # bytes handed out and not released
        self.num_over_budget = 0
        self._free: OrderedDict[int, torch.Tensor] = OrderedDict()  # id -> buffer (insertion order: oldest first)
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> torch.Tensor:
        with self._lock:
            self.num_out += num_bytes
            for ident, buffer in self._free.items():
                if buffer.numel() == num_bytes:
                    del self._free[ident]
                    self.num_bytes -= num_bytes
                    return buffer
            if self.num_out > self.budget:
                self.num_over_budget += 1
        return self.make(num_bytes)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self.num_out -= buffer.numel()
            self._free[id(buffer)] = buffer
            self.num_bytes += buffer.numel()
            while self.num_bytes > self.budget and self._free:
                _, oldest = self._free.popitem(last=False)
                self.num_bytes -= oldest.numel()


class _Done:
    """A CPU copy: finished when recorded."""

    def is_done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def hold_compute(self) -> None:
        pass


class _PooledStream:
    """The host buffers of both streams."""
    _pool: _HostPool

    @property
    def num_over_budget(self) -> int:
        return self._pool.num_over_budget

    def host_buffer(self, num_bytes: int) -> torch.Tensor:
        return self._pool.take(num_bytes)

    def release(self, buffer: torch.Tensor) -> None:
        self._pool.give(buffer)


class CpuCopyStream(_PooledStream):
    def __init__(self, pinned_bytes: int = 1 << 30, staged: bool = False) -> None:
        self.device = torch.device("cpu")
        self.is_staged = staged
        self._pool = _HostPool(pinned_bytes, lambda n: torch.empty(n, dtype=torch.uint8))

    def run(self, fn: Callable[[], object]) -> None:
        fn()

    def after_compute(self) -> None:
        pass

    def record(self) -> CopyDone:
        return _Done()


class _CudaDone:
    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event = event
        self.device = device

    def is_done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def hold_compute(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class CudaCopyStream(_PooledStream):
    def __init__(self, device: torch.device, pinned_bytes: int = 1 << 30) -> None:
        self.device = device
        self.is_staged = True
        self.stream = torch.cuda.Stream(device=device)
        self._pool = _HostPool(pinned_bytes, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))

    def run(self, fn: Callable[[], object]) -> None:
        with torch.cuda.stream(self.stream):
            fn()

    def after_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self) -> CopyDone:
        event = torch.cuda.Event()
        event.record(self.stream)
        return _CudaDone(event, self.device)


def make_copy_stream(device: torch.device | str, pinned_bytes: int = 1 << 30) -> CopyStream:
    device = torch.device(device)
    if device.type == "cpu":
        return CpuCopyStream(pinned_bytes)
    if device.type == "cuda":
        return CudaCopyStream(device, pinned_bytes)
    raise ValueError(f"no copy stream for device type {device.type!r} (cpu and cuda are supported)")
