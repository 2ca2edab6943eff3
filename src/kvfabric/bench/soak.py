"""`kvfabric bench soak`: sustained mixed load over cpu + shm + disk + redis from several threads in two processes,
with resources sampled every second and every retrieved chunk checked.

What runs (`soak_load.py`): `--threads` threads in this process and as many in a second process, all on the same
`Workload` prompts, so the processes hit each other's chunks in shm, disk and Redis; every retrieved chunk is
checked (wrong outputs) and every operation must finish within `OP_DEADLINE_S` (hangs).

Sampled every second, per process: RSS, open file descriptors, threads; and the shm pool's used bytes, Redis'
used_memory, the disk tier's bytes, the hit ratio of that second. Bounds (stated in the output, checked at the
end against the samples after the warm-up, the first `WARMUP_SHARE` of the run): RSS at most the warm-up's
maximum + `RSS_SLACK_MB`; fds and threads at most the warm-up's maximum + `FD_SLACK` / `THREAD_SLACK`; shm and
Redis within their configured capacity (+10 % for Redis' own overhead); the disk directory within both
processes' capacities (each bounds the chunks its index knows); the hit ratio of the last third within
`HIT_DRIFT` of the middle third's.

`--json` prints one final object: duration_s, ops, wrong, hangs, rss_start_mb, rss_max_mb, rss_end_mb, fds_max,
threads_max, and the rest of the figures; `--plot` writes the samples as a PNG.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvfabric.bench.common import save_figure, subplots
from kvfabric.bench.soak_load import DISK_BYTES, OP_DEADLINE_S, REDIS_BYTES, SHM_BYTES, Totals, run_load, soak_config
from kvfabric.bench.vllm_server import free_port

WARMUP_SHARE = 0.2
RSS_SLACK_MB = 64.0
FD_SLACK = 16
THREAD_SLACK = 4
HIT_DRIFT = 0.15


class RedisProcess:
    """A private redis-server (maxmemory REDIS_BYTES, allkeys-lru) for the run."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("bench soak needs redis-server (or --redis-url)")
        self.port = free_port()
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(workdir), "--maxmemory", str(REDIS_BYTES),
                                      "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
        import redis
        self.client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def used_bytes(self) -> int:
        try:
            return int(self.client.info("memory")["used_memory"])
        except Exception:  # noqa: BLE001 - a sample, not a failure
            return 0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@dataclass
class Sample:
    t: float
    rss_mb: list[float]  # per process
    fds: list[int]
    threads: list[int]
    shm_mb: float
    redis_mb: float
    disk_mb: float
    hit_ratio: float | None


@dataclass
class Report:
    duration_s: float
    ops: int
    wrong: int
    hangs: int
    errors: int
    checked_chunks: int
    slowest_op_s: float
    rss_start_mb: float
    rss_max_mb: float
    rss_end_mb: float
    fds_max: int
    threads_max: int
    shm_max_mb: float
    redis_max_mb: float
    hit_ratio_middle: float
    hit_ratio_last: float
    bounds: dict[str, float]
    within_bounds: dict[str, bool]
    samples: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.wrong == 0 and self.hangs == 0 and self.errors == 0 and all(self.within_bounds.values())


def _disk_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # evicted while we looked
                pass
    return total


