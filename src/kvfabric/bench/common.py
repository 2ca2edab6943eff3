"""Shared benchmark plumbing: timing, page-cache dropping, and output (a human table, or JSON lines).

Every speed figure is reported beside a baseline measured in the same run, as a ratio: absolute timings on a
shared machine are noise, ratios measured side by side are not.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table


def timed(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of `fn` over `repeats` runs (setup, untimed, before each)."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired(ours: Callable[[], object], base: Callable[[], object], repeats: int,
           setup_ours: Callable[[], object] | None = None,
           setup_base: Callable[[], object] | None = None) -> tuple[float, float]:
    """Median times of `ours` and `base`, run alternately (and each first half of the time) so that both see
    the same machine load and neither always gets the warmer caches."""
    a, b = [], []
    for i in range(repeats):
        if i % 2:
            b.append(timed(base, 1, setup_base))
            a.append(timed(ours, 1, setup_ours))
        else:
            a.append(timed(ours, 1, setup_ours))
            b.append(timed(base, 1, setup_base))
    return statistics.median(a), statistics.median(b)


def drop_page_cache(paths: Iterable[str | os.PathLike]) -> None:
    """Evict these files' clean pages from the page cache, so the next read hits the device."""
    from kvfabric.tiers.disk import fadvise
    fadvise(paths, os.POSIX_FADV_DONTNEED)


def threads_note() -> str:
    return f"torch threads={torch.get_num_threads()}, cpus={os.cpu_count()}"


def emit(rows: list[dict], as_json: bool, title: str, columns: list[str]) -> None:
    if as_json:
        for row in rows:
            print(json.dumps(row), flush=True)
        return
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column not in ("tier", "op", "layout", "baseline") else "left")
    for row in rows:
        table.add_row(*[_fmt(row.get(column)) for column in columns])
    Console().print(table)


def emit_summary(summary: dict, as_json: bool, title: str) -> None:
    """One summary object: a JSON line, or a two-column table that fits a terminal."""
    if as_json:
        print(json.dumps(summary), flush=True)
        return
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, _fmt(value))
    Console().print(table)


def subplots(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """matplotlib's `plt.subplots` on the Agg backend (files only, no display; pyplot loads only when plotting)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(*args, **kwargs)


def save_figure(fig: Any, path: str, dpi: int) -> None:
    """Lay out, write and close a figure made by `subplots`."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return "" if value is None else str(value)
