"""Disk faults under load: a full file system (a 1 MiB tmpfs under a disk tier configured for 64 MiB, then grown),
and the cache directory deleted while running. No wrong chunk, no call past its deadline, the recovery time."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from kvfabric.cache.engine import CacheEngine
from kvfabric.config import Config
from kvfabric.engines.synthetic import MODEL_ID, SMALL_LAYOUT
from tests.reliability.harness import Load, assert_clean, report, time_until

pytestmark = pytest.mark.slow


def disk_engine(path) -> CacheEngine:
    config = Config.from_dict({"chunk_size": 32, "tiers": ["cpu", "disk"], "cpu": {"capacity": 256 * 1024},
                               "disk": {"path": str(path), "capacity": "64MiB"}})
    return CacheEngine(config, SMALL_LAYOUT, MODEL_ID)


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_then_room_again(small_fs):
    with disk_engine(small_fs / "chunks") as engine:
        failed = lambda: engine.stats().counters.get("failed_writes.disk", 0)  # noqa: E731
        load = Load(engine).start()
        time_until(lambda: failed() > 20, 120)  # ENOSPC: writes fail and are counted
        ops_full = load.ops_after(2)
        held = engine.tier_usage("disk").num_chunks
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_fs)], check=True)
        recovery_s = time_until(lambda: engine.tier_usage("disk").num_chunks > held + 5, 60)
        load.stop()
        refused = failed()
    assert ops_full > 0
    assert_clean(load)
    report("disk full (1 MiB tmpfs under a 64 MiB disk tier), then grown", load, writes_failed=refused,
           ops_while_full=ops_full, recovery_s=recovery_s)


def test_cache_directory_deleted_while_running(tmp_path):
    root = tmp_path / "chunks"
    with disk_engine(root) as engine:
        load = Load(engine).start()
        time_until(lambda: engine.stats().counters.get("hit.disk", 0) > 10, 120)
        root.rename(tmp_path / "gone")  # `rm -rf` done at once (a plain rmtree races the writer thread)
        shutil.rmtree(tmp_path / "gone")
        written_s = time_until(lambda: any(root.glob("*/*.kvc")), 60)  # new chunk files in a new directory
        hits = engine.stats().counters["hit.disk"]
        recovery_s = written_s + time_until(lambda: engine.stats().counters["hit.disk"] > hits, 60)  # read back
        load.stop()
        recreated = engine.stats().tier_counters["disk"].get("directory_recreated", 0)
    assert recreated >= 1
    assert_clean(load)
    report("cache directory deleted while running", load, recovery_s=recovery_s)