def run(duration_s: float = 600.0, num_threads: int = 3, as_json: bool = False, plot: str | None = None,
        redis_url: str | None = None) -> Report:
    import psutil

    from kvfabric.tiers.shm import ShmTier
    workdir = Path(tempfile.mkdtemp(prefix="kvfabric-soak-"))
    shm_name = f"soak-{os.getpid()}"
    redis_proc = None if redis_url else RedisProcess(workdir)
    url = redis_url or redis_proc.url
    config = soak_config(workdir, shm_name, url)
    totals, per_second = Totals(), []
    shm_view = ShmTier(shm_name, SHM_BYTES)
    other = subprocess.Popen([sys.executable, "-m", "kvfabric.bench.soak_load", str(workdir), shm_name, url,
                              str(duration_s), str(num_threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    ready = threading.Event()

    def both_ready() -> None:  # both engines are open: both processes start their load now
        other.stdin.write("go\n")
        other.stdin.flush()
        ready.set()

    load = threading.Thread(target=run_load, args=(config, duration_s, num_threads, 1, totals, per_second,
                                                   both_ready), daemon=True)
    procs = [psutil.Process(), psutil.Process(other.pid)]
    samples: list[Sample] = []
    last = (0, 0)
    try:
        if other.stdout.readline().strip() != "ready":
            raise RuntimeError("the second soak process did not start")
        load.start()
        ready.wait(120)
        started = time.monotonic()
        while load.is_alive():
            time.sleep(1.0)
            rss, fds, threads = [], [], []
            for proc in procs:
                try:
                    rss.append(proc.memory_info().rss / 2**20)
                    fds.append(proc.num_fds())
                    threads.append(proc.num_threads())
                except psutil.Error:
                    pass
            if len(rss) < len(procs) or 0.0 in rss or (per_second and per_second[-1] is None):
                continue  # a process has finished its load: the run is ending
            asked, hit = per_second[-1] if per_second else (0, 0)
            ratio = (hit - last[1]) / (asked - last[0]) if asked > last[0] else None
            last = (asked, hit)
            samples.append(Sample(time.monotonic() - started, rss, fds, threads,
                                  shm_view.usage().num_bytes / 2**20,
                                  (redis_proc.used_bytes() if redis_proc else 0) / 2**20,
                                  _disk_bytes(workdir / "chunks") / 2**20, ratio))
        load.join()
        out, _ = other.communicate(timeout=OP_DEADLINE_S * 6)
        theirs = json.loads(out.strip().splitlines()[-1])
    finally:
        shm_view.close()
        if other.poll() is None:
            other.kill()
        if redis_proc is not None:
            redis_proc.stop()
        ShmTier.destroy(shm_name)
        shutil.rmtree(workdir, ignore_errors=True)
    for name in ("ops", "wrong", "hangs", "errors", "checked"):
        setattr(totals, name, getattr(totals, name) + theirs[name])
    totals.slowest_s = max(totals.slowest_s, theirs["slowest_s"])
    report = summarize(samples, totals, duration_s)
    show(report, as_json)
    if plot:
        plot_samples(samples, report, plot)
    return report


def summarize(samples: list[Sample], totals: Totals, duration_s: float) -> Report:
    if not samples:
        raise RuntimeError("no resource samples: the run was shorter than a second of load in both processes")
    warm = [s for s in samples if s.t <= duration_s * WARMUP_SHARE] or samples[:1]
    rss_total = [sum(s.rss_mb) for s in samples]
    warm_rss = max(sum(s.rss_mb) for s in warm)
    bounds = {"rss_mb": warm_rss + RSS_SLACK_MB, "fds": max(max(s.fds) for s in warm) + FD_SLACK,
              "threads": max(max(s.threads) for s in warm) + THREAD_SLACK, "shm_mb": SHM_BYTES / 2**20,
              "redis_mb": REDIS_BYTES / 2**20 * 1.1, "disk_mb": 2 * DISK_BYTES / 2**20 * 1.05,
              "hit_drift": HIT_DRIFT}
    n = len(samples)
    middle = [s.hit_ratio for s in samples[n // 3:2 * n // 3] if s.hit_ratio is not None]
    last = [s.hit_ratio for s in samples[2 * n // 3:] if s.hit_ratio is not None]
    mid_ratio = float(np.mean(middle)) if middle else 0.0
    last_ratio = float(np.mean(last)) if last else 0.0
    report = Report(
        duration_s=duration_s, ops=totals.ops, wrong=totals.wrong, hangs=totals.hangs, errors=totals.errors,
        checked_chunks=totals.checked, slowest_op_s=round(totals.slowest_s, 2), rss_start_mb=round(rss_total[0], 1), rss_max_mb=round(max(rss_total), 1),
        rss_end_mb=round(rss_total[-1], 1), fds_max=max(max(s.fds) for s in samples),
        threads_max=max(max(s.threads) for s in samples), shm_max_mb=round(max(s.shm_mb for s in samples), 2),
        redis_max_mb=round(max(s.redis_mb for s in samples), 2), hit_ratio_middle=round(mid_ratio, 3),
        hit_ratio_last=round(last_ratio, 3), bounds={k: round(v, 2) for k, v in bounds.items()}, within_bounds={},
        samples=[asdict(s) for s in samples])
    after = [s for s in samples if s.t > duration_s * WARMUP_SHARE] or samples
    report.within_bounds = {
        "rss_mb": max(sum(s.rss_mb) for s in after) <= bounds["rss_mb"],
        "fds": max(max(s.fds) for s in after) <= bounds["fds"],
        "threads": max(max(s.threads) for s in after) <= bounds["threads"],
        "shm_mb": report.shm_max_mb <= bounds["shm_mb"],
        "redis_mb": report.redis_max_mb <= bounds["redis_mb"],
        "disk_mb": max(s.disk_mb for s in samples) <= bounds["disk_mb"],
        "hit_drift": abs(last_ratio - mid_ratio) <= HIT_DRIFT}
    return report


def show(report: Report, as_json: bool) -> None:
    if as_json:
        print(json.dumps({k: v for k, v in asdict(report).items() if k != "samples"} | {"ok": report.ok}), flush=True)
        return
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"soak: {report.duration_s:.0f} s, {report.ops} operations, two processes")
    for col in ("figure", "measured", "bound", "ok"):
        table.add_column(col)
    rows = [("wrong outputs (of %d chunks checked)" % report.checked_chunks, report.wrong, 0, report.wrong == 0),
            ("hangs (ops past %.0f s; slowest %.2f s)" % (OP_DEADLINE_S, report.slowest_op_s), report.hangs, 0,
             report.hangs == 0),
            ("errors raised", report.errors, 0, report.errors == 0),
            ("RSS, both processes (MB): start / max / end",
             f"{report.rss_start_mb} / {report.rss_max_mb} / {report.rss_end_mb}", report.bounds["rss_mb"],
             report.within_bounds["rss_mb"]),
            ("open fds (max of either)", report.fds_max, report.bounds["fds"], report.within_bounds["fds"]),
            ("threads (max of either)", report.threads_max, report.bounds["threads"], report.within_bounds["threads"]),
            ("shm pool used (MB)", report.shm_max_mb, report.bounds["shm_mb"], report.within_bounds["shm_mb"]),
            ("Redis used_memory (MB)", report.redis_max_mb, report.bounds["redis_mb"],
             report.within_bounds["redis_mb"]),
            ("disk directory (MB; each process bounds its own index)", round(max(s["disk_mb"] for s in
                                                                              report.samples), 1),
             report.bounds["disk_mb"], report.within_bounds["disk_mb"]),
            ("hit ratio middle / last third", f"{report.hit_ratio_middle} / {report.hit_ratio_last}",
             f"drift <= {HIT_DRIFT}", report.within_bounds["hit_drift"])]
    for name, measured, bound, ok in rows:
        table.add_row(name, str(measured), str(bound), "yes" if ok else "NO")
    Console().print(table)


def plot_samples(samples: list[Sample], report: Report, path: str) -> None:
    t = [s.t for s in samples]
    fig, axes = subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot(t, [sum(s.rss_mb) for s in samples], label="RSS, both processes")
    ax.axhline(report.bounds["rss_mb"], color="red", linestyle="--", label="bound")
    ax.set_ylabel("MB")
    ax.legend()
    ax = axes[0][1]
    ax.plot(t, [max(s.fds) for s in samples], label="open fds (max)")
    ax.plot(t, [max(s.threads) for s in samples], label="threads (max)")
    ax.legend()
    ax = axes[1][0]
    ax.plot(t, [s.shm_mb for s in samples], label="shm used")
    ax.plot(t, [s.redis_mb for s in samples], label="Redis used_memory")
    ax.plot(t, [s.disk_mb for s in samples], label="disk tier")
    ax.set_ylabel("MB")
    ax.legend()
    ax = axes[1][1]
    ax.plot(t, [s.hit_ratio if s.hit_ratio is not None else np.nan for s in samples], label="hit ratio (per second)")
    ax.set_ylim(0, 1)
    ax.legend()
    for row in axes:
        for ax in row:
            ax.set_xlabel("s")
    fig.suptitle(f"kvfabric bench soak: {report.ops} ops, wrong {report.wrong}, hangs {report.hangs}")
    save_figure(fig, path, 90)
