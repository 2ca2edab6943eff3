"""The connector's background loads (kvfabric.connectors.vllm.loads) on a real CacheEngine and real paged-cache
tensors laid out as vLLM's CPU cache: async loads spread over threads, layer-wise loads, missing and corrupt
chunks. Needs vllm importable (the .venv-vllm venv); skips otherwise."""
from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("vllm")

from kvfabric import CacheEngine, Config, KVLayout  # noqa: E402
from kvfabric.connectors.paged import CpuPagedLayer  # noqa: E402
from kvfabric.connectors.vllm.loads import Loader  # noqa: E402
from kvfabric.connectors.vllm.metadata import LoadSpec  # noqa: E402
from kvfabric.observe.counters import Counters  # noqa: E402

CHUNK, BLOCK = 32, 16
LAYOUT = KVLayout(3, 2, 8, "float32")


@pytest.fixture()
def setup(tmp_path):
    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})
    writer = CacheEngine(config, LAYOUT, "m")
    tokens = list(range(1, 4 * CHUNK + 1))
    kv = torch.randn(LAYOUT.shape(len(tokens)), generator=torch.Generator().manual_seed(0))
    writer.store(tokens, kv)
    writer.flush()
    writer.close()
    engine = CacheEngine(config, LAYOUT, "m")  # fresh: its process-memory tier is empty, chunks come from disk
    layers = [CpuPagedLayer(torch.zeros(20, 2, BLOCK, 16), BLOCK) for _ in range(LAYOUT.num_layers)]
    loader = Loader(engine, Counters(), BLOCK, num_threads=2)
    loader.bind(layers)
    yield engine, loader, layers, tokens, kv, tmp_path
    loader.stop()
    engine.close()


def _paged_kv(layers, block_ids, start, end):
    out = torch.empty(LAYOUT.shape(end - start))
    for index, layer in enumerate(layers):
        layer.gather(block_ids, start, end, out[index])
    return out


def _wait_async(loader):
    outcomes = []
    while loader.num_async:
        loader.wait_finished(1.0)
        outcomes += loader.take_finished()
    return outcomes


def test_async_load_places_every_layer(setup):
    engine, loader, layers, tokens, kv, _ = setup
    keys = engine.keys(tokens)
    block_ids = [7, 3, 12, 0, 5, 9, 1, 18]  # 8 blocks of 16 = 128 tokens
    spec = LoadSpec("r", keys[1:], CHUNK + 16, 4 * CHUNK - 1, block_ids, is_async=True)  # a local prefix of 48
    loader.start_async(spec)
    (outcome,) = _wait_async(loader)
    assert outcome.req_id == "r" and outcome.end == spec.end and not outcome.bad_blocks
    assert outcome.stats.loaded_tokens == spec.end - spec.start
    assert dict(outcome.stats.bytes_loaded)["disk"] > 0
    assert torch.equal(_paged_kv(layers, block_ids, spec.start, spec.end), kv[:, :, :, spec.start:spec.end])
    assert not engine.tier_keys("cpu")  # read for vLLM's cache only: not promoted into process memory


def test_idle_worker_thread_loads_the_chunks_itself(setup):
    """help(): the thread that bound the layers (the worker's) claims and loads the chunks no loader thread took;
    another thread has no placer or staging buffer and helps with nothing."""
    engine, loader, layers, tokens, kv, _ = setup
    loader.stop()  # no loader thread left: every chunk is the helper's
    keys = engine.keys(tokens)
    block_ids = [7, 3, 12, 0, 5, 9, 1, 18]
    loader.start_async(LoadSpec("r", keys, 0, 4 * CHUNK, block_ids, is_async=True))
    other = []
    thread = threading.Thread(target=lambda: other.append(loader.help(5.0)))
    thread.start()
    thread.join()
    assert other == [0] and loader.num_async == 1 and not loader.take_finished()
    assert loader.help(5.0) == 4
    (outcome,) = loader.take_finished()
    assert outcome.end == 4 * CHUNK and not outcome.bad_blocks
    assert torch.equal(_paged_kv(layers, block_ids, 0, 4 * CHUNK), kv)
    assert loader.help(5.0) == 0  # nothing left to claim


