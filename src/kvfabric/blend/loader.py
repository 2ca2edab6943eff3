"""The blend loader: fetches the cached passages' KV layer group by layer group, in layer order, in a background
thread, re-rotating each passage's K to its offset as it lands. The compute thread calls `wait(group)` before the
layer that needs it (layer i+1 loads while layer i computes). A passage missing at load time sets `failed` and
releases every waiter (`wait` then raises LoadFailed: the prefill falls back to a full one); an error is
re-raised by `finish`."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Executor

import torch

from kvfabric.blend.runner import LlamaRunner, rotate
from kvfabric.blend.store import PassageStore


class LoadFailed(Exception):
    pass


class Loader:
    """Fetches and re-rotates the cached passages group by group in a background thread."""

    def __init__(self, store: PassageStore, runner: LlamaRunner, pool: Executor, kv: torch.Tensor,
                 spans: list[tuple[int, list[int]]], groups: list[int]) -> None:
        # kv: the fp32 workspace [L, 2, H, capacity, D]; spans: (offset, tokens) of each cached passage used
        self.store, self.runner, self.kv, self.spans, self.groups = store, runner, kv, spans, groups
        self.ready = {g: threading.Event() for g in groups}
        self.failed = False
        self.busy_s = 0.0
        self.bytes = 0
        self.future = pool.submit(self._run) if groups else None

    def _run(self) -> None:
        with torch.inference_mode():  # thread-local: the workspace is an inference tensor
            self._load()

    def _load(self) -> None:
        store, runner = self.store, self.runner
        done = False
        try:
            rotations = {off: runner.delta_rotation(off) for off, _ in self.spans if off}
            for g in self.groups:
                started = time.perf_counter()
                layers = slice(g * store.group, (g + 1) * store.group)
                for off, toks in self.spans:
                    n = len(toks)
                    out = self.kv[layers, :, :, off:off + n]
                    if not store.load_group(toks, g, out):
                        self.failed = True
                        return
                    if off:
                        rotate(out[:, 0], *rotations[off])
                    self.bytes += n * store.bytes_per_token_group()
                self.busy_s += time.perf_counter() - started
                self.ready[g].set()
            done = True
        finally:
            if not done:  # a miss or an error: release the compute thread (it re-raises or falls back)
                self.failed = True
                for event in self.ready.values():
                    event.set()

    def wait(self, g: int) -> None:
        if g in self.ready:
            self.ready[g].wait()
            if self.failed:
                raise LoadFailed

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()  # re-raises an error of the loader (a miss is not an error)
