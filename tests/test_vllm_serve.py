"""`vllm serve` with KVFabricConnector, end to end over HTTP: start the server as a process on 127.0.0.1, ask it
with the `openai` client, stop it, start a fresh one on the same cache, ask again: the second server answers
from kvfabric's disk tier (its own prefix cache is empty) with the same greedy text.

Needs vllm and openai (the .venv-vllm venv; skips otherwise) and the SmolLM2 model (ensure_model).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kvfabric.bench.vllm_server import VllmServer, free_port

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")


def _model() -> str:
    from tests.test_vllm_connector import _model_dir

    return _model_dir()


def _serve(model: str, cache: Path, stats: Path, log: Path) -> VllmServer:
    port = free_port()
    extra = {"chunk_size": 256, "tiers": ["cpu", "disk"], "disk": {"path": str(cache)}, "stats_path": str(stats)}
    transfer = {"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric.connectors.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": extra}
    argv = [str(Path(sys.executable).parent / "vllm"), "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(transfer)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")}
    return VllmServer(argv, port, log, env)


def _ask(server: VllmServer, prompt: str) -> tuple[str, int, int]:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=600)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    details = reply.usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details is not None else 0
    return reply.choices[0].text, cached, reply.usage.prompt_tokens


@pytest.mark.slow
def test_vllm_serve_restart_answers_from_kvfabric(tmp_path):
    model = _model()
    prompt = "The lighthouse keeper logged the weather, the ships and the lamp oil every night. " * 40 + \
        "\nQuestion: what did the keeper log?\nAnswer:"
    stats = tmp_path / "stats.json"
    with _serve(model, tmp_path / "cache", stats, tmp_path / "serve1.log") as first:
        first.wait_ready()
        text1, cached1, num_prompt = _ask(first, prompt)
    assert cached1 == 0  # a cold server with an empty cache
    chunks = list((tmp_path / "cache").glob("??/*.kvc"))
    assert len(chunks) == num_prompt // 256 >= 2  # every whole chunk stored (and flushed on the graceful shutdown)
    with _serve(model, tmp_path / "cache", stats, tmp_path / "serve2.log") as second:
        second.wait_ready()
        text2, cached2, _ = _ask(second, prompt)
    assert text2 == text1
    assert cached2 >= 256 * len(chunks) - 1  # the whole chunks of the prompt came from kvfabric's disk tier
    counters = json.loads(stats.read_text())["connector"]
    assert counters["loaded_tokens"] >= 256 and counters.get("bytes_loaded.disk", 0) > 0
