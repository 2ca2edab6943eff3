"""Test-wide settings. OpenMP must wait passively: the suite shares 2 cores with subprocesses (redis, engines),
and spinning OpenMP threads made model steps 30-60x slower under such load (see kvfabric.cli)."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001, ARG001
    """Servers the tests killed on purpose (SIGKILL) leave their slot pools in /dev/shm; remove those, as the
    next `kvfabric server` would (`SlotPool.reclaim`: only pools no live server holds). A run leaves nothing."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # once, in the controlling process
        return
    try:
        from kvfabric.remote.pool import SlotPool
    except ImportError:  # pragma: no cover - a venv without kvfabric's deps
        return
    if os.path.isdir("/dev/shm"):
        SlotPool.reclaim("/dev/shm")
