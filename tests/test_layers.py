"""The README's layer diagram, enforced: import-linter's contracts in pyproject.toml must hold for src/ (the
folders as layers, the layers inside the cache, the connectors through the cache protocol, the runtime apart from
research and benchmarks, RemoteCache beside the in-process engine).

The other tests prove the checks can fail: a copy of the package with one upward import (a tier importing the
engine), or with a runtime module importing research code, must break its contract, and the report must name that
import.
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
    assert "5 kept, 0 broken" in result.stdout


def _copy_with(tmp_path: Path, module: str, line: str) -> Path:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "kvfabric", src / "kvfabric", ignore=shutil.ignore_patterns("__pycache__"))
    path = src / "kvfabric" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402,F401\n")
    return src


def test_an_upward_import_breaks_the_contract(tmp_path):
    src = _copy_with(tmp_path, "tiers/cpu.py", "from kvfabric.cache.engine import CacheEngine")
    result = _lint(src, tmp_path)
    assert result.returncode != 0
    assert "kvfabric.tiers.cpu -> kvfabric.cache.engine" in result.stdout


def test_a_runtime_module_importing_research_breaks_the_split(tmp_path):
    # kvfabric.data is in no layer: only the forbidden contract catches it
    src = _copy_with(tmp_path, "data/genres.py", "from kvfabric.research.belady import Belady")
    result = _lint(src, tmp_path)
    assert result.returncode != 0
    assert "the runtime imports no research or benchmark code BROKEN" in result.stdout
    assert "kvfabric.data.genres -> kvfabric.research.belady" in result.stdout


def test_remote_cache_built_on_the_engine_breaks_the_contract(tmp_path):
    src = _copy_with(tmp_path, "cache/remote/client.py", "from kvfabric.cache.engine import CacheEngine")
    result = _lint(src, tmp_path)
    assert result.returncode != 0
    assert "RemoteCache meets the KVCache protocol without the in-process engine BROKEN" in result.stdout


def test_a_connector_reaching_into_the_engine_breaks_the_contract(tmp_path):
    src = _copy_with(tmp_path, "connectors/sglang.py", "from kvfabric.cache.reads import ChunkReads")
    result = _lint(src, tmp_path)
    assert result.returncode != 0
    assert "kvfabric.connectors.sglang -> kvfabric.cache.reads" in result.stdout


def test_a_chunk_format_module_importing_the_cache_breaks_the_layers(tmp_path):
    src = _copy_with(tmp_path, "kv/shapes.py", "from kvfabric.cache.protocol import KVCache")
    result = _lint(src, tmp_path)
    assert result.returncode != 0
    assert "kvfabric.kv.shapes -> kvfabric.cache.protocol" in result.stdout
