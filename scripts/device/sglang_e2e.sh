#!/usr/bin/env bash
# End-to-end device check (a GPU machine): SGLang serving with HiCache and kvfabric's KVFabricStorage backend over the
# mooncake tier, all on loopback. NOT RUN YET: no GPU machine was lent when it was written (see README).
#
#   a private mooncake_master and a storage process lending the store its memory (the servers lend none: segment 0,
#   so what server A stored outlives it); server A (fresh) answers a long prompt and HiCache writes its pages
#   through kvfabric into the store; server A exits; server B (fresh GPU and host memory) gets the same prompt: its
#   prefix must come from the store (meta_info.cached_tokens covers all but the last page), same greedy text.
#
# Needs on the machine (nothing is downloaded: the device machine reaches no network): a CUDA build of sglang in
# $SGLANG_PYTHON (default python3) with mooncake-transfer-engine(-non-cuda) installed there, and a small HF model
# folder in $MODEL (e.g. Qwen2.5-0.5B-Instruct). kvfabric comes from this tree (PYTHONPATH=src).
# Writes $OUT/sglang_e2e.json (and the servers' logs); exit 0 only when every check passes, 3 when a prerequisite
# is missing. Usage: MODEL=/models/qwen2.5-0.5b OUT=/tmp/out bash scripts/device/sglang_e2e.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${SGLANG_PYTHON:-python3}"
OUT="${OUT:-$ROOT/out/device}"
MODEL="${MODEL:-}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export MC_TCP_BIND_ADDRESS=127.0.0.1   # the network rule: Mooncake clients advertise loopback only

missing() { echo "{\"ok\": false, \"missing\": \"$1\"}" > "$OUT/sglang_e2e.json"; echo "sglang_e2e: missing: $1"; exit 3; }
command -v nvidia-smi >/dev/null && nvidia-smi -L || missing "a GPU (nvidia-smi)"
"$PY" -c "import torch, sglang; assert torch.cuda.is_available()" 2>/dev/null || missing "sglang with CUDA torch in $PY"
"$PY" -c "import mooncake.store, kvfabric.connectors.sglang" 2>/dev/null || missing "mooncake + kvfabric importable in $PY"
[ -n "$MODEL" ] && [ -d "$MODEL" ] || missing "a model folder in \$MODEL"
MASTER_BIN="$(dirname "$(command -v "$PY")")/mooncake_master"
[ -x "$MASTER_BIN" ] || MASTER_BIN="$(command -v mooncake_master)" || missing "mooncake_master"

exec "$PY" - "$MODEL" "$OUT" "$MASTER_BIN" <<'PY'
import json, os, socket, subprocess, sys, time, urllib.request

model, out, master_bin = sys.argv[1:4]
procs = []

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def http(url, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()

def wait(url, proc, seconds=900):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            return http(url, timeout=5)
        except OSError:
            time.sleep(1)
    raise TimeoutError(url)

rpc, meta, metrics = port(), port(), port()
master = subprocess.Popen([master_bin, "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                           f"--http_metadata_server_port={meta}", "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                           "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"],
                          stdout=open(f"{out}/master.log", "wb"), stderr=subprocess.STDOUT)
procs.append(master)
# the storage process: the store's memory, outliving server A (the servers lend none)
storage = subprocess.Popen([sys.executable, "-c", f"""
import signal
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1:{port()}", "http://127.0.0.1:{meta}/metadata", 8 << 30, 64 << 20, "tcp", "", "127.0.0.1:{rpc}") == 0
print("ready", flush=True)
signal.sigwait([signal.SIGTERM])
s.close()
"""], stdout=subprocess.PIPE, text=True)
procs.append(storage)

def server(name):
    p = port()
    extra = {"backend_name": "kvfabric", "module_path": "kvfabric.connectors.sglang", "class_name": "KVFabricStorage",
             "interface_v1": 1, "model_id": "e2e", "tiers": ["mooncake"],
             "mooncake": {"master": f"127.0.0.1:{rpc}", "metadata_url": f"http://127.0.0.1:{meta}/metadata",
                          "metrics_url": f"http://127.0.0.1:{metrics}", "segment": 0, "timeout_s": 5.0}}
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1", "--port", str(p),
           "--page-size", "64", "--mem-fraction-static", "0.6", "--enable-hierarchical-cache", "--hicache-ratio", "2",
           "--hicache-write-policy", "write_through", "--hicache-storage-prefetch-policy", "wait_complete",
           "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra)]
    proc = subprocess.Popen(cmd, stdout=open(f"{out}/{name}.log", "wb"), stderr=subprocess.STDOUT)
    procs.append(proc)
    wait(f"http://127.0.0.1:{p}/health", proc)
    return proc, f"http://127.0.0.1:{p}"

def ask(url, prompt):
    start = time.perf_counter()
    r = json.loads(http(f"{url}/generate", {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 24}}))
    return r["text"], r["meta_info"].get("cached_tokens", 0), r["meta_info"].get("prompt_tokens", 0), time.perf_counter() - start

def our_keys():
    return [k for k in http(f"http://127.0.0.1:{metrics}/get_all_keys", timeout=10).split() if k.startswith("kvf:")]

result = {"ok": False}
try:
    wait(f"http://127.0.0.1:{metrics}/health", master, 60)
    assert storage.stdout.readline().strip() == "ready"
    prompt = " ".join(f"Line {i}: the lighthouse keeper logged wind, tide and {i % 7} passing ships." for i in range(220))
    a, url_a = server("server_a")
    text_a, cached_a, prompt_tokens, ttft_a = ask(url_a, prompt)
    deadline = time.monotonic() + 120
    while len(our_keys()) < prompt_tokens // 64 and time.monotonic() < deadline:
        time.sleep(1)  # write_through: pages reach the store in the background
    keys_after_a = len(our_keys())
    a.terminate(); a.wait(120)
    b, url_b = server("server_b")
    text_b, cached_b, _, ttft_b = ask(url_b, prompt)
    result = {"prompt_tokens": prompt_tokens, "pages_in_store_after_a": keys_after_a, "cached_tokens_a": cached_a,
              "cached_tokens_b": cached_b, "same_text": text_a == text_b, "seconds_a": round(ttft_a, 3),
              "seconds_b": round(ttft_b, 3), "text_a": text_a, "text_b": text_b}
    result["ok"] = (keys_after_a >= prompt_tokens // 64 and cached_b >= (prompt_tokens // 64 - 1) * 64
                    and text_a == text_b)
finally:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    with open(f"{out}/sglang_e2e.json", "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
sys.exit(0 if result.get("ok") else 1)
PY
