"""File modes with real Unix users (slow; needs root to switch users and the two system users that
`scripts/setup.sh --test` makes). As root every mode check passes, so these run as the unprivileged users:

- the mode tests themselves (tests/test_permissions.py) run as kvfabric-test-a;
- user A stores a prompt's chunks (disk tier) and a chunk in a shm pool; user B can neither list A's cache folder,
  read a chunk file, open A's pool, nor point its own cache at A's folder (one line, no traceback).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USERS = ("kvfabric-test-a", "kvfabric-test-b")
# the venv's interpreter may live under /root (0700): another user runs the system's Python 3.11 with the venv's
# packages and the checkout's source on its path
SITE = next(iter(sorted((ROOT / ".venv" / "lib").glob("python3.*/site-packages"))), None)
PYTHON = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/usr/local/bin")


def _ready() -> str | None:
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        return "needs root and runuser to act as the test users"
    for user in USERS:
        if subprocess.run(["id", user], capture_output=True).returncode:
            return f"no user {user} (scripts/setup.sh --test makes it)"
    if PYTHON is None or SITE is None:
        return "no system Python of this version, or no .venv"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_ready() is not None, reason=str(_ready()))]


def as_user(user: str, code: str, home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {"HOME": str(home), "KVFABRIC_HOME": str(home / "kvfabric"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}:{SITE}", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(["runuser", "-u", user, "--", "env", "-i", *[f"{k}={v}" for k, v in env.items()],
                           PYTHON, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=600,
                          cwd=home)
    if check:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.fixture
def homes(tmp_path_factory):
    base = Path(f"/tmp/kvf-users-{uuid.uuid4().hex[:8]}")
    base.mkdir(mode=0o755)
    base.chmod(0o755)  # both users pass through it; each makes its own home inside
    homes = {}
    for user in USERS:
        home = base / user
        home.mkdir()
        shutil.chown(home, user, user)
        home.chmod(0o755)  # a home others may enter: kvfabric's own folders must still keep them out
        homes[user] = home
    yield homes
    shutil.rmtree(base, ignore_errors=True)


def test_the_mode_tests_pass_as_an_unprivileged_user(homes):
    home = homes["kvfabric-test-a"]
    done = as_user("kvfabric-test-a", """
        import sys, pytest
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", sys.argv[1], "--basetemp",
                              sys.argv[2], sys.argv[1] + "/tests/test_permissions.py"]))
        """, home, str(ROOT), str(home / "pytest"), check=False)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


def test_a_second_user_cannot_read_the_first_users_cache(homes):
    a, b = homes["kvfabric-test-a"], homes["kvfabric-test-b"]
    pool = f"users-{uuid.uuid4().hex[:8]}"
    stored = as_user("kvfabric-test-a", """
        import sys, torch
        from kvfabric import CacheEngine, Config, KVLayout
        from kvfabric.tiers.shm import ShmTier
        layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")
        with CacheEngine(Config(chunk_size=16, tiers=("disk",)), layout, "m") as engine:
            assert engine.store(list(range(32)), torch.randn(layout.shape(32))) == 2
            engine.flush()
            print(engine.keys(list(range(32)))[0].hex())
        shm = ShmTier(sys.argv[1], 1 << 20)
        assert shm.put(b"k" * 32, b"secret prompt bytes")
        shm.close()
        """, a, pool)
    key = stored.stdout.split()[-1]
    chunks = a / "kvfabric" / "chunks"
    chunk_file = chunks / key[:2] / f"{key}.kvc"
    assert chunk_file.is_file()
    denied = as_user("kvfabric-test-b", """
        import os, sys
        from pathlib import Path
        chunks, chunk_file, pool = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
        for what, attempt in (("list", lambda: os.listdir(chunks)), ("read", lambda: chunk_file.read_bytes()),
                              ("pool", lambda: open(pool, "rb").read(16))):
            try:
                attempt()
                print(what, "READABLE")
            except PermissionError:
                print(what, "denied")
        """, b, str(chunks), str(chunk_file), f"/dev/shm/kvfabric-{pool}")
    assert denied.stdout.split() == ["list", "denied", "read", "denied", "pool", "denied"], denied.stdout
    pointed = as_user("kvfabric-test-b", """
        import sys
        from kvfabric.apps.cli import main
        main(["cache", "stats"])
        """, b, check=False)  # B's own cache: fine
    assert pointed.returncode == 0, pointed.stderr[-2000:]
    cross = subprocess.run(["runuser", "-u", "kvfabric-test-b", "--", "env", "-i", f"HOME={b}",
                            f"KVFABRIC_HOME={b / 'kvfabric'}", f"KVFABRIC_DISK__PATH={chunks}",
                            f"PYTHONPATH={ROOT / 'src'}:{SITE}", PYTHON, "-m", "kvfabric.apps.cli", "cache", "stats"],
                           capture_output=True, text=True, timeout=300, cwd=b)
    assert cross.returncode != 0 and "Traceback" not in cross.stderr, cross.stderr[-2000:]
    (line,) = cross.stderr.strip().splitlines()
    assert str(chunks) in line or "ermission" in line
    os.unlink(f"/dev/shm/kvfabric-{pool}")
    os.unlink(f"/dev/shm/kvfabric-{pool}.lock")
