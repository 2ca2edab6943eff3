"""`kvfabric bench lookup`, small: every authority answers every rank's stored shares as a hit and a new prompt as
a miss, through real rank processes, a real `kvfabric server` and real Unix sockets; the rows carry the fields
the docs name; a --tp the bench model cannot split is one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfabric.apps.cli", "bench", "lookup", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


@pytest.mark.slow  # several processes
def test_every_authority_finds_every_ranks_share_and_misses_a_new_prompt() -> None:
    proc = _bench("--tp", "1,2", "--tokens", "1024", "--samples", "3", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {(r["tp"], r["case"], r["authority"]) for r in rows} == {
        (tp, case, a) for tp in (1, 2) for case in ("hit", "miss")
        for a in ("ranks", "ranks_serial", "server_ranks", "server_direct")}
    for row in rows:
        assert row["chunks"] == (4 if row["case"] == "hit" else 0), row
        assert 0 < row["rtt_s"] and 0 < row["lookup_s"] <= row["lookup_p99_s"]
        assert row["vs_rtt"] == row["lookup_s"] / row["rtt_s"] and row["tokens"] == 1024


def test_a_tp_the_bench_model_cannot_split_is_one_line() -> None:
    proc = _bench("--tp", "3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--tp: each of 1, 2, 4, 8" in proc.stderr
