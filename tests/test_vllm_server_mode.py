"""The vLLM connector with `mode: server`: its worker stores through the host's `kvfabric server` and its scheduler
asks that server (no mirror of the worker's memory tier), so lookups in one process see stores from another.
Real server parts (pool, service, Unix socket) in a thread; the connector's own scheduler and worker classes.
Needs `vllm` (the .venv-vllm, see scripts/setup_vllm_venv.sh); skips without it."""
from __future__ import annotations

import pytest
import torch

from kvfabric.engine import ChunkHit
from kvfabric.remote import RemoteCache
from tests.server_fixtures import CHUNK, LAYOUT, client_config, random_kv, server_config, server_in_thread, tokens_of


def test_scheduler_sees_worker_stores_through_the_server(tmp_path):
    pytest.importorskip("vllm")
    from kvfabric.connectors.vllm.scheduler import SchedulerSide
    from kvfabric.connectors.vllm.worker import WorkerSide

    data = server_config(tmp_path)
    config = client_config(data)
    tokens, kv = tokens_of(3 * CHUNK, 1), random_kv(3 * CHUNK, 1)
    with server_in_thread(tmp_path, data):
        worker = WorkerSide(config, LAYOUT, "m", 16, {})
        scheduler = SchedulerSide(config, LAYOUT, "m", 16, "tokens")
        assert isinstance(worker.engine, RemoteCache) and not worker.mirrored
        assert not scheduler.lookup.has_memory_tier and not scheduler.lookup.tiers
        keys = scheduler.lookup.keys(tokens)
        assert scheduler.lookup.prefix(keys).num_chunks == 0
        for i in (0, 1):  # what the worker's Saver does with each gathered chunk
            payload = worker.engine.new_payload()
            payload.kv.copy_(kv[:, :, :, i * CHUNK:(i + 1) * CHUNK, :])
            assert worker.engine.store_chunk(keys[i], payload)
        hit = scheduler.lookup.prefix(keys)
        assert (hit.num_chunks, hit.num_in_memory) == (2, 0)
        found = worker.engine.read_chunk(keys[1], out=torch.empty(LAYOUT.shape(CHUNK), dtype=torch.float16))
        assert isinstance(found, ChunkHit) and torch.equal(found.kv, kv[:, :, :, CHUNK:2 * CHUNK, :])
        assert worker.worker_meta() is None  # nothing to mirror: the scheduler asks the server
    assert scheduler.lookup.prefix(keys).num_chunks == 0  # server gone: a miss, not an error
    worker.close()
    scheduler.lookup.close()