def test_beside_a_forward_one_thread_loads_and_the_others_resume_after_it(setup, monkeypatch):
    """set_forward(True): the first load thread to claim a chunk loads the load's chunks, the other one's wake-up
    claims none; a step without a forward wakes the other, which loads what is left while the first still holds
    its chunk."""
    engine, loader, layers, tokens, kv, _ = setup
    placed: list[tuple[str, int]] = []
    first_holds, release_first, other_done = (threading.Event() for _ in range(3))
    returned, returns = [], threading.Condition()  # the threads whose drain returned
    place, drain = loader._place, loader._drain

    def recorded_place(job, i, source):
        name = threading.current_thread().name
        placed.append((name, i))
        if name == placed[0][0]:
            first_holds.set()
            assert release_first.wait(10)
        place(job, i, source)
        if sum(who != placed[0][0] for who, _ in placed) == 3:
            other_done.set()

    def recorded_drain(staging, deadline=None):
        num_done = drain(staging, deadline)
        with returns:
            returned.append(threading.current_thread().name)
            returns.notify_all()
        return num_done

    monkeypatch.setattr(loader, "_place", recorded_place)
    monkeypatch.setattr(loader, "_drain", recorded_drain)
    loader.set_forward(True)
    block_ids = [7, 3, 12, 0, 5, 9, 1, 18]
    loader.start_async(LoadSpec("r", engine.keys(tokens), 0, 4 * CHUNK, block_ids, is_async=True))
    assert first_holds.wait(10)
    first = placed[0][0]
    other = "kvfabric-load-1" if first == "kvfabric-load-0" else "kvfabric-load-0"
    with returns:
        assert returns.wait_for(lambda: other in returned, 10)
    assert placed == [(first, 0)]  # the other thread's wake-up claimed nothing
    loader.set_forward(False)
    assert other_done.wait(10)
    assert placed == [(first, 0), (other, 1), (other, 2), (other, 3)]
    release_first.set()
    (outcome,) = _wait_async(loader)
    assert outcome.end == 4 * CHUNK and not outcome.bad_blocks
    assert torch.equal(_paged_kv(layers, block_ids, 0, 4 * CHUNK), kv)


def test_a_bug_in_a_helped_chunk_fails_that_load_not_the_worker(setup, monkeypatch):
    """help() runs on vLLM's worker thread: an exception in a chunk fails the chunk (recomputed), never escapes."""
    engine, loader, layers, tokens, kv, _ = setup
    loader.stop()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(loader, "_place", broken)
    loader.start_async(LoadSpec("r", engine.keys(tokens), 0, 4 * CHUNK, list(range(8)), is_async=True))
    assert loader.help(5.0) == 4
    (outcome,) = loader.take_finished()
    assert outcome.end == 0 and outcome.bad_blocks == tuple(range(8))


