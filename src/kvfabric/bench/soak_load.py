"""The load of `kvfabric bench soak`, run in both of its processes: `--threads` threads on one CacheEngine over
cpu + shm + disk + redis, all on the same `Workload` prompts (kvfabric.engines.synthetic), so the processes hit each other's
chunks. Each operation is a lookup + retrieve of the hit + store of the rest, or (2 %) a delete; every retrieved
chunk is compared with what its key must hold (`wrong`), and a watchdog counts the operations that run past
`OP_DEADLINE_S` (`hangs`). `python -m kvfabric.bench.soak_load DIR SHM URL SECONDS THREADS` is the second process:
it prints `ready` once its engine is open, waits for a line on stdin (the other engine is open too), loads, then
prints its `Totals` as JSON.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

OP_DEADLINE_S = 10.0
CPU_BYTES, SHM_BYTES, DISK_BYTES, REDIS_BYTES = 8 << 20, 16 << 20, 32 << 20, 24 << 20


@dataclass
class Totals:
    ops: int = 0
    deletes: int = 0
    wrong: int = 0
    checked: int = 0
    hangs: int = 0
    errors: int = 0
    asked_tokens: int = 0
    hit_tokens: int = 0
    slowest_s: float = 0.0  # the longest operation


def soak_config(workdir: Path, shm_name: str, redis_url: str):
    from kvfabric.config import Config
    return Config.from_dict({
        "chunk_size": 32, "tiers": ["cpu", "shm", "disk", "redis"], "write_queue_chunks": 64,
        "cpu": {"capacity": CPU_BYTES}, "shm": {"name": shm_name, "capacity": SHM_BYTES},
        "disk": {"path": str(workdir / "chunks"), "capacity": DISK_BYTES},
        "redis": {"url": redis_url, "timeout_s": 1.0}})


def run_load(config, duration_s: float, num_threads: int, seed: int, totals: Totals,
             per_second: list[tuple[int, int]] | None = None, on_ready=None) -> None:
    """Drive the workload from `num_threads` threads for `duration_s` (one shared engine), adding into `totals`."""
    from kvfabric.cache.engine import CacheEngine
    from kvfabric.engines.synthetic import MODEL_ID, SMALL_LAYOUT, Workload
    lock = threading.Lock()
    started_at: dict[int, float] = {}
    idents: dict[int, int] = {}
    stop = threading.Event()
    with CacheEngine(config, SMALL_LAYOUT, MODEL_ID) as engine:
        workload = Workload(engine, seed=0, num_prompts=3000)  # the same prompts in every process
        if on_ready is not None:
            on_ready()

        def worker(i: int) -> None:
            rng = np.random.default_rng((seed, i))
            idents[i] = threading.get_ident()
            while not stop.is_set():
                t0 = started_at[i] = time.monotonic()
                try:
                    result = workload.step(rng)
                except Exception:  # noqa: BLE001 - counted: the engine must not raise for cache faults
                    with lock:
                        totals.errors += 1
                    continue
                finally:
                    started_at.pop(i, None)
                    with lock:
                        totals.slowest_s = max(totals.slowest_s, time.monotonic() - t0)
                with lock:
                    totals.ops += 1
                    totals.deletes += result.op == "delete"
                    totals.wrong += result.num_wrong
                    totals.checked += result.num_checked
                    totals.asked_tokens += result.num_tokens if result.op == "request" else 0
                    totals.hit_tokens += result.num_loaded

        def watchdog() -> None:
            flagged: set[tuple[int, float]] = set()
            while not stop.wait(0.5):
                now = time.monotonic()
                for i, t0 in list(started_at.items()):
                    if now - t0 > OP_DEADLINE_S and (i, t0) not in flagged:
                        flagged.add((i, t0))
                        with lock:
                            totals.hangs += 1
                        _print_stack(i, idents.get(i), now - t0)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(num_threads)]
        threads.append(threading.Thread(target=watchdog, daemon=True))
        for thread in threads:
            thread.start()
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
            if per_second is not None:
                with lock:
                    per_second.append((totals.asked_tokens, totals.hit_tokens))
        if per_second is not None:
            per_second.append(None)  # the end: the samples stop here, before the engine closes
        stop.set()
        for thread in threads:
            thread.join(timeout=OP_DEADLINE_S * 3)
            if thread.is_alive():
                totals.hangs += 1


def _print_stack(thread_num: int, ident: int | None, seconds: float) -> None:
    """Where a hung operation is (stderr): what a hang report needs."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    stack = "".join(traceback.format_stack(frame)[-8:]) if frame is not None else "(finished)\n"
    print(f"soak: thread {thread_num} in one operation for {seconds:.1f} s:\n{stack}", file=sys.stderr, flush=True)


def _worker(argv: list[str]) -> None:
    """The second process: the same load on the same shm pool, disk directory and Redis; prints its totals."""
    workdir, shm_name, url, duration_s, num_threads = argv
    totals = Totals()
    run_load(soak_config(Path(workdir), shm_name, url), float(duration_s), int(num_threads), 2, totals,
             on_ready=lambda: (print("ready", flush=True), sys.stdin.readline()))
    print(json.dumps(asdict(totals)), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1:])
