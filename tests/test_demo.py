"""The main job, end to end: `kvfabric demo` on the real model, as a user runs it (a separate process)."""
from __future__ import annotations

import os
import re
import subprocess
import sys


def test_demo_reuses_the_document_in_memory_and_across_processes(tmp_path):
    env = dict(os.environ, KVFABRIC_DISK__PATH=str(tmp_path / "chunks"), COLUMNS="200")
    proc = subprocess.run([sys.executable, "-m", "kvfabric.cli", "demo"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = re.findall(r"(cold|warm \(cpu\)|warm \(disk\)) \| reused\s+(\d+)/(\d+) tokens \| TTFT\s+([\d.]+) s", proc.stdout)
    assert [phase for phase, *_ in lines] == ["cold", "warm (cpu)", "warm (cpu)"] + ["warm (disk)"] * 3
    cold, *warm = lines
    assert int(cold[1]) == 0
    for _, hit, total, _ in warm:
        assert int(total) > 3000 and int(hit) >= int(total) - 512  # the whole document but its last chunk
    answers = re.findall(r"\| A: (.*)", proc.stdout)
    assert answers[:3] == answers[3:]  # KV from disk in a new process gives the same answers as before
    assert "warm from disk, new process" in proc.stdout