def test_async_load_stops_at_a_corrupt_chunk(setup):
    engine, loader, layers, tokens, kv, tmp_path = setup
    keys = engine.keys(tokens)
    path = next(tmp_path.glob(f"??/{keys[2].hex()}.kvc"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    block_ids = list(range(8))
    loader.start_async(LoadSpec("r", keys, 0, 4 * CHUNK, block_ids, is_async=True))
    (outcome,) = _wait_async(loader)
    assert outcome.end == 2 * CHUNK  # chunks 0-1 in place, 2 corrupt, 3 not used
    assert outcome.bad_blocks == (4, 5, 6, 7)
    assert outcome.stats.failed_tokens == 2 * CHUNK
    assert torch.equal(_paged_kv(layers, block_ids, 0, 2 * CHUNK), kv[:, :, :, :2 * CHUNK])
    assert engine.stats().counters.get("corrupt.disk") == 1


def test_layered_load_waits_per_layer_and_reports_a_missing_chunk(setup):
    engine, loader, layers, tokens, kv, _ = setup
    keys = engine.keys(tokens)
    good = LoadSpec("a", keys[:2], 0, 2 * CHUNK, [4, 5, 6, 7])
    missing = LoadSpec("b", keys[:1] + [b"\0" * 32], 0, 2 * CHUNK, [8, 9, 10, 11])
    loader.start_layered([good, missing])
    for index in range(LAYOUT.num_layers):
        loader.wait_layer(index)
        got = torch.empty(2, 2, 2 * CHUNK, 8)
        layers[index].gather(good.block_ids, 0, 2 * CHUNK, got)
        assert torch.equal(got, kv[index, :, :, :2 * CHUNK])  # layer `index` is in place once its wait returns
    outcomes = {o.req_id: o for o in loader.finish_layered()}
    assert outcomes["a"].end == 2 * CHUNK and not outcomes["a"].bad_blocks
    assert outcomes["b"].end == CHUNK and outcomes["b"].bad_blocks == (10, 11)
    assert loader.finish_layered() == []


def test_load_threads_run_niced_so_a_running_forward_keeps_most_of_the_cores(setup):
    import os

    _, loader, *_ = setup
    assert len(loader._tids) == 2
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert [os.getpriority(os.PRIO_PROCESS, tid) for tid in loader._tids] == [min(19, base + loader.nice)] * 2
    assert base == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # the caller's thread is untouched


def test_async_load_of_a_partial_last_chunk(tmp_path):
    """With save_partial_chunk, a prompt's trailing partial chunk is stored and loaded: all but one token reused."""
    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["disk"], "disk": {"path": str(tmp_path)},
                               "save_partial_chunk": True})
    tokens = list(range(1, 2 * CHUNK + 11))  # 2 whole chunks + 10 tokens
    kv = torch.randn(LAYOUT.shape(len(tokens)), generator=torch.Generator().manual_seed(1))
    with CacheEngine(config, LAYOUT, "m") as engine:
        assert engine.store(tokens, kv) == 3
        engine.flush()
        layers = [CpuPagedLayer(torch.zeros(8, 2, BLOCK, 16), BLOCK) for _ in range(LAYOUT.num_layers)]
        loader = Loader(engine, Counters(), BLOCK, num_threads=1)
        loader.bind(layers)
        block_ids = [3, 1, 4, 0, 6]
        end = len(tokens) - 1  # vLLM computes the last token
        loader.start_async(LoadSpec("r", engine.keys(tokens), 0, end, block_ids, True, len(tokens)))
        (outcome,) = _wait_async(loader)
        loader.stop()
    assert outcome.end == end and not outcome.bad_blocks
    assert torch.equal(_paged_kv(layers, block_ids, 0, end), kv[:, :, :, :end])


def test_async_load_from_the_shm_pool_is_in_place_and_a_slot_reused_mid_scatter_is_recomputed(monkeypatch):
    """The P/D decode path: chunks are scattered straight out of the pool (no copy into a staging buffer). A
    producer that rewrites chunk 1's slot while the loader scatters it makes the load stop there (torn)."""
    import uuid

    from kvfabric.tiers.shm import ShmTier

    name = f"test-loads-{uuid.uuid4().hex[:8]}"
    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["shm"], "shm": {"name": name, "capacity": "8MiB"}})
    tokens = list(range(1, 4 * CHUNK + 1))
    kv = torch.randn(LAYOUT.shape(len(tokens)), generator=torch.Generator().manual_seed(2))
    producer = ShmTier(name, 8 << 20)  # another process's view of the same pool: the writer
    try:
        with CacheEngine(config, LAYOUT, "m") as engine:
            assert engine.store(tokens, kv) == 4
            engine.flush()
            keys = engine.keys(tokens)
            layers = [CpuPagedLayer(torch.zeros(10, 2, BLOCK, 16), BLOCK) for _ in range(LAYOUT.num_layers)]
            loader = Loader(engine, Counters(), BLOCK, num_threads=1)  # one thread: chunks in order
            loader.bind(layers)
            block_ids = list(range(8))
            loader.start_async(LoadSpec("a", keys, 0, 4 * CHUNK, block_ids, is_async=True))
            (whole,) = _wait_async(loader)
            assert whole.end == 4 * CHUNK and not whole.bad_blocks
            assert torch.equal(_paged_kv(layers, block_ids, 0, 4 * CHUNK), kv)
            assert loader.counters["load_torn_chunks"] == 0
            calls = []
            real_scatter = CpuPagedLayer.scatter

            def scatter_while_a_writer_reuses_chunk_1(layer, block_ids, lo, hi, src):
                calls.append(lo)
                if lo == CHUNK and calls.count(CHUNK) == 1:  # chunk 1's first layer: its slot is rewritten
                    assert producer.put(keys[1], bytes(producer.get(keys[1])))
                real_scatter(layer, block_ids, lo, hi, src)

            monkeypatch.setattr(CpuPagedLayer, "scatter", scatter_while_a_writer_reuses_chunk_1)
            loader.start_async(LoadSpec("b", keys, 0, 4 * CHUNK, block_ids, is_async=True))
            (torn,) = _wait_async(loader)
            loader.stop()
            assert torn.end == CHUNK and torn.bad_blocks == (2, 3, 4, 5, 6, 7)
            assert loader.counters["load_torn_chunks"] == 1
    finally:
        producer.close()
        ShmTier.destroy(name)


