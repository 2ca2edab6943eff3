"""Test-wide settings. OpenMP must wait passively: the suite shares 2 cores with subprocesses (redis, engines),
and spinning OpenMP threads made model steps 30-60x slower under such load (see kvfabric.apps.cli)."""
import os
import shutil
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# the processes the tests start take their own temporary directory, removed when the run ends: vLLM names its ZMQ
# IPC sockets and distributed-init files after it and leaves them behind (hundreds per run of the vLLM tests). This
# process (and pytest's tmp_path) keeps the system's: tempfile resolved it before TMPDIR changes. xdist workers
# inherit the controller's folder.
CHILD_TMP_VAR = "KVFABRIC_TEST_CHILD_TMP"
MADE_CHILD_TMP = CHILD_TMP_VAR not in os.environ  # not in a pytest that a test started: the outer run owns it
if MADE_CHILD_TMP:
    os.environ[CHILD_TMP_VAR] = tempfile.mkdtemp(prefix="kvfabric-tests-", dir=tempfile.gettempdir())
    os.environ["TMPDIR"] = os.environ[CHILD_TMP_VAR]


SHM = "/dev/shm"
# what other programs the tests run leave in /dev/shm when a test stops them: vLLM's shared-memory message queues
# (multiprocessing.shared_memory, "psm_*", 160-240 MiB each) and semaphores of an engine terminated mid-way, and
# libfaketime's state of a process it clocked
STRAY_PREFIXES = ("psm_", "sem.mp-", "faketime_shm_", "sem.faketime_sem_")


def _in_use(folder: str) -> set[str]:
    """Paths under `folder` that a live process maps or holds open (/proc/*/maps and /proc/*/fd)."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                used.update(line.split(None, 5)[-1].strip() for line in maps if folder in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(folder):
                    used.add(target)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return used


def pytest_sessionstart(session) -> None:  # noqa: ANN001
    if not os.environ.get("PYTEST_XDIST_WORKER") and os.path.isdir(SHM):
        session.config.kvfabric_shm_before = set(os.listdir(SHM))


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001, ARG001
    """A run leaves nothing in /dev/shm. Servers the tests killed on purpose (SIGKILL) leave their slot pools there:
    removed as the next `kvfabric server` would (`SlotPool.reclaim`: only pools no live server holds). The strays of
    other programs the tests stopped (STRAY_PREFIXES) that appeared during this run and no live process uses go too."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # once, in the controlling process
        return
    if MADE_CHILD_TMP:
        shutil.rmtree(os.environ[CHILD_TMP_VAR], ignore_errors=True)
    if not os.path.isdir(SHM):
        return
    before = getattr(session.config, "kvfabric_shm_before", None)
    if before is not None:
        new = [name for name in set(os.listdir(SHM)) - before if name.startswith(STRAY_PREFIXES)]
        used = _in_use(SHM) if new else set()
        for name in new:
            path = os.path.join(SHM, name)
            if path not in used:
                try:
                    os.unlink(path)
                except OSError:
                    pass
    try:
        from kvfabric.cache.remote.pool import SlotPool
    except ImportError:  # pragma: no cover - a venv without kvfabric's deps
        return
    SlotPool.reclaim(SHM)
