"""Where the worker's own threads (loads, saves) run: `release(nice)`, called first thing on each such thread.

Why: vLLM's CPU backend binds each OpenMP thread to one core (OMP_PLACES / OMP_PROC_BIND), the worker's main
thread included, and a new thread inherits its creator's binding. Left alone, every kvfabric thread of the worker
runs on core 0 beside the forward's main thread, whatever else is idle: seen inside vLLM at 4k tokens, both
load threads bound to core 0 while core 1 held only an OpenMP thread between steps, and the load took several
times as long as its page-cache read + copy (docs/design/measurements.md).

`engine_cpus()` is the set of CPUs the engine process was given: its parent's (vLLM's EngineCore, which binds
nothing, so it carries whatever `taskset` / cpuset the operator set), never wider. `release` moves the calling
thread onto that set (the kernel's scheduler then puts it where a core is free) and raises its niceness by
`nice` (per thread on Linux; raising needs no privilege). Both are best effort: where not permitted the thread
keeps its place and priority. `on_released(make)` calls `make()` on a released thread and returns its result:
the threads an object starts while it is made (a cache's writer and premap threads) inherit that placement.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def engine_cpus() -> set[int]:
    """The CPUs the engine process may use: the parent process's affinity, or this thread's where unreadable."""
    try:
        return os.sched_getaffinity(os.getppid()) or os.sched_getaffinity(0)
    except OSError:
        return os.sched_getaffinity(0)


def release(nice: int = 0) -> None:
    """The calling thread: off the core vLLM bound its creator to (onto `engine_cpus()`), niced by `nice`."""
    tid = threading.get_native_id()
    try:
        os.sched_setaffinity(0, engine_cpus())  # 0: the calling thread
    except OSError:
        pass
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError:  # not permitted here: the thread shares the cores equally with the forward
            pass


def on_released(make: Callable[[], T]) -> T:
    """`make()` called on a thread that ran `release()` first (its exception re-raised here)."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        release()
        try:
            result.append(make())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="kvfabric-make")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