@pytest.mark.parametrize("layered", [False, True])
def test_hybrid_manager_load_uses_each_groups_table_and_window_layers_only_from_window_from(tmp_path, layered):
    """vLLM's hybrid manager: layer i's KV goes through its KV cache group's block table; window layers (0, 1:
    window 40) get rows from window_from only, the null block (id 0) before it is never written, and chunks
    wholly before window_from are read without their window part (fewer bytes)."""
    layout = KVLayout.from_layer_types(["sliding_attention", "sliding_attention", "full_attention"], 2, 8, 40,
                                       "float32")
    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["disk"], "disk": {"path": str(tmp_path)}})
    tokens = list(range(1, 4 * CHUNK + 1))
    kv = torch.randn(layout.shape(len(tokens)), generator=torch.Generator().manual_seed(2))
    with CacheEngine(config, layout, "m") as engine:
        engine.store(tokens, kv)
        engine.flush()
        layers = [CpuPagedLayer(torch.zeros(24, 2, BLOCK, 16), BLOCK) for _ in range(layout.num_layers)]
        loader = Loader(engine, Counters(), BLOCK, num_threads=2)
        loader.bind(layers, [0, 1, 2], {0, 1})
        end = 4 * CHUNK  # window_from(128) with W=40: (128 - 39) // 16 * 16 = 80 (chunk 2 of 4)
        window_from = (end - 40 + 1) // BLOCK * BLOCK
        tables = ([0] * 5 + [5, 6, 7], [0] * 5 + [8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18])
        spec = LoadSpec("r", engine.keys(tokens), 0, end, tables[0], is_async=not layered,
                        group_block_ids=tables, window_from=window_from)
        if layered:
            loader.start_layered([spec])
            (outcome,) = loader.finish_layered()
        else:
            loader.start_async(spec)
            (outcome,) = _wait_async(loader)
        loader.stop()
    assert outcome.end == end and not outcome.bad_blocks
    got = torch.empty(2, 2, end, 8)
    layers[2].gather(tables[2], 0, end, got)
    assert torch.equal(got, kv[2, :, :, :end])  # the full layer: every row, through its own table
    for index in (0, 1):
        got = torch.empty(2, 2, end - window_from, 8)
        layers[index].gather(tables[index], window_from, end, got)
        assert torch.equal(got, kv[index, :, :, window_from:end])
        assert not layers[index].arrays[0][0].any() and not layers[index].arrays[1][0].any()  # null block untouched
    read = dict(outcome.stats.bytes_loaded)["disk"]
    part = layout.part((0,)).num_bytes(CHUNK)  # one layer of one chunk
    assert 4 * part + 2 * 2 * part <= read < 4 * part + 2 * 2 * part + 8 * 1024  # full: 4 chunks; window: 2 (+headers)


def _store_blocks(config, source, table, tokens):
    from kvfabric.kv.blocks import as_words

    with CacheEngine(config, LAYOUT, "m") as writer:
        keys = writer.keys(tokens)
        for i, key in enumerate(keys):
            payload = writer.new_payload(CHUNK, source[0].blocks)
            for index, layer in enumerate(source):
                layer.save_blocks(table, i * CHUNK, (i + 1) * CHUNK, as_words(payload.kv[index]))
            assert writer.store_chunks([(key, payload)]) == [True]
    return keys


