"""kvfabric's metrics and KV events inside vLLM (the .venv-vllm venv; skips without vllm):
- our standalone ZMQ publisher's payloads decode with vLLM's own KVEventBatch classes (the same wire format);
- `vllm serve` with KVFabricConnector and `--kv-events-config`: its /metrics shows kvfabric_* beside vllm:*, and
  a ZMQ subscriber receives our BlockStored events (chunk keys, the chunk's 256 token ids, parent chain) through
  vLLM's own publisher.

    .venv-vllm/bin/python -m pytest -m "slow or not slow" tests/test_vllm_observability.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
import httpx  # noqa: E402
import msgspec  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from kvfabric import Config, KVLayout  # noqa: E402
from kvfabric.cache.builder import build_engine
from kvfabric.config import CpuTierConfig, KVEventsConfig  # noqa: E402
from tests.cluster_scripts.helpers import free_port, wait_for  # noqa: E402

CHUNK = 256


def test_our_publisher_speaks_vllms_wire_format():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = Config(chunk_size=16, tiers=("cpu",), cpu=CpuTierConfig(capacity=1 << 22),
                    kv_events=KVEventsConfig(enabled=True, endpoint=endpoint, interval_s=0.05))
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        with build_engine(config, layout, "m") as engine:
            tokens = list(range(48))
            batches: list[KVEventBatch] = []
            for attempt in range(100):  # PUB drops what it sends before the subscriber has joined
                engine.store(tokens, torch.randn(layout.shape(48)))
                if sub.poll(300):
                    batches.append(decoder.decode(sub.recv_multipart()[2]))
                    break
                engine.delete(tokens)
            engine.delete(tokens)
            assert sub.poll(10_000)
            batches.append(decoder.decode(sub.recv_multipart()[2]))
            keys = [bytes(k) for k in engine.keys(tokens)]
    finally:
        sub.close(0)
        ctx.term()
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    removed = [e for b in batches for e in b.events if isinstance(e, BlockRemoved)]
    assert stored[-1].block_hashes == keys and stored[-1].token_ids == tokens and stored[-1].block_size == 16
    assert removed[-1].block_hashes == keys


def _model() -> str:
    from tests.test_vllm_connector import _model_dir
    return _model_dir()


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


@pytest.mark.slow
def test_vllm_serve_shows_kvfabric_metrics_and_publishes_our_kv_events(tmp_path):
    model = _model()
    port = free_port()
    endpoint = f"ipc://{tmp_path}/kv-events.sock"  # vLLM binds ipc:// endpoints (tcp://host:port it connects to)
    extra = {"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path / "cache")},
             "model_id": "kvfabric-test-smollm2"}
    transfer = {"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric.connectors.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": extra}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)  # before vLLM binds it: ZMQ connects once it exists
    argv = [str(Path(sys.executable).parent / "vllm"), "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0", "--kv-transfer-config", json.dumps(transfer),
            "--kv-events-config", json.dumps(events)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")}
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    prompt = [(i * 7919) % 20000 + 100 for i in range(3 * CHUNK + 40)]  # token ids: 3 whole chunks
    try:
        def ready() -> bool:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(ready, 900, 1.0)
        name = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        for _ in range(3):  # the stats of a step leave the worker at most once a second: several requests
            reply = httpx.post(base + "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 4,
                                                                 "temperature": 0}, timeout=600)
            assert reply.status_code == 200, reply.text
            time.sleep(1.2)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ours: list[BlockStored] = []
        seen: list[tuple[str, int]] = []
        deadline = time.monotonic() + 60
        while len(ours) < 3 and time.monotonic() < deadline:
            if sub.poll(1000):
                batch = decoder.decode(sub.recv_multipart()[2])
                seen += [(type(e).__name__, getattr(e, "block_size", 0)) for e in batch.events]
                ours += [e for e in batch.events if isinstance(e, BlockStored) and e.block_size == CHUNK]
        samples = _scrape(base + "/metrics")
    finally:
        server.terminate()
        server.wait(timeout=120)
        log.close()
        sub.close(0)
        ctx.term()
    assert len(ours) == 3, f"kvfabric's BlockStored events: {ours}; all events seen: {seen}"
    for i, event in enumerate(ours):
        assert len(event.block_hashes) == 1 and len(event.block_hashes[0]) == 32
        assert event.token_ids == prompt[i * CHUNK:(i + 1) * CHUNK]
        assert event.parent_block_hash == (ours[i - 1].block_hashes[0] if i else None)
    assert _value(samples, "kvfabric_requested_tokens_total", op="lookup") >= len(prompt)
    assert _value(samples, "kvfabric_stored_chunks_total") == 3
    assert _value(samples, "kvfabric_tier_usage_bytes", tier="disk") > 0
    assert _value(samples, "kvfabric_store_seconds_count", op="store_chunk") == 3
    assert any(n.startswith("vllm:") for n, _ in samples)  # beside vLLM's own metrics, on the same endpoint
    assert all(dict(lab).get("model_name") for n, lab in samples if n.startswith("kvfabric_stored_chunks"))
