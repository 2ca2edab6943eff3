"""The cache protocol, both caches and the connectors type-check: mypy (configured in pyproject.toml's [tool.mypy])
finds nothing, and no `# type: ignore` hides a mismatch in the connectors. The other test shows the check can fail:
a connector that calls the cache with an argument the protocol does not take is reported."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mypy(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=900)


def test_the_cache_and_the_connectors_type_check():
    result = _mypy(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


def test_no_type_ignore_in_the_connectors():
    found = [f"{path.relative_to(ROOT)}:{i}" for path in (ROOT / "src/kvfabric/connectors").rglob("*.py")
             for i, line in enumerate(path.read_text().splitlines(), 1) if "type: ignore" in line]
    assert not found, found


def test_a_call_outside_the_protocol_is_reported(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "kvfabric", src / "kvfabric", ignore=shutil.ignore_patterns("__pycache__"))
    loads = src / "kvfabric" / "connectors" / "vllm" / "loads.py"
    text = loads.read_text()
    assert "scratch=staging)" in text
    loads.write_text(text.replace("scratch=staging)", "scratch=staging, check_later=True)", 1))
    result = _mypy(tmp_path, "--cache-dir", str(tmp_path / ".mypy_cache"))
    assert result.returncode != 0
    assert 'Unexpected keyword argument "check_later"' in result.stdout