def test_layered_load_of_block_layout_chunks(tmp_path):
    """The synchronous layer-wise path copies block-layout chunks (read and verified whole) layer by layer."""
    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})
    source = [CpuPagedLayer(torch.randn(20, 2, BLOCK, 16), BLOCK) for _ in range(LAYOUT.num_layers)]
    keys = _store_blocks(config, source, list(range(8)), list(range(1, 4 * CHUNK + 1)))
    engine = CacheEngine(config, LAYOUT, "m")
    layers = [CpuPagedLayer(torch.zeros(20, 2, BLOCK, 16), BLOCK) for _ in range(LAYOUT.num_layers)]
    loader = Loader(engine, Counters(), BLOCK, num_threads=2)
    loader.bind(layers)
    try:
        dst = [10, 11, 12, 13, 14, 15, 16, 17]
        loader.start_layered([LoadSpec("r", keys, 16, 4 * CHUNK - 1, dst)])  # from a block inside chunk 0
        for index in range(LAYOUT.num_layers):
            loader.wait_layer(index)
        (outcome,) = loader.finish_layered()
        assert outcome.end == 4 * CHUNK - 1 and not outcome.bad_blocks
        assert torch.equal(_paged_kv(layers, dst, 16, 4 * CHUNK - 1), _paged_kv(source, list(range(8)), 16, 4 * CHUNK - 1))
    finally:
        loader.stop()
        engine.close()


def test_async_load_of_block_layout_chunks_checks_them_while_copying(tmp_path):
    """Chunks saved in the layers' own block layout (what the worker saves) load from disk slab by slab, exactly;
    a flipped payload byte is found by the hash taken during the copy: the load stops there, the chunk is gone."""
    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})
    source = [CpuPagedLayer(torch.randn(20, 2, BLOCK, 16), BLOCK) for _ in range(LAYOUT.num_layers)]
    table = list(range(8))
    keys = _store_blocks(config, source, table, list(range(1, 4 * CHUNK + 1)))
    path = next(tmp_path.glob(f"??/{keys[2].hex()}.kvc"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    engine = CacheEngine(config, LAYOUT, "m")
    layers = [CpuPagedLayer(torch.zeros(20, 2, BLOCK, 16), BLOCK) for _ in range(LAYOUT.num_layers)]
    counters = Counters()
    loader = Loader(engine, counters, BLOCK, num_threads=2)
    loader.bind(layers)
    try:
        dst = [10, 11, 12, 13, 14, 15, 16, 17]
        loader.start_async(LoadSpec("r", keys, 0, 4 * CHUNK, dst, is_async=True))
        (outcome,) = _wait_async(loader)
        assert outcome.end == 2 * CHUNK and outcome.bad_blocks == (14, 15, 16, 17)
        assert torch.equal(_paged_kv(layers, dst, 0, 2 * CHUNK), _paged_kv(source, table, 0, 2 * CHUNK))
        assert engine.stats().counters.get("corrupt.disk") == 1 and not path.exists()
        assert counters.snapshot().get("load_verify_ns", 0) > 0
    finally:
        loader.stop()
        engine.close()


def _fresh_loader(config):
    """(engine, zeroed paged layers, a loader bound to them) over chunks stored before."""
    engine = CacheEngine(config, LAYOUT, "m")
    layers = [CpuPagedLayer(torch.zeros(20, 2, BLOCK, 16), BLOCK) for _ in range(LAYOUT.num_layers)]
    loader = Loader(engine, Counters(), BLOCK, num_threads=2)
    loader.bind(layers)
    return engine, layers, loader


def test_async_load_of_a_truncated_block_layout_chunk_is_recomputed(tmp_path):
    """A chunk file shorter than its header says (found before any mapping or by the slab reads) fails its chunk:
    its blocks and the rest of the load are recomputed; the chunks before it are in place."""
    config = Config.from_dict({"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})
    source = [CpuPagedLayer(torch.randn(20, 2, BLOCK, 16), BLOCK) for _ in range(LAYOUT.num_layers)]
    table = list(range(8))
    keys = _store_blocks(config, source, table, list(range(1, 4 * CHUNK + 1)))
    path = next(tmp_path.glob(f"??/{keys[1].hex()}.kvc"))
    path.write_bytes(path.read_bytes()[:-100])
    engine, layers, loader = _fresh_loader(config)
    dst = list(range(10, 18))
    try:
        loader.start_async(LoadSpec("r", keys, 0, 4 * CHUNK, dst, is_async=True))
        (outcome,) = _wait_async(loader)
        assert outcome.end == CHUNK and outcome.bad_blocks == (12, 13, 14, 15, 16, 17)
        assert torch.equal(_paged_kv(layers, dst, 0, CHUNK), _paged_kv(source, table, 0, CHUNK))
    finally:
        loader.stop()
        engine.close()
