"""The prepared GPU check (scripts/device/gpu_paged_copy.sh) on a machine without a GPU: exit 3 and one JSON line
naming what is missing, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_says_what_is_missing_without_a_gpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}  # no nvidia-smi on this PATH
    result = subprocess.run(["bash", str(ROOT / "scripts/device/gpu_paged_copy.sh")], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    report = json.loads((tmp_path / "gpu_paged.jsonl").read_text())
    assert report == {"ok": False, "missing": "a GPU (nvidia-smi)"}
