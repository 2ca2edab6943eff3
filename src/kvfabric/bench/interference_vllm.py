"""`kvfabric bench interference --vllm`: the miss-path overhead of `mode: server` in the vLLM connector, in paired
runs (issue target: <= 3 % of cold TTFT).

One real vLLM engine (CPU, fp32, the reference SmolLM2) with KVFabricConnector in `mode: server`, talking to a
`kvfabric server` this process starts. Per pair, two cold prompts of the same size that share no prefix: one
with kvfabric switched off for that request (`kv_transfer_params`), one with it on (the scheduler's LOOKUP, the
worker's leased-slot gathers and commits); the order alternates between pairs so that drift cancels. Reported:
the median TTFT of each side and the median, min and max of the per-pair overheads. TTFT = wall time of
`generate(max_tokens=1)`. The engine runs in the Python that has vLLM (`--vllm-python`, default .venv-vllm).
Placement as in set-up (c): the engine's threads on `engine_cpu`, the server on `server_cpu` (a server shares
a host's spare cores, not the engine's); on a one-core machine both share it.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHUNK = 256
MODEL_ID = "kvfabric-bench-interference"


def run(python: str | None = None, num_tokens: int = 4096, num_pairs: int = 5, timeout: float = 1800,
        engine_cpu: int = 0, server_cpu: int = 1) -> dict:
    from kvfabric.bench.interference import start_server
    from kvfabric.bench.vllm import find_python, make_prompts
    from kvfabric.bench.vllm_server import private_tmp
    from kvfabric.engines.model import ensure_model
    python = find_python(python)
    model = str(ensure_model())
    with tempfile.TemporaryDirectory(prefix="kvfabric-interference-vllm-") as tmp:
        prompts = Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps(make_prompts(model, [num_tokens], repeats=num_pairs)))  # disjoint texts
        server = {"tiers": ["cpu"], "chunk_size": CHUNK, "server": {
            "socket": f"{tmp}/server.sock", "pool_capacity": "256MiB", "slot_bytes": "12MiB"}}
        if server_cpu not in os.sched_getaffinity(0):
            server_cpu = engine_cpu
        proc = start_server(server, Path(tmp) / "server.yaml", server_cpu)
        spec = {"model": model, "prompts": str(prompts), "tokens": num_tokens, "num_pairs": num_pairs,
                "out": f"{tmp}/result.json",
                "config": {"chunk_size": CHUNK, "model_id": MODEL_ID, "mode": "server",
                           "server": {"socket": server["server"]["socket"], "timeout_s": 2.0}}}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "VLLM_CPU_OMP_THREADS_BIND": str(engine_cpu)}
        log = Path(tempfile.gettempdir()) / f"kvfabric-interference-vllm-{os.getpid()}.log"  # kept: vLLM's are long
        try:
            with open(log, "w") as out, private_tmp(env) as child_env:
                done = subprocess.run([python, "-m", "kvfabric.bench.interference_vllm", f"{tmp}/spec.json"],
                                      stdout=out, stderr=subprocess.STDOUT, env=child_env, timeout=timeout)
            if done.returncode or not Path(spec["out"]).exists():
                raise RuntimeError(f"vLLM engine failed (rc={done.returncode}); its log: {log}")
            pairs = json.loads(Path(spec["out"]).read_text())["pairs"]
        finally:
            proc.terminate()
            proc.wait(60)
    overheads = [p["on_s"] / p["off_s"] - 1 for p in pairs]
    median = statistics.median(overheads)
    return {"setup": "vllm_miss", "link_mbps": None, "engine_cpu": engine_cpu, "server_cpu": server_cpu,
            "ttft_s": statistics.median(p["on_s"] for p in pairs),
            "tokens": num_tokens, "num_pairs": len(pairs), "off_s": statistics.median(p["off_s"] for p in pairs),
            "miss_overhead_paired": median, "miss_overhead_paired_min": min(overheads),
            "miss_overhead_paired_max": max(overheads), "overheads": overheads,
            "on_cached_tokens": sum(p["hit"] for p in pairs),
            "target_met": median <= 0.03}


def pair_names(num_tokens: int, num_pairs: int) -> list[tuple[str, str]]:
    """The (off, on) prompt of each pair, as make_prompts([num_tokens], repeats=num_pairs) names them."""
    return [(f"{num_tokens}/off{i}", f"{num_tokens}/on{i}" if i else str(num_tokens)) for i in range(num_pairs)]


def _engine(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvfabric.connectors.vllm import kv_transfer_config
    prompts = json.loads(Path(spec["prompts"]).read_text())
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=8192, seed=0,
              kv_cache_memory_bytes=512 << 20, max_num_seqs=2, kv_transfer_config=kv_transfer_config(spec["config"]))
    on = SamplingParams(temperature=0.0, max_tokens=1)
    off = SamplingParams(temperature=0.0, max_tokens=1,
                         extra_args={"kv_transfer_params": {"kvfabric": {"load": False, "store": False}}})

    def ttft(tokens: list[int], params: SamplingParams) -> tuple[float, int]:
        started = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        return time.perf_counter() - started, int(out[0].num_cached_tokens or 0)

    ttft(prompts["warmup"], on)
    ttft(prompts["warmup"][::-1], off)
    pairs = []
    for i, (off_name, on_name) in enumerate(pair_names(spec["tokens"], spec["num_pairs"])):
        order = (("off", off_name), ("on", on_name))
        got = {name: ttft(prompts[key], on if name == "on" else off) for name, key in (order if i % 2 == 0
                                                                                         else order[::-1])}
        pairs.append({"off_s": got["off"][0], "on_s": got["on"][0], "hit": got["on"][1]})
        print(f"pair {i}: {pairs[-1]}", flush=True)
    return {"pairs": pairs}


if __name__ == "__main__":
    params = json.loads(Path(sys.argv[1]).read_text())
    result = _engine(params)
    Path(params["out"]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine-core process would keep a plain exit waiting
