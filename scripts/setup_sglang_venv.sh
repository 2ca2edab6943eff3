#!/usr/bin/env bash
# Create .venv-sglang: a separate Python 3.11 venv with sglang (pinned, installed --no-deps: SGLang 0.5.23 wants
# CUDA, torch 2.14.1 and kernels that do not run on this CPU) plus exactly what its HiCache storage interface
# (sglang.srt.mem_cache.hicache_storage, storage.StorageBackendFactory) imports, the Mooncake client and kvfabric
# (editable, with its core dependencies; torch held at the CPU build). The kvfabric HiCache backend is tested there.
# Idempotent: does nothing when the venv already imports all of it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVFABRIC_SGLANG_VENV:-$ROOT/.venv-sglang}"
PY="${PYTHON:-python3.11}"
SGLANG_SPEC="${SGLANG_SPEC:-sglang==0.5.23}"
CHECK="from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage
from sglang.srt.mem_cache.storage import StorageBackendFactory
import mooncake.store, kvfabric, kvfabric.cache.builder"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$CHECK" >/dev/null 2>&1; then
  echo "setup_sglang_venv: $VENV already has sglang's storage interface, mooncake and kvfabric; nothing to do"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# torch pinned to the CPU build kvfabric uses everywhere (a plain 'torch' pulls a multi-GB CUDA build)
"${PIP[@]}" install -q torch==2.13.0
"${PIP[@]}" install -q --no-deps "$SGLANG_SPEC"
# What `import sglang.srt.mem_cache.hicache_storage` pulls in (sglang/__init__ and srt/utils/common.py import these
# at module level; triton among them, although nothing here runs a kernel). Found by importing until it worked.
"${PIP[@]}" install -q orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 triton==3.9.0 pillow==13.0.0 \
  starlette==1.10.0 msgspec==0.23.0 pydantic==2.14.4 pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1 aiohttp==3.14.5
"${PIP[@]}" install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
# kvfabric itself, editable, with its core dependencies (the backend builds its cache with kvfabric.cache.builder), torch
# held at the build above by the constraints; under a lock: setup.sh builds the venvs at once, and an editable build
# writes into the checkout
"${PIP[@]}" install -q "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
flock "${TMPDIR:-/tmp}/kvfabric-editable.lock" "${PIP[@]}" install -q -c "$ROOT/scripts/constraints.txt" -e "$ROOT"

"$VENV/bin/python" - <<PY
$CHECK
import sglang, torch
print("setup_sglang_venv: sglang", sglang.__version__, "torch", torch.__version__, "kvfabric ok")
PY
