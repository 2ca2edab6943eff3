"""A real `mooncake_master` for tests (stop / restart on the same ports), and Mooncake clients on loopback.

Network rule for every Mooncake test: MC_TCP_BIND_ADDRESS=127.0.0.1 (set here, at import, before any client
exists) and each client named 127.0.0.1:<free port>, so all traffic stays on loopback. Tests using these
fixtures are skipped when the Mooncake client (pip mooncake-transfer-engine-non-cuda) or its `mooncake_master`
cannot be loaded.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.bench.tiers_mooncake import LoopbackMaster, master_binary

os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"


def _why_not() -> str:
    try:
        import mooncake.store  # noqa: F401 - needs libibverbs1 too
    except ImportError as exc:
        return f"Mooncake client not importable ({exc}); `scripts/setup.sh --test` installs it"
    if not master_binary().exists():
        return "mooncake_master not found next to this Python"
    return ""


WHY_NOT = _why_not()
needs_mooncake = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "ok")


class MooncakeMaster(LoopbackMaster):
    """The benchmark's loopback master (kvfabric.bench.tiers_mooncake), plus the tier arguments that reach it."""

    def tier_args(self) -> dict:
        return dict(master=self.address, metadata_url=self.metadata_url, metrics_url=self.metrics_url)


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster(tmp_path / "mooncake").start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="module")
def shared_mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One master for a whole module (the contract suite): each test's tiers unmount their segments on close."""
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    try:
        yield master
    finally:
        master.stop()


def stopped(pid: int) -> bool:
    """Every thread of the process is stopped (state T): after SIGSTOP, a thread already running on another
    core may still answer one request until the kernel stops it."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue
    return bool(states) and all(state in ("T", "t") for state in states)


def hang(master: MooncakeMaster) -> None:
    """SIGSTOP the master and wait until it is really silent."""
    import signal

    from tests.cluster_scripts.helpers import wait_for
    os.kill(master.proc.pid, signal.SIGSTOP)
    wait_for(lambda: stopped(master.proc.pid), 10, interval_s=0.01)
