"""The vLLM connector with `mode: server`: its worker stores through the host's `kvfabric server`, and its scheduler
asks the worker's cache, which asks that server, so lookups see stores from any process.
Real server parts (pool, service, Unix socket) in a thread; the connector's own scheduler and worker classes.
Needs `vllm` (the .venv-vllm, see scripts/setup_vllm_venv.sh); skips without it."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from kvfabric.cache.protocol import ChunkHit
from kvfabric.cache.remote import RemoteCache
from tests.server_fixtures import CHUNK, LAYOUT, client_config, random_kv, server_config, server_in_thread, tokens_of


def test_scheduler_sees_worker_stores_through_the_server(tmp_path):
    pytest.importorskip("vllm")
    from kvfabric.connectors.lookup import LookupClient
    from kvfabric.connectors.vllm.scheduler import SchedulerSide
    from kvfabric.connectors.vllm.worker import WorkerSide

    data = server_config(tmp_path)
    config = client_config(data)
    tokens, kv = tokens_of(3 * CHUNK, 1), random_kv(3 * CHUNK, 1)
    folder = tempfile.mkdtemp(prefix="kvf-lookup-")  # short: a Unix socket path has at most 107 bytes
    path = os.path.join(folder, "lookup.sock")
    with server_in_thread(tmp_path, data):
        worker = WorkerSide(config, LAYOUT, "m", 16, {}, lookup_path=path)
        scheduler = SchedulerSide(config, LAYOUT, "m", 16, "tokens", client=LookupClient(path))
        assert isinstance(worker.engine, RemoteCache)
        keys = scheduler.lookup.keys(tokens)
        assert scheduler.lookup.prefix(keys).num_chunks == 0
        for i in (0, 1):  # what the worker's Saver does with each gathered chunk
            payload = worker.engine.new_payload()
            payload.kv.copy_(kv[:, :, :, i * CHUNK:(i + 1) * CHUNK, :])
            assert worker.engine.store_chunks([(keys[i], payload)]) == [True]
        hit = scheduler.lookup.prefix(keys)
        assert (hit.num_chunks, hit.num_in_memory) == (2, 0)
        out = torch.empty(LAYOUT.shape(CHUNK), dtype=torch.float16)
        assert isinstance(worker.engine.read_into(keys[1], out), ChunkHit)
        assert torch.equal(out, kv[:, :, :, CHUNK:2 * CHUNK, :])
        assert worker.worker_meta() is None  # nothing to report: the scheduler asks the worker's cache
    assert scheduler.lookup.prefix(keys).num_chunks == 0  # server gone: a miss, not an error
    worker.close()
    scheduler.lookup.close()
    assert not os.path.exists(path)  # the worker's lookup socket goes with it
    os.rmdir(folder)


def test_the_loader_loads_through_the_server(tmp_path):
    """The worker's background loads (connectors.vllm.loads) with mode: server: every keyword the loader passes
    to open_chunk is accepted, and the KV lands in the paged cache."""
    pytest.importorskip("vllm")
    from kvfabric.connectors.paged import CpuPagedLayer
    from kvfabric.connectors.vllm.loads import Loader
    from kvfabric.connectors.vllm.metadata import LoadSpec
    from kvfabric.observe.counters import Counters

    data = server_config(tmp_path)
    tokens, kv = tokens_of(2 * CHUNK, 2), random_kv(2 * CHUNK, 2)
    block = 16
    with server_in_thread(tmp_path, data), RemoteCache(client_config(data), LAYOUT, "m") as engine:
        keys = engine.keys(tokens)
        for i in (0, 1):
            payload = engine.new_payload()
            payload.kv.copy_(kv[:, :, :, i * CHUNK:(i + 1) * CHUNK, :])
            assert engine.store_chunks([(keys[i], payload)]) == [True]
        heads, dim = kv.shape[2], kv.shape[4]
        layers = [CpuPagedLayer(torch.zeros(2 * CHUNK // block, heads, block, 2 * dim, dtype=kv.dtype), block)
                  for _ in range(LAYOUT.num_layers)]
        loader = Loader(engine, Counters(), block, num_threads=2)
        loader.bind(layers)
        block_ids = list(range(2 * CHUNK // block))
        loader.start_async(LoadSpec("r", keys, 0, 2 * CHUNK, block_ids, is_async=True))
        outcomes = []
        while loader.num_async:
            loader.wait_finished(1.0)
            outcomes += loader.take_finished()
        loader.stop()
    (outcome,) = outcomes
    assert outcome.end == 2 * CHUNK and not outcome.bad_blocks and loader.counters["load_missing_chunks"] == 0
    for index, layer in enumerate(layers):
        got = torch.empty(2, heads, 2 * CHUNK, dim, dtype=kv.dtype)
        layer.gather(block_ids, 0, 2 * CHUNK, got)
        assert torch.equal(got, kv[index]), index
