"""Every code block of README.md and of every documentation page (docs/*.md; the generated reference pages hold
none) runs as written, so an example can never drift from what works. A block that appears on several pages
(the README's quick starts are also on their pages) is one block here.

Blocks are the fenced ones with a language; blocks without one are output samples and diagrams, not code.
- python: run as a script in a fresh directory with a private $KVFABRIC_HOME (the set-up models linked in). A
  block that imports vllm or openai runs in the vLLM venv (skipped where that venv is absent); a block that needs
  a running server (it uses `OpenAI(base_url=...)`) runs against the README's own `vllm serve` block.
- bash: the `vllm serve` block is started as written (only the port replaced by a free one) and the client
  block is run against it. The `make demo` / `make test` block is checked with `make -n` (dry run: the targets
  exist and expand); running it for real is what `.ci/run` does on every submission. The SGLang launch block
  (SGLang runs on a GPU only) is checked by what can drift: its extra config names the backend class that exists,
  and its kvfabric keys load as a kvfabric config.
- yaml: loaded as kvfabric's config file.
Real-model and vLLM blocks carry the slow marker.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvfabric.bench.vllm_server import VllmServer, free_port
from kvfabric.config import Config

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
README_PORT = "8000"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks() -> list[tuple[str, str]]:
    found = [(m.group(1), m.group(2)) for page in pages() for m in FENCE.finditer(page.read_text())]
    return list(dict.fromkeys(found))  # in order, each distinct block once


def _by(predicate) -> list[str]:
    return [code for lang, code in blocks() if predicate(lang, code)]


def _needs_vllm(code: str) -> bool:
    return bool(re.search(r"^\s*(from|import) (vllm|openai)\b", code, re.M))


def _needs_model(code: str) -> bool:
    return "HFEngine(" in code or "load_model(" in code


def _vllm_python() -> Path | None:
    for candidate in (Path(sys.executable), ROOT / ".venv-vllm" / "bin" / "python",
                      Path("/work/main/.venv-vllm/bin/python")):
        if candidate.exists() and subprocess.run([str(candidate), "-c", "import vllm, openai"],
                                                 capture_output=True).returncode == 0:
            return candidate
    return None


@pytest.fixture()
def home(tmp_path) -> dict[str, str]:
    """Environment for a block: a private KVFABRIC_HOME whose models/ is the set-up one, and this checkout first
    on PYTHONPATH."""
    kv_home = tmp_path / "kvhome"
    kv_home.mkdir()
    models = Path(os.environ.get("KVFABRIC_HOME", Path.home() / ".cache" / "kvfabric")) / "models"
    (kv_home / "models").symlink_to(models.resolve() if models.exists() else models)
    env = {**os.environ, "KVFABRIC_HOME": str(kv_home), "VLLM_CPU_OMP_THREADS_BIND":
           os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return env


def _run_python(code: str, python: Path | str, env: dict[str, str], cwd: Path, timeout: int = 900) -> str:
    script = cwd / "block.py"
    script.write_text(code)
    proc = subprocess.run([str(python), str(script)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    causes = "\n".join(line for line in output.splitlines() if re.search(r"\w(Error|Exception): ", line))
    assert proc.returncode == 0, f"README block failed:\n{code}\n--- errors:\n{causes[-3000:]}\n---\n{output[-4000:]}"
    return proc.stdout


def test_readme_blocks_are_all_covered():
    langs = [lang for lang, _ in blocks()]
    assert set(langs) <= {"", "bash", "python", "yaml"}, langs
    serve = _by(lambda lang, code: lang == "bash" and "vllm serve" in code)
    assert len(serve) == 1 and f"--port {README_PORT}" in serve[0]
    assert len(_by(lambda lang, code: lang == "bash")) == 3  # make demo/test, vllm serve, sglang launch_server
    assert len(_by(lambda lang, code: lang == "python" and "OpenAI(" in code)) == 1


def test_make_block_expands():
    (code,) = _by(lambda lang, code: lang == "bash" and code.startswith("make "))
    targets = re.findall(r"^make (\w+)", code, re.M)
    assert targets == ["demo", "test"]
    proc = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_sglang_block_names_a_real_backend():
    (code,) = _by(lambda lang, code: lang == "bash" and "sglang.launch_server" in code)
    extra = json.loads(re.search(r"--hicache-storage-backend-extra-config '(.*?)'", code, re.S).group(1))
    module = ROOT / "src" / Path(*extra["module_path"].split(".")).with_suffix(".py")
    classes = {node.name for node in ast.walk(ast.parse(module.read_text())) if isinstance(node, ast.ClassDef)}
    assert extra["class_name"] in classes
    fields = {field.name for field in dataclasses.fields(Config)}
    config = Config.load(None).merged({key: value for key, value in extra.items() if key in fields})
    assert tuple(config.tiers) == tuple(extra["tiers"])


def test_yaml_block_is_a_valid_config(tmp_path):
    (code,) = _by(lambda lang, code: lang == "yaml")
    path = tmp_path / "kvfabric.yaml"
    path.write_text(code)
    config = Config.from_yaml(path)
    assert config.chunk_size == 256 and tuple(config.tiers[:2]) == ("cpu", "disk")


def test_plain_python_blocks(home, tmp_path):
    """The blocks that need neither a model nor vLLM (the CacheEngine API)."""
    fast = _by(lambda lang, code: lang == "python" and not _needs_vllm(code) and not _needs_model(code))
    assert fast
    for code in fast:
        _run_python(code, sys.executable, home, tmp_path)


@pytest.mark.slow
def test_model_python_blocks(home, tmp_path):
    """The reference engine, CacheBlend and FlexiCache blocks, on the real SmolLM2 model."""
    model_blocks = _by(lambda lang, code: lang == "python" and not _needs_vllm(code) and _needs_model(code))
    assert len(model_blocks) == 3
    printed = {code: _run_python(code, sys.executable, home, tmp_path).strip().splitlines() for code in model_blocks}
    # what each block shows: the reference engine's answer twice, the second from the cache; CacheBlend's answer
    # with the tokens it reused; FlexiCache's resident share
    (engine,) = [lines for code, lines in printed.items() if "HFEngine(" in code and "kv_budget" not in code]
    first, second = (re.match(r"\s*(\d+) tokens from the cache, TTFT [\d.]+ s: '(.+)'$", line) for line in engine)
    assert first and second and first[1] == "0" and int(second[1]) > 0 and first[2].strip() and second[2] == first[2]
    (blend,) = [lines for code, lines in printed.items() if "Blender(" in code]
    reused = re.match(r"reused (\d+) of (\d+) tokens: '(.+)'$", blend[-1])
    assert reused and 0 < int(reused[1]) < int(reused[2]) and reused[3].strip()


@pytest.mark.slow
def test_vllm_offline_block(home, tmp_path):
    python = _vllm_python()
    if python is None:
        pytest.skip("no Python with vllm and openai (scripts/setup_vllm_venv.sh)")
    (code,) = _by(lambda lang, code: lang == "python" and _needs_vllm(code) and "OpenAI(" not in code)
    assert 'if __name__ == "__main__":' in code
    out = _run_python(code, python, home, tmp_path)
    assert "saved_tokens" in out  # the request's kvfabric stats were printed


@pytest.mark.slow
def test_vllm_serve_and_client_blocks(home, tmp_path):
    python = _vllm_python()
    if python is None:
        pytest.skip("no Python with vllm and openai (scripts/setup_vllm_venv.sh)")
    (serve,) = _by(lambda lang, code: lang == "bash" and "vllm serve" in code)
    (client,) = _by(lambda lang, code: lang == "python" and "OpenAI(" in code)
    port = str(free_port())
    bin_dir = str(Path(python).parent)
    env = {**home, "PATH": os.pathsep.join([bin_dir, home.get("PATH", "")])}  # vllm and kvfabric of that venv
    assert shutil.which("vllm", path=env["PATH"]) and shutil.which("kvfabric", path=env["PATH"])
    script = tmp_path / "serve.sh"
    script.write_text("set -e\n" + serve.replace(f"--port {README_PORT}", f"--port {port}"))
    outputs = []
    for attempt in ("serve1", "serve2"):  # the second server starts with an empty prefix cache
        with VllmServer(["bash", str(script)], int(port), tmp_path / f"{attempt}.log", env) as server:
            server.wait_ready()
            outputs.append(_run_python(client.replace(f":{README_PORT}/", f":{port}/"), python, env, tmp_path))
    cached = [int(out.split()[0]) for out in outputs]
    chunks = list((Path(home["KVFABRIC_HOME"]) / "chunks").glob("??/*.kvc"))
    # the prompt's whole chunks and its tail (a partial chunk), stored (and flushed on the first server's shutdown)
    assert len(chunks) >= 3
    # the restarted server (empty prefix cache) loaded every one of them from kvfabric's disk tier: the whole chunks,
    # then a tail of at least one step (64 tokens)
    assert cached[0] == 0 and cached[1] >= 256 * (len(chunks) - 1) + 64, outputs
    assert f"after the restart, the same text and `{cached[1]}`" in (ROOT / "README.md").read_text()  # as it says
    assert outputs[0].split(":", 1)[1] == outputs[1].split(":", 1)[1]  # same greedy text
