"""The test session's /dev/shm clean-up (tests/conftest.py): the strays of programs the tests stopped that appeared
during the session go, unless a live process still holds them; what was there before the session stays."""
from __future__ import annotations

import os
import uuid
from types import SimpleNamespace

import pytest

from tests import conftest


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_session_end_removes_its_strays_and_keeps_held_and_older_ones(monkeypatch):
    tag = uuid.uuid4().hex[:8]
    older, stray, held, other = (f"/dev/shm/{name}" for name in
                                 (f"psm_kvf{tag}a", f"psm_kvf{tag}b", f"sem.mp-kvf{tag}", f"kvf-not-a-stray-{tag}"))
    open(older, "w").close()
    session = SimpleNamespace(config=SimpleNamespace(kvfabric_shm_before=set(os.listdir("/dev/shm"))))
    for path in (stray, held, other):
        open(path, "w").close()
    holder = open(held)  # a live process (this one) holds it: kept
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # the controlling process's part
    try:
        conftest.pytest_sessionfinish(session, 0)
        assert not os.path.exists(stray)
        assert os.path.exists(held) and os.path.exists(older) and os.path.exists(other)
    finally:
        holder.close()
        for path in (older, stray, held, other):
            if os.path.exists(path):
                os.unlink(path)
