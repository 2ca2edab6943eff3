"""The README's layer diagram, enforced: import-linter's `layers` contract in pyproject.toml must hold for src/.

The second test proves the check can fail: a copy of the package with one upward import (a tier importing the
engine) must break the contract, and the report must name that import.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(src: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(src))
    return subprocess.run([str(LINT), "--no-cache", "--no-logo", "--config", str(ROOT / "pyproject.toml")],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_imports_point_down_only():
    result = _lint(ROOT / "src", ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "kvfabric", src / "kvfabric", ignore=shutil.ignore_patterns("__pycache__"))
    cpu = src / "kvfabric" / "tiers" / "cpu.py"
    cpu.write_text(cpu.read_text() + "\nfrom kvfabric.engine import CacheEngine  # noqa: E402,F401\n")
    result = _lint(src, tmp_path)
    assert result.returncode != 0
    assert "kvfabric.tiers.cpu -> kvfabric.engine" in result.stdout
