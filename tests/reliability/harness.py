"""Shared pieces of the reliability suite: a load thread whose every call is timed against a deadline and whose
every retrieved chunk is checked (kvfabric.engines.synthetic.Workload), recovery timing, and the figure each test reports.

Each fault test prints one line `RELIABILITY {json}` (run pytest with -s to see them) and, when
$KVFABRIC_TEST_RELIABILITY_REPORT names a file, appends the same JSON there: the README's reliability table is
made from those lines.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from kvfabric.cache.engine import CacheEngine
from kvfabric.engines.synthetic import Workload


class Load:
    """Workload steps on `engine` from one thread until `stop()`. A step slower than `deadline_s` is a hang (and
    so is a step still running when stop() gives up on it); a retrieved chunk with other bytes is wrong."""

    def __init__(self, engine: CacheEngine, deadline_s: float = 5.0, seed: int = 0, num_prompts: int = 400,
                 pause_s: float = 0.0) -> None:
        self.workload = Workload(engine, num_prompts=num_prompts, seed=0)
        self.deadline_s = deadline_s
        self.pause_s = pause_s
        self.ops = self.wrong = self.checked = self.hangs = self.errors = 0
        self.loaded_tokens = 0
        self.max_call_s = 0.0
        self.last_ok_at = 0.0  # monotonic time of the last step that finished within the deadline
        self._rng = np.random.default_rng(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                result = self.workload.step(self._rng)
            except Exception:  # noqa: BLE001 - the engine must not raise for cache faults: counted, asserted 0
                self.errors += 1
                continue
            elapsed = time.monotonic() - started
            self.ops += 1
            self.max_call_s = max(self.max_call_s, elapsed)
            self.wrong += result.num_wrong
            self.checked += result.num_checked
            self.loaded_tokens += result.num_loaded
            if elapsed > self.deadline_s:
                self.hangs += 1
            else:
                self.last_ok_at = time.monotonic()
            if self.pause_s:
                self._stop.wait(self.pause_s)

    def run_for(self, seconds: float) -> None:
        """Let the load run for `seconds` (the thread keeps going); fails if it has died."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            assert self._thread.is_alive()
            time.sleep(0.05)

    def ops_after(self, seconds: float) -> int:
        before = self.ops
        self.run_for(seconds)
        return self.ops - before

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.deadline_s * 3)
        if self._thread.is_alive():
            self.hangs += 1


def time_until(predicate: Callable[[], object], timeout_s: float = 60.0, interval_s: float = 0.05) -> float:
    """Seconds until `predicate()` is true (the recovery time); fails after `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"not recovered within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - started


def report(fault: str, load: Load | None = None, **figures: object) -> dict:
    row: dict[str, object] = {"fault": fault}
    if load is not None:
        row.update(ops=load.ops, wrong=load.wrong, hangs=load.hangs, errors=load.errors,
                   checked_chunks=load.checked, max_call_s=round(load.max_call_s, 3))
    row.update({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()})
    line = json.dumps(row)
    print(f"RELIABILITY {line}", flush=True)
    path = os.environ.get("KVFABRIC_TEST_RELIABILITY_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    return row


def assert_clean(load: Load) -> None:
    assert load.errors == 0, "a call raised"
    assert load.hangs == 0, f"{load.hangs} calls past their {load.deadline_s} s deadline (max {load.max_call_s:.2f} s)"
    assert load.wrong == 0, f"{load.wrong} wrong chunks of {load.checked}"


def controller_healthy(url: str) -> bool:
    """The controller at `url` answers /v1/health with 200 (False while it is down or starting)."""
    import httpx
    try:
        return httpx.get(url + "/v1/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
