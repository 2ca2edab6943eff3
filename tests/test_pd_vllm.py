"""Prefill/decode disaggregation with two real `vllm serve` processes sharing KV through a shared-memory pool,
behind `kvfabric pd-proxy`: the decode instance loads the prompt's KV the prefill instance stored, and its
greedy answer equals a single colocated instance's; with the prefill instance SIGKILLed, the decode instance
computes the prompt itself and still answers the same; a new prefill instance loads a stored prompt's KV from
the pool (its prefix cache) instead of computing it.

Needs vllm (the .venv-vllm venv; skips otherwise) and the SmolLM2 model (ensure_model).
"""
from __future__ import annotations

import json
import os
import signal
import sys

import httpx
import pytest

from kvfabric.bench.pd import pd_extra, pool_name, start_instance
from kvfabric.bench.vllm_server import free_port
from kvfabric.pd.proxy import ProxyThread

pytest.importorskip("vllm")

PROMPTS = ["The lighthouse keeper logged the weather, the ships and the lamp oil every night. " * 20
           + "\nQuestion: what did the keeper log?\nAnswer:",
           "Rivers carry sediment from the mountains to the sea, building deltas over thousands of years. " * 16
           + "\nQuestion: what builds a delta?\nAnswer:",
           "A baker rises before dawn to knead the dough, shape the loaves and fire the oven. " * 18
           + "\nQuestion: when does the baker rise?\nAnswer:"]


def _ask(url: str, prompt: str, stream: bool = False) -> tuple[str, int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    with httpx.Client(base_url=url, timeout=600) as client:
        body["model"] = client.get("/v1/models").json()["data"][0]["id"]
        if not stream:
            reply = client.post("/v1/completions", json=body).json()
            details = reply["usage"].get("prompt_tokens_details") or {}
            return reply["choices"][0]["text"], int(details.get("cached_tokens") or 0)
        parts = []
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(parts), -1


@pytest.mark.slow
def test_pd_pair_answers_like_one_colocated_instance(tmp_path):
    from kvfabric.tiers.shm import ShmTier
    from tests.test_vllm_connector import _model_dir

    model = _model_dir()
    with start_instance(sys.executable, model, tmp_path, "colocated", "0-1") as colocated:
        colocated.wait_ready()
        expected = [_ask(f"http://127.0.0.1:{colocated.port}", prompt)[0] for prompt in PROMPTS]
    pool = pool_name()
    decode_stats = tmp_path / "decode.json"
    try:
        with start_instance(sys.executable, model, tmp_path, "prefill", "0", "kv_producer",
                            pd_extra(pool, tmp_path / "prefill.json", "256MiB")) as prefill, \
                start_instance(sys.executable, model, tmp_path, "decode", "1", "kv_consumer",
                               pd_extra(pool, decode_stats, "256MiB")) as decode:
            prefill.wait_ready()
            decode.wait_ready()
            with ProxyThread(prefill.base_url, decode.base_url, free_port()) as proxy:
                text, cached = _ask(proxy.url, PROMPTS[0])
                streamed, _ = _ask(proxy.url, PROMPTS[1], stream=True)
                stats = httpx.get(f"{proxy.url}/pd/stats").json()
                probe = ShmTier(pool, 256 << 20)
                pool_keys = probe.keys()
                probe.close()
                os.killpg(prefill.proc.pid, signal.SIGKILL)  # the prefill instance dies: decode recomputes
                prefill.proc.wait(30)
                after_kill, cached_after_kill = _ask(proxy.url, PROMPTS[2])
                failures = httpx.get(f"{proxy.url}/pd/stats").json().get("prefill_failures", 0)
            # a new prefill instance (its own cache empty): the pool is its prefix cache too
            with start_instance(sys.executable, model, tmp_path, "prefill2", "0", "kv_producer",
                                pd_extra(pool, tmp_path / "prefill2.json", "256MiB")) as prefill2:
                prefill2.wait_ready()
                with ProxyThread(prefill2.base_url, decode.base_url, free_port()) as proxy:
                    again, _ = _ask(proxy.url, PROMPTS[0])
            producer = json.loads((tmp_path / "prefill2.json").read_text())["connector"]
        assert [text, streamed, after_kill, again] == [*expected, expected[0]]
        assert producer.get("bytes_loaded.shm", 0) > 0  # the second producer loaded PROMPTS[0] from the pool
        assert cached >= 256  # the decode instance loaded the prompt's whole chunks from the pool
        assert stats["prefills"] == 2 and stats.get("prefill_failures", 0) == 0
        assert len(pool_keys) >= 2  # the producer stored both prompts' whole chunks (the consumer stores none)
        assert cached_after_kill == 0 and failures == 1
        consumer = json.loads(decode_stats.read_text())["connector"]
        assert consumer.get("bytes_loaded.shm", 0) > 0 and consumer.get("chunks_stored", 0) == 0
    finally:
        ShmTier.destroy(pool)
