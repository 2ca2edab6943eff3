#!/usr/bin/env bash
# Run HERE (a machine with pip's registry), before a GPU check: the binary wheels of kvfabric's small runtime
# dependencies that a bare GPU machine (CUDA torch + numpy, no network) lacks, for CPython 3.10-3.13 on x86-64 Linux,
# into .device-wheels/ (ignored by git). Then: device run with carry [".device-wheels"].
# Usage: bash scripts/device/fetch_wheels.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="$ROOT/.device-wheels"
mkdir -p "$DEST"
for version in 3.10 3.11 3.12 3.13; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --python-version "$version" \
    -d "$DEST" xxhash blake3 pyyaml
done
python3 -m pip download --quiet --no-deps -d "$DEST" prometheus-client
ls "$DEST"
