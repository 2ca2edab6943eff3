#!/usr/bin/env bash
# GPU check of the connector's data path for vLLM's GPU layouts (issue #35). NOT RUN YET: no GPU machine was lent
# when it was written (see README). Runs on a machine with CUDA torch and no vLLM (nothing is downloaded there):
# for every vLLM 0.32 KVCacheLayout, with K|V content and with MLA latents, a CUDA KV cache in that layout holding
# a 4k and an 8k-token prompt, saved through kvfabric's PagedMover (side stream, pinned staging) into the cpu and
# disk tiers and loaded back into other blocks (from memory, and by a fresh engine from disk); the values must
# match exactly.
# Prints and writes $OUT/gpu_paged.jsonl (kvfabric.bench.gpu_paged: gbps against a pinned D2H / H2D copy_ of the
# same bytes, ratio_vs_pinned_copy, exact, default_stream_blocked_ms). Exit 0 only when every row is exact;
# 3 when a prerequisite is missing.
# Before: bash scripts/device/fetch_wheels.sh here; then device run, carry [".device-wheels"]:
#   OUT=$OUT bash scripts/device/gpu_paged_copy.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${GPU_PYTHON:-python3}"
OUT="${OUT:-$ROOT/out/device}"
mkdir -p "$OUT"
missing() { echo "{\"ok\": false, \"missing\": \"$1\"}" > "$OUT/gpu_paged.jsonl"; echo "gpu_paged_copy: missing: $1"; exit 3; }
command -v nvidia-smi >/dev/null && nvidia-smi -L || missing "a GPU (nvidia-smi)"
"$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || missing "CUDA torch in $PY"
DEPS="$(mktemp -d)"
if [ -d "$ROOT/.device-wheels" ]; then
  "$PY" -m pip install --quiet --no-index --find-links "$ROOT/.device-wheels" --target "$DEPS" \
    xxhash blake3 pyyaml prometheus-client || missing "wheels for $("$PY" -V) in .device-wheels"
fi
export PYTHONPATH="$ROOT/src:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import kvfabric.bench.gpu_paged" || missing "kvfabric's dependencies (bash scripts/device/fetch_wheels.sh)"
set -o pipefail
PYTHONUNBUFFERED=1 "$PY" -m kvfabric.bench.gpu_paged --json "$@" | tee "$OUT/gpu_paged.jsonl"
